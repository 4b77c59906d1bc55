"""The stack's identities: S3 keys and secrets generated once per stack folder, its login names,
and the environments built from them (a client's, the steps' stack.env, the OpenAI front's, and
what an isolated server never inherits)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping

from stack.state import REPO_ROOT, ports, router_dir, state_dir, triton_repository, write_private

# the stack's login names (their passwords: secret): MLflow's (stack/mlflow_server.py), Prometheus'
# and the Pushgateway's (stack/prometheus.py)
MLFLOW_ADMIN, MLFLOW_PIPELINE_USER = "admin", "pipeline"
PROMETHEUS_USER, PUSHGATEWAY_USER = "admin", "pipeline"


def _generated_keys(name: str, prefix: str) -> dict[str, str]:
    """An S3 identity's keys, generated once per stack folder (``name``), never committed."""
    path = state_dir() / name
    if not path.exists():
        keys = {"access_key": prefix + secrets.token_hex(6), "secret_key": secrets.token_urlsafe(30)}
        write_private(path, json.dumps(keys))
    loaded: dict[str, str] = json.loads(path.read_text())
    return loaded


def credentials() -> dict[str, str]:
    """The pipeline's S3 keys (the steps', MLflow's): every bucket."""
    return _generated_keys("credentials.json", "pipeline")


def capture_credentials() -> dict[str, str]:
    """The OpenAI front's S3 keys: they may only write under ``serve.capture.uri`` (s3_identities)."""
    return _generated_keys("capture-credentials.json", "capture")


def secret(name: str) -> str:
    """A random secret generated once per stack folder (never committed)."""
    path = state_dir() / "secrets.json"
    stored: dict[str, str] = json.loads(path.read_text()) if path.exists() else {}
    if name not in stored:
        stored[name] = secrets.token_urlsafe(32)
        write_private(path, json.dumps(stored))
    return stored[name]


def client_env() -> dict[str, str]:
    """What a client (a step, the DAG, a test) needs to reach the stack."""
    port = ports()
    keys = credentials()
    return {
        "AWS_ACCESS_KEY_ID": keys["access_key"],
        "AWS_SECRET_ACCESS_KEY": keys["secret_key"],
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port['s3']}",
        "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port['mlflow']}",
        "MLFLOW_TRACKING_USERNAME": MLFLOW_PIPELINE_USER,  # MLflow asks for a login (basic-auth app)
        "MLFLOW_TRACKING_PASSWORD": secret("mlflow_pipeline"),
        # serving: Triton's own endpoints, its model repository, and the router in front of it
        "TRITON_URL": f"http://127.0.0.1:{port['triton_http']}",
        "TRITON_METRICS_URL": f"http://127.0.0.1:{port['triton_metrics']}/metrics",
        "TRITON_REPOSITORY": str(triton_repository()),
        "ROUTER_URL": f"http://127.0.0.1:{port['router']}",
        "ROUTER_INTERNAL_URL": f"http://127.0.0.1:{port['router_internal']}",  # deploy's: a version by its path
        "OPENAI_API_URL": f"http://127.0.0.1:{port['openai_api']}",  # the front behind the router's /v1
        "ROUTER_DIR": str(router_dir()),
        # observability: steps push run figures, people and tests query Prometheus; both ask for a login
        "PUSHGATEWAY_URL": f"http://127.0.0.1:{port['pushgateway']}",
        "PUSHGATEWAY_USERNAME": PUSHGATEWAY_USER,
        "PUSHGATEWAY_PASSWORD": secret("pushgateway_pipeline"),
        "PROMETHEUS_URL": f"http://127.0.0.1:{port['prometheus']}",
        "PROMETHEUS_USERNAME": PROMETHEUS_USER,  # people and tests (PEOPLE_ONLY: never the steps)
        "PROMETHEUS_PASSWORD": secret("prometheus_admin"),
    }


def capture_env() -> dict[str, str]:
    """The OpenAI front's S3 environment: the stack's endpoint and the capture's keys alone."""
    keys = capture_credentials()
    return {"AWS_ACCESS_KEY_ID": keys["access_key"], "AWS_SECRET_ACCESS_KEY": keys["secret_key"],
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{ports()['s3']}"}


# What people (and the tests) get from client_env() (`python -m stack env`) and the steps do not:
# they only push to the Pushgateway. Left out of stack.env and of Airflow's environment, as
# docker-compose.yaml gives its scheduler (where the steps run) no Prometheus login
PEOPLE_ONLY = frozenset({"PROMETHEUS_USERNAME", "PROMETHEUS_PASSWORD"})


def steps_env() -> dict[str, str]:
    """What the steps get: client_env() without people's logins. And the repository on the
    path: the DAGs and plugins import the step contract and settings (tasks/contract.py,
    tasks/config/: standard library only) as Airflow's image does from /opt/airflow."""
    env = {key: value for key, value in client_env().items() if key not in PEOPLE_ONLY}
    return {**env, "PYTHONPATH": str(REPO_ROOT)}


def write_env_file() -> dict[str, str]:
    """stack.env: what the steps Airflow launches get (sourced by the Makefile); returns it."""
    env = steps_env()
    path = state_dir() / "stack.env"
    write_private(path, "".join(f"{key}={value}\n" for key, value in env.items()))
    return env


# Never inherited by an isolated server from whoever runs `stack up` (a shell that sourced
# stack.env, the tests, a developer's own cloud keys): any S3 key, the stack's logins, Airflow's secrets
CREDENTIAL_PREFIXES = ("AWS_", "MLFLOW_", "PUSHGATEWAY_", "PROMETHEUS_", "AIRFLOW__")


def without_stack_credentials(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` less every credential and endpoint of the stack (client_env) it holds."""
    stack = set(client_env())
    return {key: value for key, value in environ.items()
            if key not in stack and not key.startswith(CREDENTIAL_PREFIXES)}
