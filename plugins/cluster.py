"""The cluster's own objects, before Airflow and serving go in (docs/kubernetes.md).

    python plugins/cluster.py base | kubectl apply -f -
    AWS_ACCESS_KEY_ID=... CAPTURE_AWS_ACCESS_KEY_ID=... CAPTURE_CLIENT_KEY=... MLFLOW_TRACKING_URI=... ROUTER_URL=... ROUTER_INTERNAL_URL=... python plugins/cluster.py secrets | kubectl apply -f -
    python plugins/cluster.py helm-values > values.yaml
    helm install airflow apache-airflow/airflow -n llm-pipeline-airflow -f values.yaml

- ``base``: two namespaces: the steps' (``launcher.kubernetes.namespace``: step pods, training
  Jobs, serving) and Airflow's (``airflow_namespace``: the chart's components and its worker
  pods). The workers may exec into the pods they launch (the provider reads XCom that way), and
  RBAC cannot narrow exec below a namespace, so their Role is in the steps' namespace only: they
  cannot exec into Airflow's own pods (its scheduler, API server, other workers, holding the
  metadata database's and the API's secrets). Then the step pods' service account
  (``launcher.kubernetes.service_account``, no API token mounted) and the deploy pods'
  (``deploy_service_account``: only deploy talks to the API server, with the Role of
  ``plugins/serving.py``); the Airflow workers' service account (in Airflow's namespace) and
  their Role with exactly the verbs our operators call (the provider's KubernetesPodOperator /
  KubernetesJobOperator and ``k8s_job.py``); the training and serving PriorityClasses; the Kueue
  LocalQueue the training Jobs are labelled with.
- ``secrets``: the Secrets the step pods read their endpoints and credentials from
  (``launcher.kubernetes.env_from_secrets``), and the OpenAI front's own
  (``serve.kubernetes.capture_secret``: ``CAPTURE_AWS_*``, keys your object store lets write
  under ``serve.capture.uri`` and nothing else), filled from the environment of whoever runs it,
  so no value is ever written to a file in this repository; a missing variable is one error line.
- ``helm-values``: values for the official Airflow chart: KubernetesExecutor, the DAG image
  (DAGs and plugins baked in), our cluster policy as its ``airflowLocalSettings``, the workers'
  service account, remote task logs on S3.

Plain dicts, no Airflow import: tests validate the core objects against the Kubernetes schemas of
the oldest and newest minor we support (``SUPPORTED_KUBERNETES``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from pipeline_params import Settings, pipeline_params

SUPPORTED_KUBERNETES = ("1.32.0", "1.37.0")  # podFailurePolicy and Indexed Jobs are GA in both
PART_OF = {"app.kubernetes.io/part-of": "llm-pipeline"}
KUEUE_API = "kueue.x-k8s.io/v1beta1"
STEP_LABEL = "llm-pipeline/step"  # every step pod's, valued with its task id (plugins/launcher.py)
DEPLOYER_LABEL = "llm-pipeline/deployer"  # "true" on the pods of tasks.deploy (deploy, rollback)
DEPLOY_MODULE = "tasks.deploy"  # the one step module that calls the Kubernetes API and Triton's pods
JOB_LABEL = "llm-pipeline/job"  # a training Job's pods' (plugins/k8s_job.py)

# What the Airflow workers' operators call, by resource (provider 10.25 + plugins/k8s_job.py):
# a step pod is created, read, listed (a retry finds the earlier try's), labelled when done and
# deleted; its log streamed; the xcom sidecar read over exec; its events listed on failure; a
# training Job likewise plus its status; the rendezvous Service created and deleted.
LAUNCHER_RULES: list[dict[str, Any]] = [
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "get", "list", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
    # exec: GET for SPDY, create for the WebSocket protocol kubectl and the client use from 1.31
    {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create", "get"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["list"]},
    {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["create", "get", "list", "patch", "delete"]},
    {"apiGroups": ["batch"], "resources": ["jobs/status"], "verbs": ["get"]},
    {"apiGroups": [""], "resources": ["services"], "verbs": ["create", "delete"]},
]

# The Secrets of launcher.kubernetes.env_from_secrets: the variables each holds, required first.
SECRET_VARIABLES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "llm-pipeline-storage": (("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"),
                             ("AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "DVC_REGISTRY_GIT_REMOTE")),
    "llm-pipeline-mlflow": (("MLFLOW_TRACKING_URI", "ROUTER_URL", "ROUTER_INTERNAL_URL"),
                            ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN",
                             # the run report and deploy push figures there, with its login where it asks for one
                             "PUSHGATEWAY_URL", "PUSHGATEWAY_USERNAME", "PUSHGATEWAY_PASSWORD")),
}


# The OpenAI front's Secret (serve.kubernetes.capture_secret): each key and the variable it is
# filled from (the front's own keys and its client-hash key, required; the object store's endpoint
# and region, the steps')
CAPTURE_SECRET_VARIABLES: dict[str, tuple[str, bool]] = {
    "AWS_ACCESS_KEY_ID": ("CAPTURE_AWS_ACCESS_KEY_ID", True), "AWS_SECRET_ACCESS_KEY": ("CAPTURE_AWS_SECRET_ACCESS_KEY", True),
    "AWS_ENDPOINT_URL": ("AWS_ENDPOINT_URL", False), "AWS_DEFAULT_REGION": ("AWS_DEFAULT_REGION", False),
    # keys the hash of each client's address the capture keeps (unkeyed, an IPv4 address's
    # hash is reversed by trying all 2^32)
    "CAPTURE_CLIENT_KEY": ("CAPTURE_CLIENT_KEY", True)}


class MissingVariable(ValueError):
    pass


class SharedCredential(ValueError):
    """The OpenAI front given the steps' storage keys or Secret."""


