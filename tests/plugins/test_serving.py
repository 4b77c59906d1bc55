"""The cluster's serving objects (plugins/serving.py): Triton Deployments and Services per track
validated against Kubernetes 1.32 (strict), the HTTPRoute against the Gateway API schema."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import serving
import yaml
from helpers import REPO_ROOT, validate_objects


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def test_serving_objects_are_valid_kubernetes_and_gateway_api(tmp_path: Path) -> None:
    objects = serving.serving_manifests()
    assert sorted(o["kind"] for o in objects) == ["Deployment", "Deployment", "HTTPRoute", "Role", "RoleBinding",
                                                  "Service", "Service"]
    proc = validate_objects(objects, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "valid gateway.networking.k8s.io/v1/HTTPRoute llm-serving" in proc.stdout


def test_each_track_stages_its_version_and_is_ready_only_when_triton_is() -> None:
    for deployment in by_kind(serving.serving_manifests(), "Deployment"):
        spec = deployment["spec"]
        assert spec["replicas"] == 0  # deploy gives a track its version and replicas
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


def test_route_splits_by_weight_and_a_header_reaches_one_track_alone() -> None:
    """The smoke test reaches the canary alone, the canary analysis's baseline the stable alone."""
    route = by_kind(serving.serving_manifests(), "HTTPRoute")[0]
    rules = route["spec"]["rules"]
    # Triton's /v2 on the http port, then the OpenAI front's /v1 on the openai port, three rules each
    for prefix, port, (*header_rules, weighted) in (("/v2", 8000, rules[:3]), ("/v1", 8003, rules[3:])):
        for rule, track in zip(header_rules, ("canary", "stable"), strict=True):
            assert rule["matches"][0]["path"]["value"] == prefix
            assert rule["matches"][0]["headers"][0] == {"type": "Exact", "name": serving.TRACK_HEADER, "value": track}
            assert [(b["name"], b["port"]) for b in rule["backendRefs"]] == [(f"triton-{track}", port)]
        assert [(b["name"], b["port"], b["weight"]) for b in weighted["backendRefs"]] == \
            [("triton-stable", port, 1000), ("triton-canary", port, 0)]


def test_cpu_kind_has_no_gpu_request(tmp_path: Path) -> None:
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["serve"]["kubernetes"].update(kind="cpu", config_variant="onnxruntime_onnx.cpu")
    deployment = serving.track_deployment(params, "stable")
    assert "nvidia.com/gpu" not in deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert "tolerations" not in deployment["spec"]["template"]["spec"]
    assert validate_objects([deployment], tmp_path).returncode == 0


def test_gateway_schema_check_is_real(tmp_path: Path) -> None:
    """A negative weight and an empty header value are both refused."""
    route = by_kind(serving.serving_manifests(), "HTTPRoute")[0]
    negative, empty = copy.deepcopy(route), copy.deepcopy(route)
    negative["spec"]["rules"][-1]["backendRefs"][0]["weight"] = -1
    empty["spec"]["rules"][-1]["backendRefs"][0]["filters"][0]["responseHeaderModifier"]["set"][0]["value"] = ""
    for bad in (negative, empty):
        proc = validate_objects([bad], tmp_path)
        assert proc.returncode != 0 and "INVALID" in proc.stdout, proc.stdout


def test_cli_prints_the_manifests() -> None:
    proc = subprocess.run([sys.executable, "plugins/serving.py"], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO_ROOT / "plugins")})
    assert proc.returncode == 0, proc.stderr
    assert [o["kind"] for o in yaml.safe_load_all(proc.stdout)][:2] == ["Deployment", "Service"]
