"""What the serving parts agree on, defined once: the router (``router.py``, nginx), the cluster
objects (``plugins/serving.py``: Airflow's image holds this file), the OpenAI front
(``front.py``), the deploy step (``platforms.py``, ``canary.py``) and the engine
(``triton_models/llm_generate/engine.py``: the export copies this file beside it, into every
exported version).

Standard library only.
"""

from __future__ import annotations

# -- the split: tracks, weights, routed paths -------------------------------------------------------
TRACKS = ("stable", "canary")  # the public route's weighted backends, in its order
BASELINE = "baseline"  # the stable version at the canary's size, beside it (no route weight; clusters)
WEIGHT_SCALE = 1000  # HTTPRoute weights are integers: per mille keeps 0.1% steps expressible
NO_VERSION = "none"  # the version header of a backend serving none (a header may not be empty)
ANNOTATION = "llm-pipeline/"  # the prefix of the rollout state's annotations on cluster objects
ROUTED_MODELS = ("llm", "llm_generate")  # Triton's models behind the split (logits; text in, text out)
ROUTED_ACTIONS = ("infer", "generate", "generate_stream")  # the inference paths of each (deploy's listener)
# What clients reach of Triton's inference: the logits model's ``infer``. Text goes through the
# OpenAI API (/v1), which cancels a request its client abandoned, streamed or not; Triton notices
# a gone client only when it writes, so a non-streamed generate request there would run on,
# holding a slot, past the router's per-client connection limit
PUBLIC_LOGITS_ACTIONS = ("infer",)

# -- headers ----------------------------------------------------------------------------------------
VERSION_HEADER = "X-Model-Version"  # on every answer: the version that answered
ROUTE_HEADER = "X-Route-Version"  # router -> front: the version the split picked
# On the router's /v1 requests (one API, every model line): each served line's split, as
# "<line>=<picked>[:<stable>]" entries joined by "," (a version empty where the line serves none;
# the demo line's key is "demo"); the front picks the entry of the line the request's ``model``
# names. A single version alone (deploy's requests to the front, a cluster track's) is the version
# of whichever line the request names
ROUTE_ENTRIES, ROUTE_LINE, ROUTE_STABLE = ",", "=", ":"
# Deploy's own /v1 requests carry a pair id (32 hex digits) and are marked for the record, their
# mirrored copies too (while a version shadows): the front keeps each answer under the id
RECORD_HEADER, PAIR_HEADER = "X-Shadow-Record", "X-Shadow-Pair"
COPY_HEADER = "X-Shadow-Copy"  # on a mirrored copy only: the front answers 202 and generates it in the background
TRACK_HEADER = "X-Serving-Track"  # the internal HTTPRoute's rules: picks one track (clusters)
SHADOW_TRACK = "shadow"  # its value on deploy's paired shadow requests: stable answers, the canary track gets a copy
CLIENT_HEADER = "X-Client-Address"  # router -> front: the client's address, kept hashed by the capture
# In a cluster the gateway's body-based router (the Gateway API inference extension's) copies a
# request's ``model`` into this header: a model line's HTTPRoute rules match it (deploy sets it on
# its own requests to a line's internal route)
MODEL_HEADER = "X-Gateway-Model-Name"
# Set only by the router or gateway: the public entry removes a client's own (nginx overwrites or
# empties them; the public HTTPRoute's RequestHeaderModifier removes them), so no client picks a
# version, fills deploy's shadow records or speaks for another client
INTERNAL_HEADERS = (ROUTE_HEADER, RECORD_HEADER, PAIR_HEADER, COPY_HEADER, TRACK_HEADER, CLIENT_HEADER)

# -- request limits (the front's request models and the engine's checks) -----------------------------
MAX_BODY_BYTES = 1 << 20  # a request body: the router's public listener and the front refuse larger (413)
SAMPLING_LIMITS = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "top_k": (0, 1 << 20), "seed": (0, (1 << 63) - 1)}
MAX_TOKENS_LIMIT = 1 << 20  # above any context: the engine's own check names the model's context
MAX_STOPS = 4  # OpenAI's limit on a request's stop strings
ENGINE_MAX_STOPS, MAX_STOP_CHARS = MAX_STOPS + 1, 64  # the engine takes the chat template's stop too
CHAT_STOP = "\nUser:"  # the plain chat template's turn marker (models without a template of their own)