# name[:tag]@sha256:<64 hex>; the name may hold a registry's port (registry:5000/team/image)
PINNED_IMAGE = re.compile(r"^(?P<repository>[^@\s]+?)(?::(?P<tag>\w[\w.-]{0,127}))?@(?P<digest>sha256:[0-9a-f]{64})$")


def pinned_image_parts(setting: str, reference: str) -> re.Match[str]:
    """``reference`` split into repository, tag and digest if it is pinned by digest: a tag can be
    moved to other bytes (a rebuild, a push by mistake), and then nodes that pull at different
    times run different images, none of them perhaps the one that was tested. Anything else is
    refused, naming the setting."""
    parts = PINNED_IMAGE.match(str(reference))
    if parts is None:
        raise ValueError(f"{setting} {reference!r}: pin the image by digest, name:tag@sha256:<64 hex> "
                         "(`docker buildx imagetools inspect name:tag` prints it): a tag can be moved")
    return parts


def pinned_image(setting: str, reference: str) -> str:
    """``reference``, refused unless pinned by digest (:func:`pinned_image_parts`)."""
    return pinned_image_parts(setting, reference).group(0)


def _metadata(name: str, namespace: str | None = None) -> dict[str, Any]:
    return {"name": name, **({"namespace": namespace} if namespace else {}), "labels": dict(PART_OF)}


def namespaces(params: Settings) -> list[dict[str, Any]]:
    """The steps' and Airflow's (see the module docstring). Step pods run as uid 1000 without
    privileges and the chart's as Airflow's uid: "baseline" holds in both; "restricted" only warns."""
    cluster = params.launcher.kubernetes  # two namespaces: tasks.config refuses one for both
    objects = []
    for name in (cluster.namespace, cluster.airflow_namespace):
        meta = _metadata(name)
        meta["labels"].update({"pod-security.kubernetes.io/enforce": "baseline",
                               "pod-security.kubernetes.io/warn": "restricted"})
        objects.append({"apiVersion": "v1", "kind": "Namespace", "metadata": meta})
    return objects


def service_accounts(params: Settings) -> list[dict[str, Any]]:
    """The step pods' (no API token: they never call the API), the deploy pods' (a token, and the
    Role of plugins/serving.py), in the steps' namespace; the Airflow workers', in Airflow's."""
    cluster = params.launcher.kubernetes
    accounts = {(cluster.service_account, cluster.namespace): False,
                (cluster.deploy_service_account, cluster.namespace): True,
                (cluster.airflow_service_account, cluster.airflow_namespace): True}
    return [{"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(name, ns),
             "automountServiceAccountToken": token} for (name, ns), token in accounts.items()]


