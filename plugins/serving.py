"""Serving in a cluster: the objects the deploy step drives (``tasks/serving/platforms.py``).

    python plugins/serving.py --install | kubectl create -f -    # once: the objects and deploy's initial state
    python plugins/serving.py | kubectl apply -f -                # after any change (image, resources): safe
    python plugins/serving.py --install --line support | kubectl create -f -   # once, for a line added later

What the deploy step owns is live state: the tracks' replicas and versions (pod template
annotations), the public HTTPRoute (its weights, version headers and rollout state) and the deploy
lock (a Lease deploy creates). ``--install`` renders them once in their initial state (both
tracks at 0 replicas naming no version, the route sending everything to stable, which serves
nothing yet), for ``kubectl create`` (not ``--save-config``, and never ``apply``: a later apply
would then remove or reset them). The plain render leaves them out, so re-applying it after any
change never scales stable to 0 nor forgets which version serves. The public route's hostnames
and gateway are changed with ``kubectl patch``, never by re-applying it.


- A Triton Deployment per track (``stable``, ``canary``, ``baseline``: the stable version at the
  canary's size, started with it, the canary's analysis baseline) on NVIDIA's tritonserver image. Its init
  container (the runtime image: ``python -m tasks.deploy stage``) copies one exported version
  into the pod's model repository; which one it reads from the pod template's annotations
  through the downward API, so deploy moves a track to a version with one merge patch, and the
  Deployment rolls surge-first (``maxUnavailable: 0``): a track never has fewer ready pods.
  Ready = ``/v2/health/ready`` (the models loaded; a model that fails to load stops the pod).
  Beside Triton, the pod runs the OpenAI-compatible API (``tasks/serving/front.py``, the runtime
  image) on its ``openai`` port, translating ``/v1/*`` to the local Triton's generate endpoints,
  with a Secret of its own (``serve.kubernetes.capture_secret``: keys that may only write the
  served-traffic capture; the stage init container holds the steps' Secrets, Triton none).
  Both tracks start at 0 replicas (``--install``): the first deploy gives them a version.
  Its pods run in the ``llm-serving`` PriorityClass (``plugins/cluster.py``: cluster-scoped, with
  the cluster's own objects), above training's (a training Job admitted on full GPU nodes never
  preempts serving; a serving pod may preempt a training pod), spread across nodes and zones.
- A Service per track (HTTP, gRPC, metrics, openai); a PodDisruptionBudget for stable (a drain
  evicts one stable pod at a time).
- A Gateway API ``HTTPRoute`` on the gateway's public listener: an allowlist (Triton's inference,
  generate and stream paths, health and metadata, exact; the OpenAI front's ``/v1/`` on the
  openai port), each split between the tracks by ``weight`` (per mille); each backend stamps
  ``X-Model-Version`` on its responses; each rule removes the internal headers a client sent
  (``INTERNAL_HEADERS``: version, track, shadow marks, client address). Deploy patches both rules
  together. Its annotations hold the rollout state. Triton's repository control and a version's
  own paths match nothing: 404 at the gateway.
- A second ``HTTPRoute`` (``<route>-internal``) on the gateway's internal listener (in-cluster
  only): ``X-Serving-Track: canary|stable`` reaches one track alone (the smoke test before any
  traffic moves; the canary analysis's baseline); ``X-Serving-Track: shadow`` carries deploy's
  paired shadow requests to stable, mirrored to the canary track. A client outside cannot pick
  a track.
- A Role + RoleBinding letting the deploy step's service account get and patch exactly these,
  and take the deploy lock (a ``coordination.k8s.io`` Lease).

Plain dicts, no Airflow import: tests render them and validate the core objects against the
Kubernetes schema and the HTTPRoute against the Gateway API's.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import yaml
from cluster import DEPLOYER_LABEL, capture_secret_name, pinned_image

from pipeline_params import Settings, pipeline_lines, pipeline_params
from tasks.config import DEMO, LINE_ENV, ServeKubernetes, ServeSettings, line_label
from tasks.serving.contract import (
    ANNOTATION,
    BASELINE,
    COPY_HEADER,
    INTERNAL_HEADERS,
    MODEL_HEADER,
    NO_VERSION,
    PUBLIC_LOGITS_ACTIONS,
    RECORD_HEADER,
    SHADOW_TRACK,
    TRACK_HEADER,
    VERSION_HEADER,
    WEIGHT_SCALE,
)
from tasks.serving.contract import TRACKS as ROUTE_TRACKS

TRACKS = (*ROUTE_TRACKS, BASELINE)  # baseline: the stable version beside the canary, at its size
# a track's pod template annotations deploy sets (its init container reads them)
DEPLOY_ANNOTATIONS = (f"{ANNOTATION}model-version", f"{ANNOTATION}export-uri")


def _labels(settings: ServeKubernetes, track: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": settings.name, "app.kubernetes.io/part-of": "llm-pipeline",
            "llm-pipeline/track": track}


def _http_get(path: str, period_s: int, failures: int, port: str = "http") -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period_s, "failureThreshold": failures}


def _hardened() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


def line_env(line: str) -> list[dict[str, str]]:
    """What makes a pod's processes read a model line's settings (none: the demo line's)."""
    return [] if line == DEMO else [{"name": LINE_ENV, "value": line}]


def track_deployment(params: Settings, track: str, install: bool = False, line: str = DEMO) -> dict[str, Any]:
    """A track's Deployment of model ``line`` (``params``: its settings); ``install``: with
    deploy's initial state (0 replicas, no version)."""
    cluster, serve = params.launcher.kubernetes, params.serve
    settings = serve.kubernetes
    kind = cluster.kinds[settings.kind]
    labels = _labels(settings, track)
    ports = settings.ports
    step_image = pinned_image("launcher.kubernetes.images.cpu", cluster.images["cpu"])  # stage, openai

    def from_annotation(name: str) -> dict[str, Any]:
        return {"name": name.upper().replace("-", "_"),
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{ANNOTATION}{name}']"}}}

    stage = {
        "name": "stage",
        "image": step_image,
        "imagePullPolicy": cluster.image_pull_policy,
        "command": ["python", "-m", "tasks.deploy", "stage", "--model-version", "$(MODEL_VERSION)",
                    "--export", "$(EXPORT_URI)", "--repository", "/models",
                    "--config-variant", settings.config_variant],
        "env": [from_annotation("model-version"), from_annotation("export-uri"),
                {"name": "PYTHONUNBUFFERED", "value": "1"}, *line_env(line)],
        "envFrom": [{"secretRef": {"name": name}} for name in cluster.env_from_secrets],
        "resources": cluster.kinds["cpu"].resources,
        "securityContext": _hardened(),
        "volumeMounts": [{"name": "models", "mountPath": "/models"}, {"name": "scratch", "mountPath": "/tmp"}],
    }
    load_failures = max(3, int(serve.load_timeout_s) // 5)
    server = {
        "name": "triton",
        "image": pinned_image("serve.kubernetes.image", settings.image),
        "imagePullPolicy": cluster.image_pull_policy,
        "command": ["tritonserver"],
        "args": ["--model-repository=/models", "--model-control-mode=explicit",
                 *(f"--load-model={m}" for m in (serve.triton_model, serve.generate_model)),
                 "--exit-on-error=true", "--strict-readiness=true", f"--http-port={ports['http']}",
                 f"--grpc-port={ports['grpc']}", f"--metrics-port={ports['metrics']}"],
        "ports": [{"name": name, "containerPort": port} for name, port in ports.items() if name != "openai"],
        "startupProbe": _http_get("/v2/health/ready", 5, load_failures),
        "readinessProbe": _http_get("/v2/health/ready", 5, 3),
        "livenessProbe": _http_get("/v2/health/live", 10, 3),
        "resources": kind.resources,
        "securityContext": _hardened(),
        "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True},
                         {"name": "shm", "mountPath": "/dev/shm"}, {"name": "scratch", "mountPath": "/tmp"}],
    }
    # the OpenAI-compatible API beside the pod's Triton (tasks/serving/front.py): the route's /v1 rules
    openai = {
        "name": "openai",
        "image": step_image,
        "imagePullPolicy": cluster.image_pull_policy,
        # only the demo line's stable track's fronts capture served traffic (its drift check
        # reads it): the canary track's receive the gateway's mirrored copies, which a
        # RequestMirror cannot mark as copies (its filters act on the request and its copy alike),
        # and the baseline's deploy's own load; what the canary's share of users asks during a
        # rollout goes uncaptured, a sample the capture is anyway. Each pod serves its line's model
        "command": ["python", "-m", "tasks.serving.front", "--host", "0.0.0.0", "--port", str(ports["openai"]),
                    "--triton-url", f"http://127.0.0.1:{ports['http']}", "--line", line_label(line),
                    *(["--capture-rate", "0"] if track != "stable" or line != DEMO else [])],
        "env": line_env(line),
        "ports": [{"name": "openai", "containerPort": ports["openai"]}],
        # the served-traffic capture's S3 keys (serve.capture), which may write that alone: the
        # front's own Secret (the stage init container holds the steps'; Triton's container none)
        "envFrom": [{"secretRef": {"name": capture_secret_name(params)}}],
        "readinessProbe": _http_get("/health", 5, 3, "openai"),
        "livenessProbe": _http_get("/health", 10, 3, "openai"),
        "resources": cluster.kinds["cpu"].resources,
        "securityContext": _hardened(),
        "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"}],
    }
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # the servers never call the Kubernetes API
        "securityContext": {"runAsNonRoot": True, "runAsUser": cluster.run_as_user,
                            "runAsGroup": cluster.run_as_user, "fsGroup": cluster.run_as_user,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "initContainers": [stage],
        "containers": [server, openai],
        "volumes": [{"name": "models", "emptyDir": {"sizeLimit": settings.model_repository_size}},
                    {"name": "scratch", "emptyDir": {"sizeLimit": cluster.scratch_size}},
                    {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": settings.shm_size}}],
        # above training's class: the scheduler never preempts a Triton pod for a training Job
        "priorityClassName": settings.priority_class,
        "topologySpreadConstraints": spread(labels),
    }
    if kind.node_selector:
        pod_spec["nodeSelector"] = kind.node_selector
    if kind.tolerations:
        pod_spec["tolerations"] = list(kind.tolerations)  # a list: YAML's safe dumper has no tuples
    deployment: dict[str, Any] = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": f"{settings.name}-{track}", "namespace": cluster.namespace, "labels": labels},
        "spec": {
            "selector": {"matchLabels": labels},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }
    if install:  # deploy's from then on (see the module docstring)
        deployment["spec"]["replicas"] = 0
        deployment["spec"]["template"]["metadata"]["annotations"] = {key: "" for key in DEPLOY_ANNOTATIONS}
    return deployment


def spread(labels: dict[str, str]) -> list[dict[str, Any]]:
    """A track's pods across nodes, then zones: one node or zone lost takes at most its share.
    ``ScheduleAnyway``: on a cluster with one free GPU node a pod still starts (a rollout's surge
    pod included); ``pod-template-hash``: a rolling update spreads the new pods among themselves."""
    return [{"maxSkew": 1, "topologyKey": key, "whenUnsatisfiable": "ScheduleAnyway",
             "labelSelector": {"matchLabels": labels}, "matchLabelKeys": ["pod-template-hash"]}
            for key in ("kubernetes.io/hostname", "topology.kubernetes.io/zone")]


def disruption_budget(params: Settings) -> dict[str, Any]:
    """The stable track's PodDisruptionBudget: a drain or an autoscaler's scale-down evicts one
    stable pod at a time, so some stay serving (hence fewer than ``replicas``; the canary track,
    0 or 1 pod for minutes, has none). A pod that is not ready may go: it serves nothing."""
    settings = params.serve.kubernetes
    if not 0 < settings.max_unavailable < settings.replicas:
        raise ValueError(f"serve.kubernetes.max_unavailable {settings.max_unavailable!r}: expected at least 1 "
                         f"and fewer than replicas ({settings.replicas}), so a drain leaves stable pods serving")
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": f"{settings.name}-stable", "namespace": params.launcher.kubernetes.namespace,
                         "labels": _labels(settings, "stable")},
            "spec": {"maxUnavailable": settings.max_unavailable,
                     "selector": {"matchLabels": _labels(settings, "stable")},
                     "unhealthyPodEvictionPolicy": "AlwaysAllow"}}


