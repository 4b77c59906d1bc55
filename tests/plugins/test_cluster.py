"""The cluster's own objects (plugins/cluster.py): validated against the oldest and newest
Kubernetes minor we support; the workers' Role holds exactly the API calls our operators make;
Secrets come from the environment only; the Helm values agree with the other objects."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import airflow.providers.cncf.kubernetes as provider
import cluster
import pytest
import yaml
from helpers import REPO_ROOT, validate_objects

from pipeline_params import pipeline_params

PROVIDER = Path(provider.__file__ or "").parent
# the code that runs in an Airflow worker when a step is launched in a cluster
LAUNCHING_CODE = [PROVIDER / "operators" / "pod.py", PROVIDER / "operators" / "job.py",
                  PROVIDER / "utils" / "pod_manager.py", PROVIDER / "hooks" / "kubernetes.py",
                  REPO_ROOT / "plugins" / "k8s_job.py"]
# hook methods for other operators (deployments, custom objects): none of ours calls them
NOT_OURS = {"read_namespaced_deployment_status", "create_namespaced_custom_object",
            "delete_namespaced_custom_object"}
# a Kubernetes client method -> the (API group, resource, verb) RBAC checks for it
REQUESTS = {
    "create_namespaced_pod": ("", "pods", "create"), "read_namespaced_pod": ("", "pods", "get"),
    "list_namespaced_pod": ("", "pods", "list"), "patch_namespaced_pod": ("", "pods", "patch"),
    "delete_namespaced_pod": ("", "pods", "delete"), "read_namespaced_pod_log": ("", "pods/log", "get"),
    "list_namespaced_event": ("", "events", "list"),
    "create_namespaced_job": ("batch", "jobs", "create"), "read_namespaced_job": ("batch", "jobs", "get"),
    "list_namespaced_job": ("batch", "jobs", "list"), "patch_namespaced_job": ("batch", "jobs", "patch"),
    "delete_namespaced_job": ("batch", "jobs", "delete"),
    "read_namespaced_job_status": ("batch", "jobs/status", "get"),
    "create_namespaced_service": ("", "services", "create"), "delete_namespaced_service": ("", "services", "delete"),
}
ENV = {"AWS_ACCESS_KEY_ID": "key-id", "AWS_SECRET_ACCESS_KEY": "secret", "AWS_ENDPOINT_URL": "http://s3:8333",
       "CAPTURE_AWS_ACCESS_KEY_ID": "capture-key-id", "CAPTURE_AWS_SECRET_ACCESS_KEY": "capture-secret",
       "CAPTURE_CLIENT_KEY": "client-hash-key",
       "MLFLOW_TRACKING_URI": "http://mlflow:5000", "ROUTER_URL": "http://gateway",
       "ROUTER_INTERNAL_URL": "http://gateway-internal"}


def granted(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(group, resource, verb) for rule in rules for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


@pytest.mark.parametrize("version", cluster.SUPPORTED_KUBERNETES)
def test_base_objects_and_secrets_are_valid_kubernetes(version: str, tmp_path: Path) -> None:
    objects = [*cluster.base_objects(), *cluster.secrets(ENV)]
    core = [o for o in objects if o["apiVersion"] != cluster.KUEUE_API]
    proc = validate_objects(core, tmp_path, kubernetes_version=version)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(o["kind"] for o in objects) == ["LocalQueue", "Namespace", "Namespace", "NetworkPolicy", "PriorityClass",
                                                  "PriorityClass", "Role", "RoleBinding", "Secret", "Secret", "Secret", "Secret",
                                                  "ServiceAccount", "ServiceAccount", "ServiceAccount"]


def test_only_the_deploy_account_holds_a_token_and_the_serving_role() -> None:
    """A step pod that is not deploy's has no API token to use; the deploy account's Role (get
    and patch the Triton Deployments and the route) is bound to it alone."""
    import serving

    params = pipeline_params().launcher.kubernetes
    tokens = {o["metadata"]["name"]: o["automountServiceAccountToken"] for o in cluster.base_objects()
              if o["kind"] == "ServiceAccount"}
    assert tokens == {params.service_account: False, params.deploy_service_account: True,
                      params.airflow_service_account: True}
    (binding,) = [o for o in serving.serving_manifests() if o["kind"] == "RoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": params.deploy_service_account,
                                    "namespace": params.namespace}]


def test_the_workers_role_holds_exactly_the_calls_our_operators_make() -> None:
    called = set()
    for path in LAUNCHING_CODE:
        called |= set(re.findall(r"\.((?:create|read|list|patch|delete|replace)_namespaced_\w+)\(", path.read_text()))
        called |= set(re.findall(r"\.(connect_\w+_namespaced_pod_exec)\b", path.read_text()))
    called -= NOT_OURS
    assert called - set(REQUESTS) == {"connect_get_namespaced_pod_exec"}, called - set(REQUESTS)
    # exec: GET (SPDY) and create (WebSocket, the client's protocol from Kubernetes 1.31)
    needed = {REQUESTS[m] for m in called if m in REQUESTS} | {("", "pods/exec", "get"), ("", "pods/exec", "create")}
    role = next(o for o in cluster.base_objects() if o["kind"] == "Role")
    assert granted(role["rules"]) == needed


def test_the_binding_names_the_workers_account_the_helm_values_use() -> None:
    objects = cluster.base_objects()
    binding = next(o for o in objects if o["kind"] == "RoleBinding")
    accounts = {o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount"}
    worker_account = cluster.helm_values()["workers"]["serviceAccount"]
    assert worker_account["create"] is False and worker_account["name"] in accounts
    assert binding["subjects"][0]["name"] == worker_account["name"]
    assert binding["roleRef"]["name"] == next(o for o in objects if o["kind"] == "Role")["metadata"]["name"]


def test_the_workers_cannot_exec_into_airflows_own_pods() -> None:
    """The workers' exec right (the provider reads XCom over exec) holds in the steps' namespace
    only; Airflow's components and its worker pods live in another, where no Role of ours grants
    the workers anything; the two namespaces may not be one."""
    from tasks.config import SettingsError

    settings = pipeline_params()
    params = settings.launcher.kubernetes
    objects = cluster.base_objects()
    steps, airflow_ns = params.namespace, params.airflow_namespace
    assert steps != airflow_ns
    assert {o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"} == {steps, airflow_ns}
    exec_roles = [o for o in objects if o["kind"] == "Role" and ("", "pods/exec", "create") in granted(o["rules"])]
    assert [r["metadata"]["namespace"] for r in exec_roles] == [steps]
    worker = {"kind": "ServiceAccount", "name": params.airflow_service_account, "namespace": airflow_ns}
    bound = [o for o in objects if o["kind"] == "RoleBinding" and worker in o["subjects"]]
    assert [b["metadata"]["namespace"] for b in bound] == [steps]
    account = next(o for o in objects if o["kind"] == "ServiceAccount" and o["metadata"]["name"] == worker["name"])
    assert account["metadata"]["namespace"] == airflow_ns
    values = cluster.helm_values()
    assert values["config"]["kubernetes_executor"]["namespace"] == airflow_ns  # worker pods beside Airflow
    logs_secret = next(o for o in cluster.secrets(ENV) if o["metadata"]["name"] == params.remote_logs.conn_secret)
    assert logs_secret["metadata"]["namespace"] == airflow_ns  # read by the chart's components
    # refused when params.yaml is read: no settings with one namespace for both reach a renderer
    with pytest.raises(SettingsError, match=r"must not be the steps' namespace \(the workers could exec into Airflow's"):
        dataclasses.replace(params, airflow_namespace=steps)


def test_every_image_is_pinned_by_digest() -> None:
    """A tag can be moved to other bytes: every image a rendered object names is pinned by digest,
    and a setting holding a tag alone is refused with one line naming it."""
    import serving

    settings = pipeline_params()
    digest = "@sha256:" + "ab" * 32
    rendered = [*cluster.base_objects(), *serving.serving_manifests(install=True)]
    images = [c["image"] for o in rendered if o["kind"] == "Deployment"
              for c in (*o["spec"]["template"]["spec"]["containers"], *o["spec"]["template"]["spec"]["initContainers"])]
    assert images and all(cluster.PINNED_IMAGE.match(image) for image in images), images
    assert cluster.pinned_image("x", "registry:5000/team/image:1.2" + digest) == "registry:5000/team/image:1.2" + digest
    assert cluster.PINNED_IMAGE.match("registry:5000/team/image" + digest)["repository"] == "registry:5000/team/image"
    for setting, path in (("launcher.kubernetes.airflow_image", ("launcher", "kubernetes", "airflow_image")),
                          ("serve.kubernetes.image", ("serve", "kubernetes", "image"))):
        section = getattr(settings, path[0])
        kubernetes = dataclasses.replace(getattr(section, path[1]), **{path[2]: "registry.example.com/x:latest"})
        moved = dataclasses.replace(settings, **{path[0]: dataclasses.replace(section, **{path[1]: kubernetes})})
        render = cluster.helm_values if path[0] == "launcher" else serving.serving_manifests
        with pytest.raises(ValueError, match=f"^{setting} 'registry.example.com/x:latest': pin the image by digest"):
            render(moved)
    for bad in ("x:1.0", "x@sha256:abc", "x:1.0@md5:" + "ab" * 16):
        with pytest.raises(ValueError, match="pin the image by digest"):
            cluster.pinned_image("s", bad)


def test_training_jobs_find_their_queue_and_priority_class() -> None:
    training = pipeline_params().launcher.kubernetes.training
    queue = next(o for o in cluster.base_objects() if o["kind"] == "LocalQueue")
    assert queue["metadata"]["name"] == training.queue_name  # the label k8s_job puts on each Job
    assert queue["spec"] == {"clusterQueue": training.cluster_queue}
    priority = next(o for o in cluster.base_objects() if o["kind"] == "PriorityClass")
    assert priority["metadata"]["name"] == training.priority_class and priority["value"] == training.priority


def test_secrets_hold_the_environment_and_refuse_a_missing_variable() -> None:
    objects = {o["metadata"]["name"]: o["stringData"] for o in cluster.secrets(ENV)}
    cluster_params = pipeline_params().launcher.kubernetes
    capture = pipeline_params().serve.kubernetes.capture_secret
    assert set(objects) == {*cluster_params.env_from_secrets, cluster_params.remote_logs.conn_secret, capture}
    assert objects["llm-pipeline-storage"] == {k: ENV[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                                                   "AWS_ENDPOINT_URL")}
    # the OpenAI front's own keys (capture-only, by your object store's policy), the steps' endpoint
    assert objects[capture] == {"AWS_ACCESS_KEY_ID": "capture-key-id", "AWS_SECRET_ACCESS_KEY": "capture-secret",
                                "AWS_ENDPOINT_URL": "http://s3:8333", "CAPTURE_CLIENT_KEY": "client-hash-key"}
    for broken, error in (({"CAPTURE_AWS_SECRET_ACCESS_KEY": ""}, f"Secret {capture}: set CAPTURE_AWS_SECRET_ACCESS_KEY"),
                          ({"CAPTURE_CLIENT_KEY": ""}, f"Secret {capture}: set CAPTURE_CLIENT_KEY"),
                          ({"CAPTURE_AWS_ACCESS_KEY_ID": "key-id"}, f"Secret {capture}: CAPTURE_AWS_ACCESS_KEY_ID is the steps'")):
        proc = subprocess.run([sys.executable, str(REPO_ROOT / "plugins" / "cluster.py"), "secrets"],
                              env={**ENV, **broken}, capture_output=True, text=True)
        assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.startswith(f"error: {error}"), proc.stderr
        assert proc.stderr.count("\n") == 1
    logs = json.loads(objects[cluster_params.remote_logs.conn_secret]["AIRFLOW_CONN"])
    assert logs == {"conn_type": "aws", "login": "key-id", "password": "secret",
                    "extra": {"endpoint_url": "http://s3:8333"}}
    without_router = {k: v for k, v in ENV.items() if k != "ROUTER_URL"}
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "plugins" / "cluster.py"), "secrets"],
                          env=without_router, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "error: Secret llm-pipeline-mlflow: set ROUTER_URL in the environment\n"


def test_helm_values_run_this_image_with_our_policy_and_remote_logs() -> None:
    values = cluster.helm_values()
    cluster_params = pipeline_params().launcher.kubernetes
    image = values["images"]["airflow"]
    assert f"{image['repository']}:{image['tag']}@{image['digest']}" == cluster_params.airflow_image
    assert values["executor"] == "KubernetesExecutor"
    import airflow

    assert values["airflowVersion"] == airflow.__version__
    assert values["airflowLocalSettings"] == (REPO_ROOT / "plugins" / "airflow_local_settings.py").read_text()
    logs = values["config"]["logging"]
    [secret] = values["secret"]
    assert secret["envName"] == f"AIRFLOW_CONN_{logs['remote_log_conn_id'].upper()}"
    assert secret["secretName"] == cluster_params.remote_logs.conn_secret
    assert logs["remote_base_log_folder"].startswith("s3://")
    assert values["config"]["kubernetes_executor"]["namespace"] == cluster_params.airflow_namespace
    # the CLI prints the same values as YAML
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "plugins" / "cluster.py"), "helm-values"],
                          capture_output=True, text=True, check=True)
    assert yaml.safe_load(proc.stdout) == values
