"""Serving: everything between a client and the generation engine, and how a version is rolled out.

- ``contract.py``: what every serving part agrees on (tracks, headers, weight scale, request
  limits), defined once; standard library only (Airflow's image and every exported engine hold it).
- ``protocol.py``: the OpenAI API's request models (Pydantic): one validation path, one error shape.
- ``front.py``: the OpenAI-compatible server (``python -m tasks.serving.front``).
- ``capture.py``: a bounded, scrubbed sample of served traffic, for the drift check.
- ``router.py``: the local nginx router (the split, the shadow mirror, the public allowlist).
- ``platforms.py``: where versions run and how traffic moves (one local Triton, or Kubernetes).
- ``traffic.py``: deploy's bounded load generators (logits requests, streamed completions) and their samples.
- ``analysis.py``: the judge, pure functions over samples (the shadow stage, each traffic step).
- ``canary.py``: the canary report as typed values (verdicts, checks, stage results) and its JSON.
- ``plots.py``: the report's chart (``canary.png``).
- ``triton_models/``: the Triton models each export ships (the logits model, the engine).
"""