def track_service(params: Settings, track: str) -> dict[str, Any]:
    settings = params.serve.kubernetes
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": f"{settings.name}-{track}", "namespace": params.launcher.kubernetes.namespace,
                     "labels": _labels(settings, track)},
        "spec": {"selector": _labels(settings, track),
                 "ports": [{"name": name, "port": port, "targetPort": name} for name, port in settings.ports.items()]},
    }


def public_triton_paths(serve: ServeSettings, line: str = DEMO) -> list[str]:
    """What clients may call of Triton's: the logits model's inference (text goes through the
    OpenAI front's /v1: contract's ``PUBLIC_LOGITS_ACTIONS``), each served model's metadata and
    readiness (tritonclient's ``is_model_ready``), the server's health and metadata (the demo
    line's route: paths that name no model are one route's)."""
    models = (serve.triton_model, serve.generate_model)
    server = ["/v2", "/v2/health/live", "/v2/health/ready"] if line == DEMO else []
    return [*(f"/v2/models/{serve.triton_model}/{a}" for a in PUBLIC_LOGITS_ACTIONS),
            *(f"/v2/models/{m}" for m in models), *(f"/v2/models/{m}/ready" for m in models), *server]


def model_match(params: Settings, line: str) -> list[dict[str, str]]:
    """The header match of a model line's ``/v1`` rules: the model the request names (the
    gateway's body-based router sets it). The demo line's match none: they take the requests
    that name no model (a rule with a header match wins over one without)."""
    return [] if line == DEMO else [{"type": "Exact", "name": MODEL_HEADER, "value": params.pipeline.model_name}]


