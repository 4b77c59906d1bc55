"""Where versions are served and how traffic is split between them: one interface, two platforms.

The deploy step (``tasks/deploy.py``) walks a canary through :class:`Serving` only:

- :class:`LocalServing` (the default): one Triton process with explicit model control
  serves both versions from its model repository; the nginx router of ``tasks/serving/router.py``
  splits the traffic by rewriting the path to ``/versions/<v>/``.
- :class:`KubernetesServing` (cluster mode): a Triton Deployment per *track* (``stable``,
  ``canary``; rendered by ``plugins/serving.py``), each serving one version that its init
  container stages (``python -m tasks.deploy stage``) from the export named in the pod
  template's annotations; a Gateway API HTTPRoute with weighted ``backendRefs`` splits the
  traffic. Deploy patches the canary Deployment (version, replicas), waits for its rollout,
  patches the HTTPRoute's weights and waits until the gateway accepted that generation. The
  route's annotations hold the rollout state (versions, weight, generation); the deploy lock is
  a ``coordination.k8s.io`` Lease (:mod:`tasks.lib.kube`). A promotion whose stable track does
  not roll out puts that track back on what it served before (:class:`PromotionFailed`).

Both keep the same order of operations: a version is ready before traffic moves to it, and
traffic has moved away (confirmed) before a version is removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import itertools
import json
import os
import shutil
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tasks.config import DEMO, DEMO_LABEL, ServeSettings, Settings, current_line
from tasks.lib import metrics, storage, triton
from tasks.lib.errors import StepError, Terminated, first_line
from tasks.lib.kube import KubeApi, KubeError, Lease, LeaseLost
from tasks.lib.polling import wait_until
from tasks.lib.step import log, stopping
from tasks.serving import memory
from tasks.serving.contract import (
    ANNOTATION,
    BASELINE,
    INTERNAL_HEADERS,
    MODEL_HEADER,
    NO_VERSION,
    RECORD_HEADER,
    ROUTE_HEADER,
    SHADOW_TRACK,
    TRACK_HEADER,
    TRACKS,
    WEIGHT_SCALE,
)
from tasks.serving.router import NginxRouter, Route, served_routes

WEIGHTED_RULES = (0, 1)  # of the public HTTPRoute (plugins/serving.py): Triton's allowlist, then /v1
MIRRORED_RULE = 1  # its /v1 rule: the text endpoint a shadow is judged on
VERSION_KEY, EXPORT_KEY = f"{ANNOTATION}model-version", f"{ANNOTATION}export-uri"
# on a Deployment's own metadata (not its pods'): what the stable track served before a promotion
PREVIOUS_VERSION_KEY, PREVIOUS_EXPORT_KEY = f"{ANNOTATION}previous-model-version", f"{ANNOTATION}previous-export-uri"


class PromotionFailed(StepError):
    """The stable track could not be rolled to the promoted version. ``restored``: it serves
    the version it served before (traffic can go back to it); else all traffic stays on the
    canary track, the one track known to serve a whole version."""

    def __init__(self, message: str, restored: bool) -> None:
        super().__init__(message)
        self.restored = restored


@dataclass(frozen=True)
class Staging:
    """How a version is staged: ``config_variant`` picks one of the export's configs (e.g.
    ``onnxruntime_onnx.gpu``) instead of the served one; it will be served ``beside`` those
    versions of the repository, all within ``serve.memory_budget_mb`` (``enforce_budget``
    false, a rollback's: a warning only)."""

    config_variant: str = ""
    beside: tuple[int, ...] = ()
    enforce_budget: bool = True
    # what the other model lines serve in the same Triton (their serve settings, line, version)
    others: tuple[tuple[ServeSettings, str, int], ...] = ()


def stage_version(export_uri: str, version: int, repository: Path, serve: ServeSettings, scratch: Path,
                  how: Staging = Staging()) -> dict[str, Any]:
    """Copy the export's repository fragment of ``version`` into a Triton model repository
    (replacing an earlier copy of the same version), as ``how`` says. Refused (one line, nothing
    copied) where it and the versions it will be served beside would exceed
    ``serve.memory_budget_mb`` (:mod:`tasks.serving.memory`). Returns the export's parity
    reference (inputs and next tokens of the PyTorch model)."""
    exported = storage.download_tree(export_uri, scratch / "export")
    for model in (serve.triton_model, serve.generate_model):
        if not (exported / "triton" / model / str(version)).is_dir():
            raise StepError(f"{export_uri}: holds no {model} version {version}")
    # the engine's configuration is the model's, not a version's: the one staged here loads them all
    engine_config = exported / "configs" / f"{serve.generate_model}.json"
    incoming = memory.footprint(exported / "triton", serve, version, engine_config)
    served = [memory.footprint(repository, serve, v, engine_config)
              for v in how.beside if (repository / serve.generate_model / str(v) / "generation.json").exists()]
    served += [dataclasses.replace(memory.footprint(repository, other, v, repository / other.generate_model / "config.json"),
                                   line=line)
               for other, line, v in how.others
               if (repository / other.generate_model / str(v) / "generation.json").exists()]
    memory.check_budget(incoming, served, serve, how.enforce_budget)
    for model in (serve.triton_model, serve.generate_model):
        source = exported / "triton" / model / str(version)
        target = repository / model / str(version)
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = target.with_name(f".{version}.staging")
        shutil.rmtree(staged, ignore_errors=True)
        shutil.copytree(source, staged)
        if target.exists():
            shutil.rmtree(target)
        staged.rename(target)
        config = exported / "triton" / model / "config.pbtxt"
        if how.config_variant and model == serve.triton_model:
            config = exported / "configs" / f"{model}.{how.config_variant}.pbtxt"
            if not config.exists():
                raise StepError(f"{export_uri}: no {config.name} (config variant {how.config_variant!r})")
        shutil.copy(config, repository / model / "config.pbtxt")
        shutil.copy(exported / "configs" / f"{model}.json", repository / model / "config.json")
    reference: dict[str, Any] = json.loads((exported / "parity.json").read_text())["reference"]
    return reference


def serve_versions(client: triton.TritonClient, repository: Path, serve: ServeSettings, versions: list[int]) -> None:
    """Make Triton serve exactly ``versions`` of both models from ``repository`` (none: unload them)."""
    models = (serve.triton_model, serve.generate_model)  # generate calls llm: llm first
    if not versions:
        for model in reversed(models):
            client.unload(model)
        return
    for model in models:
        missing = [v for v in versions if not (repository / model / str(v)).is_dir()]
        if missing:
            raise StepError(f"{repository / model}: holds no version {', '.join(map(str, missing))} to serve")
        config = json.loads((repository / model / "config.json").read_text())
        client.load(model, triton.with_versions(config, versions))
        client.wait_ready(model, versions, serve.load_timeout_s)


ROUTE_METRIC = "llm_serving_route_version"  # observability/alerts.yml: LLMServingRouteVersionNotServed


def deploy_lock_file(key: str) -> str:
    """The local deploy lock of a model line (its route's key), beside the router's files."""
    return "deploy.lock" if key == DEMO_LABEL else f"deploy.{key}.lock"


def publish_route(route: Route, serve: ServeSettings, env: Mapping[str, str] | None = None,
                  line: str | None = None) -> None:
    """The versions a line's route sends traffic to, as Pushgateway series (group
    ``serving/route/line/<line>``, replaced at each change, and again when the stack comes up: a
    restarted Pushgateway may hold an older route, or none), one per Triton model of the line
    (``serve``'s): Prometheus compares them with the model versions Triton exports counters for,
    and alerts when the route names one Triton does not serve (restarted empty, unloaded)."""
    tracks = {"stable": route.stable, "canary": route.canary if route.canary_weight > 0 else None,
              "shadow": route.shadow}
    series = {f'{ROUTE_METRIC}{{track="{track}",model="{model}",version="{version}"}}': 1.0
              for track, version in tracks.items() if version is not None
              for model in (serve.triton_model, serve.generate_model)}
    pushed = metrics.push({"serving": "route", "line": line or metrics.line_label()}, series,
                          {ROUTE_METRIC: "1 for each model version the router sends a track's traffic to"}, env)
    if not pushed and (os.environ if env is None else env).get("PUSHGATEWAY_URL"):
        log.error("the route's versions %s were not pushed: until the next push the alert on versions Triton "
                  "does not serve compares with the previous route", route.versions())


def read_shadow_records(front: str, request_ids: list[str]) -> list[dict[str, Any]]:
    """``POST <front>/shadow/records``: what one OpenAI front recorded of those requests."""
    request = urllib.request.Request(f"{front}/shadow/records", data=json.dumps({"ids": request_ids}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            records: list[dict[str, Any]] = json.loads(resp.read())["records"]
    except (OSError, ValueError, KeyError) as exc:
        raise RuntimeError(f"{front}/shadow/records: the shadow's records could not be read ({exc})") from None
    return records


class Serving(Protocol):
    """What deploy needs from a serving platform (see the module docstring)."""

    fresh_baseline: bool  # each step compares the canary with a baseline of stable started beside it
    # metrics() reads each version's counters from the one process that serves it (one Triton
    # locally): a series of reads gives each version's compute time per interval. In a cluster a
    # read through a track's Service reaches one of its pods, and successive reads do not subtract
    per_version_metrics: bool
    # the fronts keep deploy's step streams, routed and baseline, by request id: their engines'
    # timings can be read back (locally; in a cluster the routed streams pass the public route,
    # which keeps no records, so a step's streams are judged as deploy received them)
    step_records: bool

    url: str  # where the canary sends its traffic to the split, as clients' requests go: the router / gateway
    # on deploy's /v1 requests to the split: what a cluster's gateway routes a model line's by
    # (its body-based router sets it from a client's body; deploy does not depend on one)
    model_headers: dict[str, str]

    def lock(self) -> contextlib.AbstractContextManager[None]:
        ...

    def live(self) -> Route:
        ...

    def stage(self, export_uri: str, version: int, scratch: Path, enforce_budget: bool = True) -> dict[str, Any]:
        """Make ``version`` loadable (within ``serve.memory_budget_mb`` beside what serves; not
        ``enforce_budget``, a rollback's: a warning only); return the export's parity reference."""
        ...

    def prepare(self, stable: int | None, canary: int, analysed: bool = True) -> None:
        """Serve ``canary`` beside ``stable`` (both ready, no traffic moved); ``analysed``: and
        what the canary is judged against (a fresh baseline, where the platform has one)."""
        ...

    def route(self, stable: int | None, canary: int | None = None, weight: float = 0.0,
              shadow: int | None = None) -> None:
        """Split traffic so (``shadow``: a copy of each ``/v1`` request goes to that version too,
        its answer to no client), and return once the router applies it."""
        ...

    def shadow_records(self, request_ids: list[str], stable: int, shadow: int) -> list[dict[str, Any]]:
        """The OpenAI fronts' records of those requests (:class:`tasks.serving.front.ShadowRecords`),
        each with the ``version`` that answered it."""
        ...

    def promote(self, version: int) -> None:
        """``version`` (the canary, at 100%) becomes the only version served."""
        ...

    def roll_back(self, stable: int | None) -> None:
        """Traffic back to ``stable`` first (confirmed), then the canary removed."""
        ...

    def smoke_targets(self, version: int) -> list[tuple[str, dict[str, str]]]:
        """Infer URLs (and headers) reaching ``version`` straight and through the router."""
        ...

    def baseline_target(self, stable: int) -> tuple[str, dict[str, str]]:
        """An infer URL (and headers) through the router reaching only ``stable``: the canary
        analysis's baseline stream, on the same path as the routed traffic."""
        ...

    def text_target(self, version: int) -> tuple[str, dict[str, str]]:
        """The OpenAI completions URL (and headers) reaching only ``version``: the smoke test's
        and the text baseline's path (not through the router's split)."""
        ...

    def shadow_target(self) -> tuple[str, dict[str, str]]:
        """The OpenAI completions URL (and headers) of deploy's paired shadow requests: stable
        answers and records each, the shadow gets a copy recorded under the same pair id (the
        public entry removes pair ids: only deploy's path keeps them)."""
        ...

    def metrics(self) -> dict[int, dict[str, float]]:
        """Triton's per-version request counters of the logits model."""
        ...


class LocalServing:
    """One local Triton (explicit model control) behind the local nginx router. Both versions
    run in that one Triton on the same cores: no separate baseline."""

    fresh_baseline = False
    per_version_metrics = True
    step_records = True

    def __init__(self, serve: ServeSettings) -> None:
        missing = [k for k in ("TRITON_URL", "TRITON_REPOSITORY") if not os.environ.get(k)]
        if missing:
            raise StepError(f"{', '.join(missing)} not set: Triton is started by `python -m stack up`")
        self.serve = serve
        self.model_headers: dict[str, str] = {}  # the local front reads the model from the body
        self.client = triton.TritonClient(os.environ["TRITON_URL"])
        self.repository = Path(os.environ["TRITON_REPOSITORY"])
        self.router = NginxRouter.from_env(metrics.line_label())  # this line's split
        # the split, through the router's internal listener (the same routed paths): on the public
        # one the canary would share one client's limits with every other client of the machine
        # (all 127.0.0.1), and a busy neighbour would starve the analysis of samples
        self.url = self.router.internal_url

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """One deploy of a line at a time: two canaries would fight over its split. Two lines'
        deploys run side by side (each its own split; the router serializes their reloads)."""
        self.router.prefix.mkdir(parents=True, exist_ok=True)
        with (self.router.prefix / deploy_lock_file(self.router.line.key)).open("w") as fh:
            log.info("waiting for the deploy lock")
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def live(self) -> Route:
        return self.router.live()

    def stage(self, export_uri: str, version: int, scratch: Path, enforce_budget: bool = True) -> dict[str, Any]:
        """Into the repository, if it fits Triton's memory beside the stable version (a leftover
        canary is rolled back before this one loads: not counted)."""
        stable = self.live().stable
        beside = (stable,) if stable is not None and stable != version else ()
        return stage_version(export_uri, version, self.repository, self.serve, scratch,
                             Staging(beside=beside, enforce_budget=enforce_budget, others=self.other_lines()))

    def other_lines(self) -> tuple[tuple[ServeSettings, str, int], ...]:
        """What the other model lines' routes serve now (one Triton holds every line's versions)."""
        from tasks.config import every_line, line_label

        routes = served_routes(self.router.prefix)
        return tuple((settings.serve, key, version) for line, settings in every_line().items()
                     if (key := line_label(line)) != self.router.line.key and key in routes
                     for version in routes[key].versions())

    def serve_versions(self, versions: list[int]) -> None:
        serve_versions(self.client, self.repository, self.serve, versions)

    def prepare(self, stable: int | None, canary: int, analysed: bool = True) -> None:
        self.serve_versions(sorted({v for v in (stable, canary) if v is not None}))

    def route(self, stable: int | None, canary: int | None = None, weight: float = 0.0,
              shadow: int | None = None) -> None:
        self.router.apply(stable, canary, weight, shadow)
        publish_route(Route(stable, canary, float(weight), shadow=shadow), self.serve)

    def shadow_records(self, request_ids: list[str], stable: int, shadow: int) -> list[dict[str, Any]]:
        # one front answers for every version here: each record names its version
        front = os.environ.get("OPENAI_API_URL", "").rstrip("/")
        if not front:
            raise StepError("OPENAI_API_URL not set: the OpenAI front is started by `python -m stack up`")
        return [{**r, "version": int(r["version"]) if str(r["version"]).isdigit() else None}
                for r in read_shadow_records(front, request_ids)]

    def promote(self, version: int) -> None:
        self.route(version)
        self.serve_versions([version])

    def roll_back(self, stable: int | None) -> None:
        self.route(stable)
        self.serve_versions([stable] if stable is not None else [])

    def smoke_targets(self, version: int) -> list[tuple[str, dict[str, str]]]:
        path = triton.infer_path(self.serve.triton_model, version)
        return [(self.client.url + path, {}), (self.router.internal_url + path, {})]

    def baseline_target(self, stable: int) -> tuple[str, dict[str, str]]:
        return self.router.internal_url + triton.infer_path(self.serve.triton_model, stable), {}

    def text_target(self, version: int) -> tuple[str, dict[str, str]]:
        # the OpenAI front itself, with the version the router would have picked
        front = os.environ.get("OPENAI_API_URL", "").rstrip("/")
        if not front:
            raise StepError("OPENAI_API_URL not set: the OpenAI front is started by `python -m stack up`")
        # marked for the record: a request with a pair id is kept, its engine's timings judged
        return front + "/v1/completions", {ROUTE_HEADER: str(version), RECORD_HEADER: "1"}

    def shadow_target(self) -> tuple[str, dict[str, str]]:
        return self.url + "/v1/completions", {}  # the internal listener: the split, its mirror, pair ids kept

    def metrics(self) -> dict[int, dict[str, float]]:
        url = os.environ.get("TRITON_METRICS_URL")
        if not url:
            return {}
        with urllib.request.urlopen(url, timeout=10) as resp:
            return triton.version_counters(resp.read().decode(), self.serve.triton_model)


# -- cluster ----------------------------------------------------------------------------------


def deployment_patch(version: int | None, export_uri: str, replicas: int,
                     previous: TrackState | None = None) -> dict[str, Any]:
    """JSON merge patch of a track's Deployment: the version its init container stages (read
    through the downward API from these annotations) and its replicas. A new version changes
    the pod template, so the Deployment rolls (surge first: the track never has fewer ready pods).
    ``previous``: what the track served before, kept on the Deployment's own metadata so a later
    deploy can put it back (a promotion interrupted before the stable track rolled out)."""
    annotations = {VERSION_KEY: str(version or ""), EXPORT_KEY: export_uri}
    patch: dict[str, Any] = {"spec": {"replicas": replicas, "template": {"metadata": {"annotations": annotations}}}}
    if previous is not None:
        patch["metadata"] = {"annotations": {PREVIOUS_VERSION_KEY: str(previous.version or ""),
                                             PREVIOUS_EXPORT_KEY: previous.export_uri}}
    return patch


@dataclass(frozen=True)
class TrackState:
    """What a track's Deployment names: the version its pods stage, from where, how many pods."""

    version: int | None
    export_uri: str
    replicas: int

    @classmethod
    def of(cls, deployment: dict[str, Any]) -> TrackState:
        """What its pod template names now."""
        return cls._read(deployment, deployment["spec"]["template"]["metadata"], VERSION_KEY, EXPORT_KEY)

    @classmethod
    def before_promotion(cls, deployment: dict[str, Any]) -> TrackState | None:
        """What it served before its last promotion (recorded on its own metadata), if any."""
        state = cls._read(deployment, deployment["metadata"], PREVIOUS_VERSION_KEY, PREVIOUS_EXPORT_KEY)
        return state if state.version is not None else None

    @classmethod
    def _read(cls, deployment: dict[str, Any], metadata: dict[str, Any], version_key: str,
              export_key: str) -> TrackState:
        annotations = metadata.get("annotations") or {}
        version = str(annotations.get(version_key, ""))
        return cls(int(version) if version.isdigit() else None, str(annotations.get(export_key, "")),
                   int(deployment["spec"].get("replicas", 1)))


def route_patch(names: dict[str, str], route: Route, openai_port: int) -> list[dict[str, Any]]:
    """JSON patch of the HTTPRoute: the weighted rule's two backends (tested by name first, so a
    hand-edited route is refused rather than mis-weighted), the version header each backend
    adds to its responses, and the rollout state in annotations."""
    canary = 0 if route.canary is None else round(route.canary_weight / 100 * WEIGHT_SCALE)
    versions = {"stable": route.stable, "canary": route.canary}
    weights = {"stable": WEIGHT_SCALE - canary, "canary": canary}
    ops: list[dict[str, Any]] = []
    for rule, (index, track) in itertools.product(WEIGHTED_RULES, enumerate(TRACKS)):
        backend = f"/spec/rules/{rule}/backendRefs/{index}"
        ops += [
            {"op": "test", "path": f"{backend}/name", "value": names[track]},
            {"op": "replace", "path": f"{backend}/weight", "value": weights[track]},
            {"op": "replace", "path": f"{backend}/filters/0/responseHeaderModifier/set/0/value",
             "value": NO_VERSION if versions[track] is None else str(versions[track])},
        ]
    # every rule removes the internal headers a client sent, shadowing or not (a route installed
    # before the Triton rule did gets it here too); the /v1 rule mirrors to the canary track while
    # it shadows (Gateway API RequestMirror: the gateway drops the copy's answer). Clients' copies
    # are never recorded: deploy's paired requests take the internal route's shadow rule
    for rule in WEIGHTED_RULES:
        filters: list[dict[str, Any]] = [{"type": "RequestHeaderModifier",
                                          "requestHeaderModifier": {"remove": list(INTERNAL_HEADERS)}}]
        if rule == MIRRORED_RULE and route.shadow is not None:
            filters.append({"type": "RequestMirror",
                            "requestMirror": {"backendRef": {"name": names["canary"], "port": openai_port}}})
        ops.append({"op": "add", "path": f"/spec/rules/{rule}/filters", "value": filters})  # (add: replaces)
    state = {"stable": route.stable, "canary": route.canary, "canary_weight": route.canary_weight,
             "generation": route.generation, "shadow": route.shadow}
    ops.append({"op": "add", "path": f"/metadata/annotations/{ANNOTATION.rstrip('/')}~1route",
                "value": json.dumps(state)})
    return ops


def route_accepted(route_object: dict[str, Any]) -> bool:
    """Every parent gateway accepted the route's current generation."""
    generation = route_object["metadata"].get("generation", 0)
    parents = route_object.get("status", {}).get("parents", [])
    return bool(parents) and all(
        any(c["type"] == "Accepted" and c["status"] == "True" and c.get("observedGeneration", 0) >= generation
            for c in parent.get("conditions", []))
        for parent in parents)


def deployment_rolled_out(deployment: dict[str, Any]) -> bool:
    """Its newest pod template is the only one running, on as many ready pods as wanted."""
    spec, status = deployment["spec"], deployment.get("status", {})
    wanted = spec.get("replicas", 1)
    return (status.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 0)
            and status.get("updatedReplicas", 0) == wanted and status.get("replicas", 0) == wanted
            and status.get("availableReplicas", 0) == wanted)


class KubernetesServing:
    """A Triton Deployment per track behind a Gateway API HTTPRoute (``plugins/serving.py``)."""

    def __init__(self, serve: ServeSettings, namespace: str, api: KubeApi | None = None,
                 model: str | None = None) -> None:
        """``model``: a model line's registered name (None: the demo line's), which its routes'
        ``/v1`` rules match in :data:`MODEL_HEADER` (plugins/serving.py)."""
        missing = [k for k in ("ROUTER_URL", "ROUTER_INTERNAL_URL") if not os.environ.get(k)]
        if missing:
            raise StepError(f"{', '.join(missing)} not set: the gateway's public and internal addresses "
                            "(in the pods' Secret)")
        self.serve, self.cluster = serve, serve.kubernetes
        self.namespace, self.api = namespace, api or KubeApi.in_cluster()
        self.url = os.environ["ROUTER_URL"].rstrip("/")
        self.internal_url = os.environ["ROUTER_INTERNAL_URL"].rstrip("/")  # the track-header rules
        self.names = {track: f"{self.cluster.name}-{track}" for track in (*TRACKS, BASELINE)}
        self.fresh_baseline = self.cluster.fresh_baseline
        self.per_version_metrics = self.step_records = False
        self.exports: dict[int, str] = {}
        self.lease = Lease(self.api, namespace, f"{self.cluster.route}-deploy", int(self.cluster.lease_duration_s))
        self.model_headers = {MODEL_HEADER: model} if model else {}  # on deploy's /v1 requests

    def _path(self, kind: str, name: str) -> str:
        group = "/apis/apps/v1" if kind == "deployments" else "/apis/gateway.networking.k8s.io/v1"
        return f"{group}/namespaces/{self.namespace}/{kind}/{name}"

    def _route_object(self) -> dict[str, Any]:
        found: dict[str, Any] = self.api.call("GET", self._path("httproutes", self.cluster.route))
        return found

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """A ``coordination.k8s.io`` Lease (``<route>-deploy``, see :mod:`tasks.lib.kube`), held
        while this deploy changes serving; released however the deploy ends (a failed release
        is logged, never raised over the deploy's own outcome)."""
        self.lease.acquire()
        try:
            yield
        finally:
            self.lease.release()

    def live(self) -> Route:
        state = self._route_object()["metadata"].get("annotations", {}).get(f"{ANNOTATION}route")
        return Route(**json.loads(state)) if state else Route(stable=None)

    def stage(self, export_uri: str, version: int, scratch: Path, enforce_budget: bool = True) -> dict[str, Any]:
        """The pods stage the files themselves (init container, which checks the pod's one version
        against ``serve.memory_budget_mb``): only the reference comes here."""
        self.exports[version] = export_uri
        reference: dict[str, Any] = storage.read_json(storage.join(export_uri, "parity.json"))["reference"]
        return reference

    def _track(self, track: str) -> dict[str, Any]:
        found: dict[str, Any] = self.api.call("GET", self._path("deployments", self.names[track]))
        return found

    def _set_track(self, track: str, version: int | None, replicas: int, export_uri: str | None = None,
                   previous: TrackState | None = None, wait: bool = True) -> None:
        self.lease.check()
        if export_uri is None:
            export_uri = self.exports.get(version, "") if version is not None else ""
        if version is not None and not export_uri:
            raise StepError(f"version {version} was not staged by this deploy")
        self.api.call("PATCH", self._path("deployments", self.names[track]),
                      deployment_patch(version, export_uri, replicas, previous), "application/merge-patch+json")
        if wait:
            self._wait_rolled_out(track, version)

    def _wait_rolled_out(self, track: str, version: int | None) -> None:
        wait_until(lambda: deployment_rolled_out(self._track(track)), self.cluster.rollout_timeout_s, 5,
                   lambda: StepError(f"deployment {self.names[track]} (version {version}) not ready after "
                                     f"{self.cluster.rollout_timeout_s:g}s: see its pods' events"))

    def prepare(self, stable: int | None, canary: int, analysed: bool = True) -> None:
        """The canary track on the new version (1 pod) and, with a fresh baseline (``analysed``:
        a rollout that will be analysed, not a manual rollback), the baseline
        track on stable's version and export at the same size, started together: the analysis
        compares two pods of the same age, size and warm-up (Kayenta: a long-running, warm
        primary is not a fair baseline)."""
        baseline = self.fresh_baseline and stable is not None and analysed
        if baseline:
            serving_now = TrackState.of(self._track("stable"))
            if serving_now.version != stable or not serving_now.export_uri:
                raise StepError(f"deployment {self.names['stable']} names version {serving_now.version} "
                                f"(export {serving_now.export_uri or 'none'}), not stable version {stable}: no baseline "
                                f"can be started from it; run the llm_rollback DAG with target {stable}")
            self._set_track(BASELINE, stable, 1, serving_now.export_uri, wait=False)
        self._set_track("canary", canary, 1)
        if baseline:
            self._wait_rolled_out(BASELINE, stable)

    def route(self, stable: int | None, canary: int | None = None, weight: float = 0.0,
              shadow: int | None = None) -> None:
        self.lease.check()
        route = Route(stable, canary, float(weight), self.live().generation + 1, shadow)
        self.api.call("PATCH", self._path("httproutes", self.cluster.route),
                      route_patch(self.names, route, self.cluster.ports["openai"]), "application/json-patch+json")
        publish_route(route, self.serve)  # what the route now says, accepted yet or not
        wait_until(lambda: route_accepted(self._route_object()), self.cluster.route_timeout_s, 1,
                   lambda: StepError(f"httproute {self.cluster.route}: generation not accepted by its gateway "
                                     f"in {self.cluster.route_timeout_s:g}s"))

    def promote(self, version: int) -> None:
        """The canary track carries all traffic while the stable track rolls to ``version``; then
        the route moves to stable and the canary track empties. If the stable track does not
        roll out (no room for its pods, a pod that never gets ready), it is put back on what it
        served (surge-first rolling: those pods were never taken away) and
        :class:`PromotionFailed` says whether that worked."""
        before = TrackState.of(self._track("stable"))
        if self.fresh_baseline:  # its pod's room, for the stable track's surge pods
            self._set_track(BASELINE, None, 0, wait=False)
        try:
            self._set_track("stable", version, self.cluster.replicas, previous=before)
        except LeaseLost:
            raise
        except (StepError, KubeError, OSError, Terminated) as exc:
            try:
                self._put_back("stable", before)
                restored = True
            except (StepError, KubeError, OSError) as undo:
                log.error("putting the stable track back on version %s failed: %s", before.version, first_line(undo))
                restored = False
            if isinstance(exc, Terminated):
                raise
            where = f"back on version {before.version}" if restored else f"NOT back on version {before.version}"
            raise PromotionFailed(f"promotion: {first_line(exc)}; the stable track is {where}", restored) from None
        self.route(version)
        self._set_track("canary", None, 0)

    def _put_back(self, track: str, state: TrackState) -> None:
        """``track`` serving ``state`` again (waiting for it unless the step is stopping: SIGTERM)."""
        self._set_track(track, state.version, state.replicas, state.export_uri, wait=not stopping.is_set())

    def roll_back(self, stable: int | None) -> None:
        # a promotion interrupted while the stable track rolled to the canary's version (the pod
        # killed) left it naming that version: put it back before traffic goes to it
        deployment = self._track("stable")
        current, before = TrackState.of(deployment), TrackState.before_promotion(deployment)
        if stable is not None and current.version != stable:
            if before is None or before.version != stable:
                raise StepError(f"deployment {self.names['stable']} names version {current.version}, not stable "
                                f"version {stable}, and does not record how to put it back: "
                                f"run the llm_rollback DAG with target {stable}")
            log.warning("the stable track names version %s (an interrupted promotion): putting it back on %d",
                        current.version, stable)
            self._put_back("stable", before)
        self.route(stable)
        self._set_track("canary", None, 0, wait=not stopping.is_set())
        if self.fresh_baseline:  # (a cluster installed before the baseline track has none to empty)
            self._set_track(BASELINE, None, 0, wait=not stopping.is_set())

    def smoke_targets(self, version: int) -> list[tuple[str, dict[str, str]]]:
        path = triton.infer_path(self.serve.triton_model, version)
        direct = f"http://{self.names['canary']}.{self.namespace}.svc:{self.cluster.ports['http']}"
        # the internal route sends requests carrying this header to the canary track alone
        return [(direct + path, {}), (self.internal_url + path, {TRACK_HEADER: "canary"})]

    def baseline_target(self, stable: int) -> tuple[str, dict[str, str]]:
        # the internal route sends requests carrying this header to one track alone (the same
        # gateway hop as the canary's routed requests): the fresh baseline's, else stable's
        path = triton.infer_path(self.serve.triton_model, stable)
        return self.internal_url + path, {TRACK_HEADER: BASELINE if self.fresh_baseline else "stable"}

    def text_target(self, version: int) -> tuple[str, dict[str, str]]:
        # the canary track's own Service (its pod's OpenAI front); stable through the internal
        # route's track-header rule, as the logits baseline
        if version != self.live().stable:  # the new version: before the first step moves traffic the route names no canary
            return (f"http://{self.names['canary']}.{self.namespace}.svc:{self.cluster.ports['openai']}"
                    "/v1/completions", {})
        # marked for the record (the internal route passes it on): the baseline's engine timings
        return self.internal_url + "/v1/completions", {TRACK_HEADER: BASELINE if self.fresh_baseline else "stable",
                                                       RECORD_HEADER: "1", **self.model_headers}

    def shadow_target(self) -> tuple[str, dict[str, str]]:
        # the internal route's shadow rule (plugins/serving.py): stable's pods, mirrored to the canary track
        return self.internal_url + "/v1/completions", {TRACK_HEADER: SHADOW_TRACK, **self.model_headers}

    def shadow_records(self, request_ids: list[str], stable: int, shadow: int) -> list[dict[str, Any]]:
        # each track's pod runs its own front and serves one version: the shadow is on the canary
        # track (one pod). Stable's records are split between its pods, and a read through the
        # Service reaches one of them: deploy merges what successive reads return. A fresh
        # baseline (stable's version) keeps those of the steps' baseline streams
        port = self.cluster.ports["openai"]
        tracks = [("stable", stable), ("canary", shadow)] + ([(BASELINE, stable)] if self.fresh_baseline else [])
        return [{**record, "version": version}
                for track, version in tracks
                for record in read_shadow_records(f"http://{self.names[track]}.{self.namespace}.svc:{port}",
                                                  request_ids)]

    def metrics(self) -> dict[int, dict[str, float]]:
        merged: dict[int, dict[str, float]] = {}
        for name in (self.names[track] for track in TRACKS):  # (the baseline's counters would overwrite stable's)
            url = f"http://{name}.{self.namespace}.svc:{self.cluster.ports['metrics']}/metrics"
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=10) as resp:
                merged.update(triton.version_counters(resp.read().decode(), self.serve.triton_model))
        return merged


def serving_platform(settings: Settings) -> Serving:
    """``SERVING_PLATFORM``: ``local`` (default) or ``kubernetes`` (set on the cluster's pods)."""
    platform = os.environ.get("SERVING_PLATFORM", "local")
    if platform == "local":
        return LocalServing(settings.serve)
    if platform == "kubernetes":
        return KubernetesServing(settings.serve, settings.launcher.kubernetes.namespace,
                                 model=None if current_line() == DEMO else settings.pipeline.model_name)
    raise StepError(f"SERVING_PLATFORM={platform!r}: expected 'local' or 'kubernetes'")