def launcher_rbac(params: Settings) -> list[dict[str, Any]]:
    """The Airflow workers' Role, in the steps' namespace only: start and follow step pods and
    training Jobs, nothing else, and nothing of Airflow's own namespace."""
    cluster = params.launcher.kubernetes
    name, ns = "llm-pipeline-launcher", cluster.namespace
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _metadata(name, ns),
         "rules": LAUNCHER_RULES},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": _metadata(name, ns),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": cluster.airflow_service_account,
                       "namespace": cluster.airflow_namespace}]},
    ]


def _priority_class(name: str, value: int, description: str) -> dict[str, Any]:
    return {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": _metadata(name),
            "value": value, "globalDefault": False, "description": description}


def training_priority_class(params: Settings) -> dict[str, Any]:
    training = params.launcher.kubernetes.training
    return _priority_class(training.priority_class, training.priority,
                           "LLM pipeline training Jobs: above batch work, below serving")


def serving_priority_class(params: Settings) -> dict[str, Any]:
    """Serving's PriorityClass (the Triton pods of ``plugins/serving.py``), above training's."""
    settings = params.serve.kubernetes
    return _priority_class(settings.priority_class, settings.priority,
                           "LLM pipeline serving (Triton): above training, so a training Job never preempts it")


def training_local_queue(params: Settings) -> dict[str, Any]:
    """The namespace's door to the cluster queue an administrator set up (its quotas, flavors)."""
    cluster = params.launcher.kubernetes
    training = cluster.training
    return {"apiVersion": KUEUE_API, "kind": "LocalQueue",
            "metadata": _metadata(training.queue_name, cluster.namespace),
            "spec": {"clusterQueue": training.cluster_queue}}


def step_network_policy(params: Settings) -> dict[str, Any]:
    """No connection reaches a step pod but a training rank's from another rank (the c10d
    rendezvous, gloo or NCCL: any port). Steps are clients; Airflow reads their logs, exit and
    XCom through the API server, which no NetworkPolicy governs."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _metadata("llm-pipeline-steps", params.launcher.kubernetes.namespace),
            "spec": {"podSelector": {"matchExpressions": [{"key": STEP_LABEL, "operator": "Exists"}]},
                     "policyTypes": ["Ingress"],
                     "ingress": [{"from": [{"podSelector": {"matchExpressions": [{"key": JOB_LABEL, "operator": "Exists"}]}}]}]}}


def base_objects(params: Settings | None = None) -> list[dict[str, Any]]:
    params = params or pipeline_params()
    return [*namespaces(params), *service_accounts(params), *launcher_rbac(params),
            training_priority_class(params), serving_priority_class(params), training_local_queue(params),
            step_network_policy(params)]


def secrets(env: dict[str, str], params: Settings | None = None) -> list[dict[str, Any]]:
    params = params or pipeline_params()
    cluster = params.launcher.kubernetes
    objects = []
    for name in cluster.env_from_secrets:
        required, optional = SECRET_VARIABLES[name]
        missing = [key for key in required if not env.get(key)]
        if missing:
            raise MissingVariable(f"Secret {name}: set {', '.join(missing)} in the environment")
        data = {key: env[key] for key in (*required, *optional) if env.get(key)}
        objects.append(_secret(name, cluster.namespace, data))
    objects.append(capture_secret(env, params))
    # Airflow's components read it (the chart's `secret`): in Airflow's namespace
    objects.append(_secret(cluster.remote_logs.conn_secret, cluster.airflow_namespace,
                           {"AIRFLOW_CONN": json.dumps(remote_logs_connection(env))}))
    return objects


def capture_secret_name(params: Settings) -> str:
    """``serve.kubernetes.capture_secret``, refused where it names one of the steps' Secrets: the
    OpenAI front is the process clients reach, and the steps' storage keys can replace the
    exports Triton runs."""
    name = params.serve.kubernetes.capture_secret
    if name in params.launcher.kubernetes.env_from_secrets:
        raise SharedCredential(f"serve.kubernetes.capture_secret {name!r} is one of the steps' Secrets "
                               "(launcher.kubernetes.env_from_secrets): give the OpenAI front a Secret of its "
                               "own, whose keys may only write under serve.capture.uri")
    return name


def capture_secret(env: dict[str, str], params: Settings) -> dict[str, Any]:
    """The OpenAI front's Secret: its own S3 keys (``CAPTURE_AWS_*``), which your object store
    must let write under ``serve.capture.uri`` alone (an IAM policy allowing ``s3:PutObject`` on
    that prefix), and the steps' endpoint and region."""
    name = capture_secret_name(params)
    missing = [variable for variable, required in CAPTURE_SECRET_VARIABLES.values() if required and not env.get(variable)]
    if missing:
        raise MissingVariable(f"Secret {name}: set {', '.join(missing)} in the environment")
    if env["CAPTURE_AWS_ACCESS_KEY_ID"] == env.get("AWS_ACCESS_KEY_ID"):
        raise SharedCredential(f"Secret {name}: CAPTURE_AWS_ACCESS_KEY_ID is the steps' AWS_ACCESS_KEY_ID: give the "
                               "OpenAI front keys of its own, which may only write under serve.capture.uri")
    data = {key: env[variable] for key, (variable, _) in CAPTURE_SECRET_VARIABLES.items() if env.get(variable)}
    return _secret(name, params.launcher.kubernetes.namespace, data)