def without_internal_headers() -> dict[str, Any]:
    """A rule's filter removing the headers only the gateway and deploy may set (contract's
    ``INTERNAL_HEADERS``) from a client's request: none picks a version or a track, fills
    deploy's shadow records or speaks for another client."""
    return {"type": "RequestHeaderModifier", "requestHeaderModifier": {"remove": list(INTERNAL_HEADERS)}}


def http_route(params: Settings, line: str = DEMO) -> dict[str, Any]:
    """A model line's public route: an allowlist, split between its tracks by weight (rules 0:
    Triton's inference, health and metadata paths of its models, exact; 1: the OpenAI front's
    ``/v1`` for its model, :func:`model_match`), each removing the internal headers a client
    sent (deploy's patches of rule 1's filters keep that removal, adding the shadow's mirror).
    Nothing else of Triton's (repository control, a version's own paths) matches: the gateway
    answers 404. Deploy's once created (``--install`` only): its weights and state are the live split."""
    settings = params.serve.kubernetes
    names = {track: f"{settings.name}-{track}" for track in TRACKS}

    def backend(track: str, weight: int, port: int) -> dict[str, Any]:
        stamp = {"set": [{"name": VERSION_HEADER, "value": NO_VERSION}]}
        return {"name": names[track], "port": port, "weight": weight,
                "filters": [{"type": "ResponseHeaderModifier", "responseHeaderModifier": stamp}]}

    def weighted(matches: list[dict[str, Any]], port: int) -> dict[str, Any]:
        return {"matches": matches, "filters": [without_internal_headers()],
                "backendRefs": [backend("stable", WEIGHT_SCALE, port), backend("canary", 0, port)]}

    triton_paths = [{"path": {"type": "Exact", "value": path}} for path in public_triton_paths(params.serve, line)]
    v1 = {"path": {"type": "PathPrefix", "value": "/v1/"}, **({"headers": model_match(params, line)} if line else {})}
    state = {"stable": None, "canary": None, "canary_weight": 0.0, "generation": 0}
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": settings.route, "namespace": params.launcher.kubernetes.namespace,
                     "labels": {"app.kubernetes.io/part-of": "llm-pipeline"},
                     "annotations": {f"{ANNOTATION}route": json.dumps(state)}},
        "spec": {
            "parentRefs": [_gateway_ref(settings, settings.gateway.listener)],
            "hostnames": [settings.hostname],
            "rules": [weighted(triton_paths, settings.ports["http"]),
                      weighted([v1], settings.ports["openai"])],
        },
    }


