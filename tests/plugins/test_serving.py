"""The cluster's serving objects (plugins/serving.py): Triton Deployments and Services per track
validated against Kubernetes 1.32 (strict), the HTTPRoute against the Gateway API schema."""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import serving
import yaml
from helpers import REPO_ROOT, validate_objects

from pipeline_params import pipeline_params


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def test_serving_objects_are_valid_kubernetes_and_gateway_api(tmp_path: Path) -> None:
    """Both renders: ``--install`` (created once, with deploy's initial state) and the plain one
    (re-applied after any change: nothing deploy owns, so the public route is not in it)."""
    objects = serving.serving_manifests(install=True)
    # three tracks (stable, canary, baseline: the stable version beside the canary at its size)
    assert sorted(o["kind"] for o in objects) == ["Deployment"] * 3 + ["HTTPRoute", "HTTPRoute", "NetworkPolicy",
                                                  "PodDisruptionBudget", "Role", "RoleBinding"] + ["Service"] * 3
    proc = validate_objects(objects, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "valid gateway.networking.k8s.io/v1/HTTPRoute llm-serving" in proc.stdout
    assert "valid gateway.networking.k8s.io/v1/HTTPRoute llm-serving-internal" in proc.stdout
    plain = serving.serving_manifests()
    assert sorted(o["kind"] for o in objects if o not in plain) == ["Deployment"] * 3 + ["HTTPRoute"]
    proc = validate_objects(plain, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "valid gateway.networking.k8s.io/v1/HTTPRoute llm-serving\n" not in proc.stdout + "\n"


def test_each_track_stages_its_version_and_is_ready_only_when_triton_is() -> None:
    for deployment in by_kind(serving.serving_manifests(install=True), "Deployment"):
        spec = deployment["spec"]
        assert spec["replicas"] == 0  # created empty: deploy gives a track its version and replicas
        assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
        pod = spec["template"]["spec"]
        stage, server = pod["initContainers"][0], pod["containers"][0]
        assert stage["command"][:4] == ["python", "-m", "tasks.deploy", "stage"]
        annotations = spec["template"]["metadata"]["annotations"]
        read = {e["valueFrom"]["fieldRef"]["fieldPath"] for e in stage["env"] if "valueFrom" in e}
        assert read == {f"metadata.annotations['{key}']" for key in annotations}
        assert server["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
        assert "--model-control-mode=explicit" in server["args"] and "--exit-on-error=true" in server["args"]
        assert server["resources"]["limits"]["nvidia.com/gpu"] == "1"  # serve.kubernetes.kind: gpu
        assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
        assert {"name": "shm", "mountPath": "/dev/shm"} in server["volumeMounts"]
        # the front (the process clients reach) holds its own capture-only keys, not the steps'
        # storage keys (which can replace the exports Triton runs); Triton's container holds none
        front, cluster = pod["containers"][1], pipeline_params().launcher.kubernetes
        capture = pipeline_params().serve.kubernetes.capture_secret
        assert front["envFrom"] == [{"secretRef": {"name": capture}}] and "envFrom" not in server
        assert capture not in cluster.env_from_secrets
        assert stage["envFrom"] == [{"secretRef": {"name": name}} for name in cluster.env_from_secrets]
        # only stable's fronts capture: the canary track's get the gateway's unmarked shadow copies
        track = deployment["metadata"]["name"].rsplit("-", 1)[1]
        assert ("--capture-rate" not in front["command"]) == (track == "stable"), (track, front["command"])


def test_the_front_is_refused_the_steps_storage_secret() -> None:
    settings = pipeline_params()
    storage = settings.launcher.kubernetes.env_from_secrets[0]
    shared = dataclasses.replace(settings, serve=dataclasses.replace(settings.serve, kubernetes=dataclasses.replace(
        settings.serve.kubernetes, capture_secret=storage)))
    # (cluster.SharedCredential: a ValueError; Airflow's plugin loading may import cluster.py anew)
    with pytest.raises(ValueError, match=f"capture_secret '{storage}' is one of the steps' Secrets"):
        serving.serving_manifests(shared)


def test_training_never_preempts_serving_and_a_drain_keeps_stable_serving() -> None:
    import cluster

    objects = serving.serving_manifests()
    classes = {o["metadata"]["name"]: o for o in by_kind(cluster.base_objects(), "PriorityClass")}  # cluster-scoped
    settings = pipeline_params()
    serving_class = classes[settings.serve.kubernetes.priority_class]
    training_class = classes[settings.launcher.kubernetes.training.priority_class]
    assert serving_class["value"] > training_class["value"] and not serving_class["globalDefault"]
    for deployment in by_kind(objects, "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert pod["priorityClassName"] == serving_class["metadata"]["name"]
        # spread over nodes and zones, each track over its own pods
        assert [(c["topologyKey"], c["labelSelector"]["matchLabels"]) for c in pod["topologySpreadConstraints"]] == [
            ("kubernetes.io/hostname", labels), ("topology.kubernetes.io/zone", labels)]
        assert all("sizeLimit" in v["emptyDir"] for v in pod["volumes"])  # no emptyDir can fill its node
    # the budget holds the stable track's pods only (a canary's lone pod must not block a drain)
    budget = by_kind(objects, "PodDisruptionBudget")[0]
    stable = next(d for d in by_kind(objects, "Deployment") if d["metadata"]["name"].endswith("-stable"))
    canary = next(d for d in by_kind(objects, "Deployment") if d["metadata"]["name"].endswith("-canary"))
    selector = budget["spec"]["selector"]["matchLabels"]
    assert selector == stable["spec"]["template"]["metadata"]["labels"]
    assert selector.items() - canary["spec"]["template"]["metadata"]["labels"].items()
    assert budget["spec"]["maxUnavailable"] == 1 < settings.serve.kubernetes.replicas
    # a budget that would let a drain evict every stable pod is refused when rendering
    serve = settings.serve
    lone = dataclasses.replace(settings, serve=dataclasses.replace(
        serve, kubernetes=dataclasses.replace(serve.kubernetes, replicas=1)))
    with pytest.raises(ValueError, match="max_unavailable 1: expected at least 1 and fewer than replicas"):
        serving.disruption_budget(lone)


def matching_rule(route: dict[str, Any], path: str, headers: dict[str, str]) -> int | None:
    """The rule a Gateway API implementation picks for a request (Exact over PathPrefix, longer
    prefix first, more header matches first; the spec's precedence), or None: a 404."""
    candidates = []
    for index, rule in enumerate(route["spec"]["rules"]):
        for match in rule["matches"]:
            kind, value = match["path"]["type"], match["path"]["value"]
            if (kind == "Exact" and path != value) or (kind == "PathPrefix" and not (
                    path == value.rstrip("/") or path.startswith(value.rstrip("/") + "/"))):
                continue
            if any(headers.get(h["name"]) != h["value"] for h in match.get("headers", [])):
                continue
            candidates.append(((kind == "Exact", len(value), len(match.get("headers", []))), index))
    return max(candidates)[1] if candidates else None


def test_public_route_splits_an_allowlist_and_only_the_internal_one_reaches_a_track() -> None:
    """Clients reach inference, generate/stream, /v1, health and metadata, split by weight; not
    Triton's repository control, not a version's own path, and their X-Serving-Track picks nothing.
    Deploy's internal route reaches each track alone (the smoke test, the canary's baseline)."""
    public, internal = by_kind(serving.serving_manifests(install=True), "HTTPRoute")
    assert public["spec"]["parentRefs"][0]["sectionName"] == "public"
    assert internal["spec"]["parentRefs"][0]["sectionName"] == "internal"
    for rule, port in zip(public["spec"]["rules"], (8000, 8003), strict=True):
        assert [(b["name"], b["port"], b["weight"]) for b in rule["backendRefs"]] == \
            [("triton-stable", port, 1000), ("triton-canary", port, 0)]
    for track in ("", "canary", "stable"):
        headers = {serving.TRACK_HEADER: track} if track else {}
        for path in ("/v2/models/llm/infer", "/v2/health/ready", "/v2/models/llm", "/v2/models/llm_generate",
                     "/v2/models/llm/ready", "/v2/models/llm_generate/ready"):
            assert matching_rule(public, path, headers) == 0, path
        assert matching_rule(public, "/v1/chat/completions", headers) == 1
        # text goes through /v1 only: Triton's generate paths would let an abandoned request run on
        for path in ("/v2/repository/index", "/v2/repository/models/llm/unload", "/v2/repository/models/llm/load",
                     "/v2/models/llm/versions/3/infer", "/v2/models/llm/config", "/v2/logging", "/v1beta/x",
                     "/v2/models/llm_generate/generate", "/v2/models/llm_generate/generate_stream"):
            assert matching_rule(public, path, headers) is None, path
    rules = internal["spec"]["rules"]
    for path, port in (("/v2/models/llm/versions/3/infer", 8000), ("/v1/completions", 8003)):
        for track in ("canary", "stable"):
            rule = rules[matching_rule(internal, path, {serving.TRACK_HEADER: track})]  # type: ignore[index]
            assert [(b["name"], b["port"]) for b in rule["backendRefs"]] == [(f"triton-{track}", port)]
            assert "filters" not in rule
        assert matching_rule(internal, path, {}) is None
    assert matching_rule(internal, "/v2/repository/models/llm/unload", {serving.TRACK_HEADER: "stable"}) is None


def test_the_public_route_removes_internal_headers_and_deploys_shadow_requests_take_the_internal_one() -> None:
    """No client sets what only the gateway and deploy may (contract.INTERNAL_HEADERS: the version,
    the track, the shadow's record, pair and copy marks, the client address): every public rule
    removes them, and each backend still stamps the version it serves on its answers. Deploy's
    paired shadow requests (X-Shadow-Pair) take the internal listener's shadow rule: stable
    answers and records them, the canary track gets a copy marked for the record too."""
    from tasks.serving.contract import COPY_HEADER, INTERNAL_HEADERS, PAIR_HEADER, RECORD_HEADER, ROUTE_HEADER

    public, internal = by_kind(serving.serving_manifests(install=True), "HTTPRoute")
    assert {ROUTE_HEADER, PAIR_HEADER, RECORD_HEADER, COPY_HEADER, serving.TRACK_HEADER} <= set(INTERNAL_HEADERS)
    for rule in public["spec"]["rules"]:
        assert rule["filters"] == [{"type": "RequestHeaderModifier",
                                    "requestHeaderModifier": {"remove": list(INTERNAL_HEADERS)}}]
        assert [b["filters"] for b in rule["backendRefs"]] == [[{
            "type": "ResponseHeaderModifier",
            "responseHeaderModifier": {"set": [{"name": serving.VERSION_HEADER, "value": serving.NO_VERSION}]}}]] * 2
    shadow = {serving.TRACK_HEADER: serving.SHADOW_TRACK, PAIR_HEADER: "0" * 32}
    rule = internal["spec"]["rules"][matching_rule(internal, "/v1/completions", shadow)]  # type: ignore[index]
    assert [(b["name"], b["port"]) for b in rule["backendRefs"]] == [("triton-stable", 8003)]
    assert rule["filters"] == [
        {"type": "RequestHeaderModifier",
         "requestHeaderModifier": {"set": [{"name": RECORD_HEADER, "value": "1"}], "remove": [COPY_HEADER]}},
        {"type": "RequestMirror", "requestMirror": {"backendRef": {"name": "triton-canary", "port": 8003}}}]
    assert matching_rule(internal, "/v2/models/llm/infer", shadow) is None  # the shadow is judged on text only


def test_cpu_kind_has_no_gpu_request(tmp_path: Path) -> None:
    settings = pipeline_params()
    serve = dataclasses.replace(settings.serve, kubernetes=dataclasses.replace(
        settings.serve.kubernetes, kind="cpu", config_variant="onnxruntime_onnx.cpu"))
    params = dataclasses.replace(settings, serve=serve)
    deployment = serving.track_deployment(params, "stable")
    assert "nvidia.com/gpu" not in deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert "tolerations" not in deployment["spec"]["template"]["spec"]
    assert validate_objects([deployment], tmp_path).returncode == 0


def test_gateway_schema_check_is_real(tmp_path: Path) -> None:
    """A negative weight, an empty header value, a rule's filter of no known type and one removing
    more headers than the schema allows are all refused."""
    route = by_kind(serving.serving_manifests(install=True), "HTTPRoute")[0]
    negative, empty, unknown, too_many = (copy.deepcopy(route) for _ in range(4))
    negative["spec"]["rules"][-1]["backendRefs"][0]["weight"] = -1
    empty["spec"]["rules"][-1]["backendRefs"][0]["filters"][0]["responseHeaderModifier"]["set"][0]["value"] = ""
    unknown["spec"]["rules"][0]["filters"][0]["type"] = "RequestHeaderRemover"
    too_many["spec"]["rules"][0]["filters"][0]["requestHeaderModifier"]["remove"] = [f"X-H{i}" for i in range(17)]
    for bad in (negative, empty, unknown, too_many):
        proc = validate_objects([bad], tmp_path)
        assert proc.returncode != 0 and "INVALID" in proc.stdout, proc.stdout


def test_cli_prints_the_manifests() -> None:
    proc = subprocess.run([sys.executable, "plugins/serving.py"], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO_ROOT / "plugins")})
    assert proc.returncode == 0, proc.stderr
    assert [o["kind"] for o in yaml.safe_load_all(proc.stdout)][:2] == ["Deployment", "Service"]
    install = subprocess.run([sys.executable, "plugins/serving.py", "--install"], cwd=REPO_ROOT, capture_output=True,
                             text=True, env={"PYTHONPATH": str(REPO_ROOT / "plugins")})
    assert install.returncode == 0, install.stderr
    routes = [o["metadata"]["name"] for o in yaml.safe_load_all(install.stdout) if o["kind"] == "HTTPRoute"]
    assert routes == ["llm-serving", "llm-serving-internal"]


def test_only_the_gateway_deploy_and_prometheus_reach_triton_pods_and_only_ranks_reach_steps() -> None:
    """Triton's HTTP port also serves repository control: behind the gateway's allowlist, its pods
    admit the gateway's proxies (inference, OpenAI front), the deploy step's pods (any port) and
    Prometheus (metrics) and no one else. Step pods admit only training ranks (the rendezvous)."""
    import cluster

    objects = serving.serving_manifests()
    (policy,) = by_kind(objects, "NetworkPolicy")
    selected = policy["spec"]["podSelector"]["matchLabels"]
    container_ports: set[str] = set()
    for deployment in by_kind(objects, "Deployment"):  # both tracks' pods are selected
        template = deployment["spec"]["template"]
        assert selected.items() <= template["metadata"]["labels"].items()
        container_ports |= {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
    reach: dict[str, set[str]] = {}
    for rule in policy["spec"]["ingress"]:
        for peer in rule["from"]:
            who = (f"namespace {peer['namespaceSelector']['matchLabels']['kubernetes.io/metadata.name']}"
                   if "namespaceSelector" in peer else f"pods {peer['podSelector']['matchLabels']}")
            assert "podSelector" not in peer or "namespaceSelector" not in peer  # no "and" peer
            for port in rule["ports"]:
                reach.setdefault(port["port"], set()).add(who)
    assert set(reach) == container_ports == {"http", "grpc", "metrics", "openai"}
    deploy = f"pods {{'{cluster.DEPLOYER_LABEL}': 'true'}}"
    assert reach == {"http": {"namespace gateway-system", deploy}, "openai": {"namespace gateway-system", deploy},
                     "grpc": {deploy}, "metrics": {"namespace monitoring", deploy}}
    # (only the pods of tasks.deploy carry that label: tests/plugins/test_launcher.py)

    (steps,) = by_kind(cluster.base_objects(), "NetworkPolicy")
    assert steps["spec"]["podSelector"] == {"matchExpressions": [{"key": cluster.STEP_LABEL, "operator": "Exists"}]}
    assert steps["spec"]["ingress"] == [{"from": [{"podSelector": {"matchExpressions": [
        {"key": cluster.JOB_LABEL, "operator": "Exists"}]}}]}]


def test_each_model_line_has_its_own_tracks_and_routes_picked_by_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second line (``lines/support.yaml``) renders its own tracks, Services, budget, routes,
    network policy and deployer Role, none sharing a name with the demo line's, all valid. Its
    public ``/v1`` rule matches the model a request names (the gateway's body-based router's
    header) and so wins over the demo line's, which keeps the requests that name no model; its
    Triton rules are its own models' paths. Its pods read the line's settings."""
    from tasks.config import load
    from tasks.serving.contract import MODEL_HEADER

    (tmp_path / "lines").mkdir()
    (tmp_path / "lines" / "support.yaml").write_text("pipeline: {model_name: support-bot}\n")
    monkeypatch.setenv("PIPELINE_LINES_DIR", str(tmp_path / "lines"))
    objects = serving.serving_manifests(install=True)
    support = [o for o in objects if "support" in o["metadata"]["name"]]
    assert sorted((o["kind"], o["metadata"]["name"]) for o in support) == sorted([
        *(("Deployment", f"triton-support-{t}") for t in ("stable", "canary", "baseline")),
        *(("Service", f"triton-support-{t}") for t in ("stable", "canary", "baseline")),
        ("PodDisruptionBudget", "triton-support-stable"), ("HTTPRoute", "llm-serving-support"),
        ("HTTPRoute", "llm-serving-support-internal"), ("NetworkPolicy", "triton-support"),
        ("Role", "llm-pipeline-deployer-support"), ("RoleBinding", "llm-pipeline-deployer-support")])
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names)) == 2 * len(support)
    proc = validate_objects(objects, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the deployer of the line patches its own objects and holds its own lock
    role = next(o for o in support if o["kind"] == "Role")
    assert ["llm-serving-support"] in [r.get("resourceNames") for r in role["rules"]]
    assert ["llm-serving-support-deploy"] in [r.get("resourceNames") for r in role["rules"]]
    # the line's pods: its settings (its Triton models staged and loaded), its model served alone, no capture
    stable = next(o for o in support if o["metadata"]["name"] == "triton-support-stable")
    pod = stable["spec"]["template"]["spec"]
    (stage,), (server, front) = pod["initContainers"], pod["containers"]
    assert {"name": "PIPELINE_LINE", "value": "support"} in stage["env"] and front["env"] == stage["env"][-1:]
    assert "--load-model=llm__support" in server["args"] and "--load-model=llm_generate__support" in server["args"]
    assert front["command"][-4:] == ["--line", "support", "--capture-rate", "0"]
    # one gateway, two lines' public routes: a request goes to the most specific rule of either
    public = {o["metadata"]["name"]: o for o in objects if o["kind"] == "HTTPRoute" and not o["metadata"][
        "name"].endswith("-internal")}
    both = {"spec": {"rules": [*public["llm-serving"]["spec"]["rules"], *public["llm-serving-support"]["spec"]["rules"]]}}
    support_rules = len(public["llm-serving"]["spec"]["rules"])
    assert matching_rule(both, "/v1/completions", {MODEL_HEADER: "support-bot"}) == support_rules + 1
    assert matching_rule(both, "/v1/completions", {}) == 1  # no model named: the demo line's
    assert matching_rule(both, "/v1/completions", {MODEL_HEADER: load(line="").pipeline.model_name}) == 1
    assert matching_rule(both, "/v2/models/llm__support/infer", {}) == support_rules
    assert matching_rule(both, "/v2/models/llm/infer", {}) == 0 and matching_rule(both, "/v2/health/ready", {}) == 0
    # deploy's internal requests of the line name its model: its own tracks answer them
    internal = next(o for o in support if o["metadata"]["name"] == "llm-serving-support-internal")
    for track in ("canary", "stable"):
        rule = internal["spec"]["rules"][matching_rule(internal, "/v1/completions", {  # type: ignore[index]
            serving.TRACK_HEADER: track, MODEL_HEADER: "support-bot"})]
        assert [b["name"] for b in rule["backendRefs"]] == [f"triton-support-{track}"]
        assert matching_rule(internal, "/v1/completions", {serving.TRACK_HEADER: track}) is None
        rule = internal["spec"]["rules"][matching_rule(internal, "/v2/models/llm__support/versions/2/infer", {  # type: ignore[index]
            serving.TRACK_HEADER: track})]
        assert [b["name"] for b in rule["backendRefs"]] == [f"triton-support-{track}"]
        assert matching_rule(internal, "/v2/models/llm/versions/2/infer", {serving.TRACK_HEADER: track}) is None