def remote_logs_connection(env: dict[str, str]) -> dict[str, Any]:
    """The Airflow connection (JSON form) the chart's components write task logs to S3 with: the
    storage Secret's credentials and endpoint."""
    extra = {key: env[var] for key, var in (("endpoint_url", "AWS_ENDPOINT_URL"), ("region_name", "AWS_DEFAULT_REGION"))
             if env.get(var)}
    return {"conn_type": "aws", "login": env["AWS_ACCESS_KEY_ID"], "password": env["AWS_SECRET_ACCESS_KEY"],
            "extra": extra}


def _secret(name: str, namespace: str, data: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": _metadata(name, namespace), "type": "Opaque",
            "stringData": data}


def helm_values(params: Settings | None = None) -> dict[str, Any]:
    """Values for the official Airflow chart (apache-airflow/airflow, chart 1.x)."""
    params = params or pipeline_params()
    cluster = params.launcher.kubernetes
    namespaces(params)  # refuses Airflow's namespace being the steps'
    image = pinned_image_parts("launcher.kubernetes.airflow_image", cluster.airflow_image)
    repository, tag, digest = image["repository"], image["tag"], image["digest"]
    logs = cluster.remote_logs
    local_settings = Path(__file__).with_name("airflow_local_settings.py").read_text()
    return {
        "executor": "KubernetesExecutor",
        "airflowVersion": airflow_version(),  # the chart renders Airflow 3's components from it
        # the chart pulls by digest where one is given (it takes precedence over the tag)
        "images": {"airflow": {"repository": repository, "tag": tag, "digest": digest,
                               "pullPolicy": cluster.image_pull_policy}},
        # the image holds the DAGs, plugins and params.yaml (containers/Dockerfile.airflow)
        "dags": {"persistence": {"enabled": False}, "gitSync": {"enabled": False}},
        "airflowLocalSettings": local_settings,
        "env": [{"name": "PIPELINE_LAUNCHER_MODE", "value": "kubernetes"}],
        "workers": {"serviceAccount": {"create": False, "name": cluster.airflow_service_account}},
        # the S3 connection of the remote logs, from the storage Secret's keys
        "secret": [{"envName": "AIRFLOW_CONN_" + logs.conn_id.upper(),
                    "secretName": logs.conn_secret, "secretKey": "AIRFLOW_CONN"}],
        "config": {
            "core": {"load_examples": "False"},
            "logging": {"remote_logging": "True", "remote_base_log_folder": logs.base_uri,
                        "remote_log_conn_id": logs.conn_id},
            # worker pods in Airflow's namespace (the chart is installed there), step pods in the steps'
            "kubernetes_executor": {"namespace": cluster.airflow_namespace, "delete_worker_pods": "True"},
        },
    }


def airflow_version() -> str:
    """The Airflow version of the orchestrator lock (the image installs it)."""
    lock = Path(__file__).resolve().parents[1] / "requirements" / "orchestrator.txt"
    return next(line.split("==")[1].strip() for line in lock.read_text().splitlines()
                if line.startswith("apache-airflow=="))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python plugins/cluster.py", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["base", "secrets", "helm-values"])
    args = parser.parse_args(argv)
    try:
        if args.what == "base":
            yaml.safe_dump_all(base_objects(), sys.stdout, sort_keys=False)
        elif args.what == "secrets":
            yaml.safe_dump_all(secrets(dict(os.environ)), sys.stdout, sort_keys=False)
        else:
            yaml.safe_dump(helm_values(), sys.stdout, sort_keys=False)
    except (MissingVariable, SharedCredential) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