def internal_route(params: Settings, line: str = DEMO) -> dict[str, Any]:
    """Deploy's route of a model line, on the gateway's internal listener (not reachable from outside the
    cluster): ``X-Serving-Track: canary|stable|baseline`` reaches one track alone, Triton's paths of the line's models (a
    version's own included; not its repository control) and the OpenAI front's (for a line's
    model, :func:`model_match`: deploy sets the header), for the smoke test before any traffic moves
    and the canary analysis's baseline; through the same gateway hop as the split's requests.
    ``X-Serving-Track: shadow`` carries deploy's paired shadow requests (``X-Shadow-Pair``, which
    the public route removes): stable's pods answer and record them, the canary track's (the
    shadow's) gets a copy, recorded under the same pair id."""
    settings = params.serve.kubernetes
    openai_port = settings.ports["openai"]

    def rule(prefix: str, track: str, port: int) -> dict[str, Any]:
        headers = [{"type": "Exact", "name": TRACK_HEADER, "value": track},
                   *(model_match(params, line) if prefix == "/v1/" else [])]
        return {"matches": [{"path": {"type": "PathPrefix", "value": prefix}, "headers": headers}],
                "backendRefs": [{"name": f"{settings.name}-{track}", "port": port}]}

    models = [f"/v2/models/{model}" for model in (params.serve.triton_model, params.serve.generate_model)]

    # the shadow's copies go to the canary track alone, and only while deploy sends them (the
    # shadow stage): marked for the record before the mirror, so both answers are kept
    shadow = rule("/v1/", "stable", openai_port)
    shadow["matches"][0]["headers"][0]["value"] = SHADOW_TRACK
    shadow["filters"] = [
        {"type": "RequestHeaderModifier",
         "requestHeaderModifier": {"set": [{"name": RECORD_HEADER, "value": "1"}], "remove": [COPY_HEADER]}},
        {"type": "RequestMirror",
         "requestMirror": {"backendRef": {"name": f"{settings.name}-canary", "port": openai_port}}}]
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": f"{settings.route}-internal", "namespace": params.launcher.kubernetes.namespace,
                     "labels": {"app.kubernetes.io/part-of": "llm-pipeline"}},
        "spec": {
            "parentRefs": [_gateway_ref(settings, settings.gateway.internal_listener)],
            "rules": [*(rule(prefix, track, settings.ports[port])
                        for prefix, port in (*((model, "http") for model in models), ("/v1/", "openai"))
                        for track in ("canary", "stable", "baseline")), shadow],
        },
    }


def _gateway_ref(settings: ServeKubernetes, listener: str) -> dict[str, Any]:
    gateway = settings.gateway
    return {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gateway.name,
            "namespace": gateway.namespace, "sectionName": listener}


def deployer_rbac(params: Settings, line: str = DEMO) -> list[dict[str, Any]]:
    """What the deploy step's service account may do for a model line: get and patch its
    objects and hold its deploy lock, nothing else."""
    cluster, settings = params.launcher.kubernetes, params.serve.kubernetes
    name, namespace = "llm-pipeline-deployer" + ("" if line == DEMO else f"-{line}"), cluster.namespace
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": name, "namespace": namespace},
         "rules": [
             {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", "patch"],
              "resourceNames": [f"{settings.name}-{track}" for track in TRACKS]},
             {"apiGroups": ["gateway.networking.k8s.io"], "resources": ["httproutes"], "verbs": ["get", "patch"],
              "resourceNames": [settings.route]},
             # the deploy lock: deploy creates its Lease when absent (create cannot be limited by name)
             {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "update"],
              "resourceNames": [f"{settings.route}-deploy"]},
             {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
         ]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": name, "namespace": namespace},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": cluster.deploy_service_account, "namespace": namespace}]},
    ]


def network_policy(params: Settings) -> dict[str, Any]:
    """Who may connect to a Triton pod, by port. Its HTTP port also serves Triton's repository
    control (load, unload): the gateway's allowlist guards it from clients, this from the pods
    of the cluster. The gateway's proxies reach inference and the OpenAI front, the deploy step's
    pods every port (smoke test, baseline, metrics), Prometheus the metrics port; nothing else."""
    settings = params.serve.kubernetes
    network = settings.network

    def namespace(name: str) -> dict[str, Any]:
        return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": name}}}

    def ports(*names: str) -> list[dict[str, Any]]:
        return [{"protocol": "TCP", "port": name} for name in names]

    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": settings.name, "namespace": params.launcher.kubernetes.namespace,
                     "labels": {"app.kubernetes.io/part-of": "llm-pipeline"}},
        "spec": {
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": settings.name,
                                            "app.kubernetes.io/part-of": "llm-pipeline"}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [namespace(network.gateway_proxy_namespace)], "ports": ports("http", "openai")},
                {"from": [{"podSelector": {"matchLabels": {DEPLOYER_LABEL: "true"}}}],
                 "ports": ports(*settings.ports)},
                {"from": [namespace(network.metrics_namespace)], "ports": ports("metrics")},
            ],
        },
    }


def line_manifests(params: Settings, line: str = DEMO, install: bool = False) -> list[dict[str, Any]]:
    """One model line's serving objects; ``install``: with what deploy owns afterwards, in its
    initial state (see the module docstring)."""
    tracks = [obj for track in TRACKS
              for obj in (track_deployment(params, track, install, line), track_service(params, track))]
    public = [http_route(params, line)] if install else []
    return [*tracks, disruption_budget(params), *public, internal_route(params, line), network_policy(params),
            *deployer_rbac(params, line)]


def serving_manifests(params: Settings | None = None, install: bool = False,
                      only: str | None = None) -> list[dict[str, Any]]:
    """Every model line's serving objects, the demo line's first (its names are today's), or
    the line ``only`` names (``demo``: params.yaml's); ``params``: the demo line's objects of
    those settings alone."""
    if params is not None:
        return line_manifests(params, DEMO, install)
    lines = [line for line in pipeline_lines() if only is None or line_label(line) == only]
    if not lines:
        print(f"error: --line {only!r}: no such model line (lines: {', '.join(map(line_label, pipeline_lines()))})",
              file=sys.stderr)
        raise SystemExit(2)
    return [obj for line in lines for obj in line_manifests(pipeline_params(line), line, install)]


if __name__ == "__main__":
    arguments = sys.argv[1:]
    chosen = arguments[arguments.index("--line") + 1] if "--line" in arguments[:-1] else None
    yaml.safe_dump_all(serving_manifests(install="--install" in arguments, only=chosen), sys.stdout, sort_keys=False)
