"""Start, reuse and stop the local stack's servers (see ``python -m stack --help``)."""

from __future__ import annotations

import configparser
import contextlib
import fcntl
import functools
import io
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tasks.config import ServeSettings, load
from tasks.lib.metrics import basic_auth
from tasks.lib.polling import wait_until

REPO_ROOT = Path(__file__).resolve().parents[1]
BUCKETS = ("pipeline", "raw", "dvc", "mlflow")


def state_dir() -> Path:
    path = Path(os.environ.get("STACK_DIR", REPO_ROOT / ".stack"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def ports() -> dict[str, int]:
    configured = load().stack.ports
    return {name: int(os.environ.get(f"STACK_PORT_{name.upper()}", port)) for name, port in configured.items()}


def write_private(path: Path, text: str, mode: int = 0o600) -> None:
    """A file only its owner can read (or ``mode``), from its first byte (its mode set before
    anything is written, not chmod'ed after), replaced atomically: a reader sees the old file or
    the new one, each readable as it should be."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, mode)  # exactly mode, whatever the umask
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(staged, path)


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


def _secret(name: str) -> str:
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
        "MLFLOW_TRACKING_PASSWORD": _secret("mlflow_pipeline"),
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
        "PUSHGATEWAY_PASSWORD": _secret("pushgateway_pipeline"),
        "PROMETHEUS_URL": f"http://127.0.0.1:{port['prometheus']}",
        "PROMETHEUS_USERNAME": PROMETHEUS_USER,  # people and tests (PEOPLE_ONLY: never the steps)
        "PROMETHEUS_PASSWORD": _secret("prometheus_admin"),
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
    tasks/config.py: standard library only) as Airflow's image does from /opt/airflow."""
    env = {key: value for key, value in client_env().items() if key not in PEOPLE_ONLY}
    return {**env, "PYTHONPATH": str(REPO_ROOT)}


def triton_repository() -> Path:
    return state_dir() / "triton" / "models"


def router_dir() -> Path:
    return state_dir() / "router"


def write_env_file() -> dict[str, str]:
    """stack.env: what the steps Airflow launches get (sourced by the Makefile); returns it."""
    env = steps_env()
    path = state_dir() / "stack.env"
    write_private(path, "".join(f"{key}={value}\n" for key, value in env.items()))
    return env


class StackError(RuntimeError):
    """A server of the stack could not be started (one line for `python -m stack up`)."""


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


# Never inherited by an isolated server from whoever runs `stack up` (a shell that sourced
# stack.env, the tests, a developer's own cloud keys): any S3 key, the stack's logins, Airflow's secrets
CREDENTIAL_PREFIXES = ("AWS_", "MLFLOW_", "PUSHGATEWAY_", "PROMETHEUS_", "AIRFLOW__")


def without_stack_credentials(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` less every credential and endpoint of the stack (client_env) it holds."""
    stack = set(client_env())
    return {key: value for key, value in environ.items()
            if key not in stack and not key.startswith(CREDENTIAL_PREFIXES)}


@dataclass(frozen=True)
class Server:
    name: str
    command: Callable[[], list[str]]
    env: Callable[[], dict[str, str]]
    healthy: Callable[[], bool]
    start_timeout_s: float
    port: str | None = None  # its key in ports(): the port it serves on, refused when another process holds it
    # its process holds the credentials of env() alone (see process_env); Airflow's components
    # are not isolated: they run the steps, and a developer's AIRFLOW__ settings are meant for them
    isolated: bool = True

    @property
    def pid_file(self) -> Path:
        return state_dir() / f"{self.name}.pid"

    @property
    def log_file(self) -> Path:
        return state_dir() / f"{self.name}.log"

    def process_env(self) -> dict[str, str]:
        """Its process's environment: the starter's, less the stack's credentials where it is
        isolated (SeaweedFS would adopt a starter's AWS keys as one more admin identity; the
        OpenAI front must hold only its capture's keys), and env()."""
        inherited = without_stack_credentials(os.environ) if self.isolated else dict(os.environ)
        return {**inherited, **self.env()}

    def pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text())
            os.kill(pid, 0)
            return pid
        except (FileNotFoundError, ValueError, ProcessLookupError):
            return None

    def start(self) -> None:
        if self.pid() and self.healthy():
            return  # reuse a healthy running server
        self.stop()
        if self.port is not None and _listening(port := ports()[self.port]):
            # another stack's server on the same port would answer the health check (and the steps)
            raise StackError(f"{self.name}: port {port} is held by a process this stack ({state_dir()}) did not "
                             f"start: stop it, or give this stack other ports (STACK_PORT_{self.port.upper()})")
        with self.log_file.open("ab") as log:
            proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.process_env(),
                cwd=state_dir(),
                start_new_session=True,  # own process group: `down` stops its children too
            )
        self.pid_file.write_text(str(proc.pid))
        def healthy() -> bool:
            if self.healthy():
                return True
            if proc.poll() is not None:
                raise StackError(f"{self.name} exited with {proc.returncode}; see {self.log_file}")
            return False

        wait_until(healthy, self.start_timeout_s, 0.3, lambda: StackError(
            f"{self.name} not healthy after {self.start_timeout_s:.0f}s; see {self.log_file}"))

    def stop(self) -> None:
        stop_servers([self])


def stop_servers(servers: Iterable[Server]) -> None:
    """Stop servers (and their children) together: one grace period for all of them. Airflow's
    components each used most of theirs, and stopping them one after another took ~50 s."""
    servers = list(servers)
    _terminate_groups([pid for pid in (server.pid() for server in servers) if pid is not None])
    for server in servers:
        server.pid_file.unlink(missing_ok=True)


def _terminate_groups(pids: list[int], grace_s: float = 10.0) -> None:
    """SIGTERM each process group, then SIGKILL those still alive after the grace period."""
    _signal_groups(pids, signal.SIGTERM)
    alive = _wait_for_groups(pids, grace_s)
    _signal_groups(alive, signal.SIGKILL)
    _wait_for_groups(alive, 5.0)


def _signal_groups(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)


def _wait_for_groups(pids: Iterable[int], timeout_s: float) -> set[int]:
    """The groups still alive after up to timeout_s."""
    alive = {pid for pid in pids if _group_alive(pid)}
    deadline = time.monotonic() + timeout_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = {pid for pid in alive if _group_alive(pid)}
    return alive


def _group_alive(pid: int) -> bool:
    # a leader this process started stays a zombie member of its group until reaped
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    try:
        os.killpg(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _http_ok(url: str, headers: Mapping[str, str] | None = None) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=dict(headers or {})), timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def _bin(name: str) -> str:
    """A console script of the runtime environment (the one running this module)."""
    found = Path(sys.executable).parent / name
    return str(found) if found.exists() else (shutil.which(name) or name)


def capture_actions(capture_uri: str) -> list[str]:
    """SeaweedFS actions writing objects under ``capture_uri`` and nothing else. SeaweedFS 4.48
    matches an action ending in ``*`` as a prefix of ``Write:<bucket>/<key>``: such a key writes
    (and overwrites, deletes) objects under the prefix, and is refused (AccessDenied) reading,
    listing, copying from elsewhere, and writing any other key or bucket (tests/stack). A capture
    that is not on S3 needs none."""
    if not capture_uri.startswith("s3://"):
        return []
    bucket, _, prefix = capture_uri.removeprefix("s3://").partition("/")
    prefix = prefix.strip("/")
    return [f"Write:{bucket}/{prefix + '/' if prefix else ''}*"]


def s3_identities(pipeline: Mapping[str, str], capture: Mapping[str, str], capture_uri: str) -> dict[str, Any]:
    """SeaweedFS's ``-s3.config``: the pipeline's identity (every bucket: the steps, MLflow) and
    the OpenAI front's (``capture``: writes its capture, nothing else; the front is the public
    process, and the pipeline's keys would let it replace the exports Triton runs). Each of
    ``pipeline``, ``capture``: ``access_key`` and ``secret_key``."""
    if pipeline["access_key"] == capture["access_key"]:
        raise ValueError("the capture's S3 access key is the pipeline's: give the OpenAI front its own")

    def identity(name: str, keys: Mapping[str, str], actions: list[str]) -> dict[str, Any]:
        return {"name": name, "credentials": [{"accessKey": keys["access_key"], "secretKey": keys["secret_key"]}],
                "actions": actions}

    return {"identities": [identity("pipeline", pipeline, ["Admin", "Read", "Write", "List", "Tagging"]),
                           identity("capture", capture, capture_actions(capture_uri))]}


def _s3_json() -> Path:
    path = state_dir() / "seaweedfs" / "s3.json"
    config = s3_identities(credentials(), capture_credentials(), load().serve.capture.uri)
    write_private(path, json.dumps(config))
    return path


def _seaweedfs_command() -> list[str]:
    port = ports()
    root = state_dir() / "seaweedfs"
    (root / "data").mkdir(parents=True, exist_ok=True)
    (root / "logs").mkdir(parents=True, exist_ok=True)
    return [
        _bin("weed"),
        f"-logdir={root / 'logs'}",
        "mini",
        f"-dir={root / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-s3.config={_s3_json()}",
        f"-s3.port={port['s3']}",
        f"-master.port={port['seaweedfs_master']}",
        f"-volume.port={port['seaweedfs_volume']}",
        f"-filer.port={port['seaweedfs_filer']}",
        f"-s3.localSocket={root / 's3.sock'}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-webdav=false",
        "-admin.ui=false",
    ]


def _s3_healthy() -> bool:
    # SeaweedFS answers its health path without credentials once the S3 gateway is serving; it
    # reads its identities at start only: one started on an older s3.json (no capture identity)
    # is restarted, or the front's captures would all be refused
    return (_http_ok(f"http://127.0.0.1:{ports()['s3']}/healthz") and _buckets_reachable()
            and _buckets_reachable(capture_env()))


def _buckets_reachable(env: Mapping[str, str] | None = None) -> bool:
    """Whether the S3 server takes the keys of ``env`` (the pipeline's by default)."""
    try:
        _s3_client(env).list_buckets()
        return True
    except Exception:
        return False


def _s3_client(env: Mapping[str, str] | None = None) -> Any:
    import boto3

    env = env or client_env()
    return boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        region_name=env["AWS_DEFAULT_REGION"],
    )


def create_buckets(env: Mapping[str, str] | None = None) -> None:
    client = _s3_client(env)
    existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    for bucket in BUCKETS:
        if bucket not in existing:
            client.create_bucket(Bucket=bucket)


MLFLOW_ADMIN, MLFLOW_PIPELINE_USER = "admin", "pipeline"


def mlflow_auth_config(database_uri: str) -> str:
    """MLflow's basic-auth app's settings (no secret in them: the admin's password comes from
    ``MLFLOW_AUTH_ADMIN_PASSWORD`` in the server's environment, used when the admin is first
    created). An authenticated user may read everything and write what it created
    (``default_permission`` READ; the ``pipeline`` user, created by
    :func:`ensure_mlflow_pipeline_user`, creates the pipeline's experiments and models, so it
    manages them). A checked password is cached for 5 minutes: MLflow hashes it with PBKDF2 per
    request otherwise (~0.3 s on these machines)."""
    config = configparser.ConfigParser()
    config["mlflow"] = {"default_permission": "READ", "database_uri": database_uri, "admin_username": MLFLOW_ADMIN,
                        "authorization_function": "mlflow.server.auth:authenticate_request_basic_auth",
                        "auth_cache_ttl_seconds": "300"}
    text = io.StringIO()
    config.write(text)
    return text.getvalue()


def ensure_mlflow_pipeline_user(tracking_uri: str, admin_password: str, password: str) -> None:
    """The pipeline's MLflow user (``MLFLOW_TRACKING_USERNAME``/``PASSWORD`` of the steps),
    created once by the admin, with MANAGE on MLflow's Default experiment and on the pipeline's
    experiment and registered model where they already exist (created before the server asked
    for logins); what it creates later it manages anyway."""
    from mlflow.exceptions import MlflowException, RestException
    from mlflow.server.auth.client import AuthServiceClient

    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")}
    os.environ.update(MLFLOW_TRACKING_USERNAME=MLFLOW_ADMIN, MLFLOW_TRACKING_PASSWORD=admin_password)
    try:
        admin = AuthServiceClient(tracking_uri)
        try:
            admin.get_user(MLFLOW_PIPELINE_USER)
            admin.update_user_password(MLFLOW_PIPELINE_USER, password)  # the steps' password as configured now
        except RestException:  # RESOURCE_DOES_NOT_EXIST: the first start
            admin.create_user(MLFLOW_PIPELINE_USER, password)
        except MlflowException as exc:
            if " 404 " in f" {exc} ":  # a page, not MLflow's JSON: no auth app behind this address
                raise StackError(f"MLflow at {tracking_uri} asks for no login (a server started by older code: "
                                 "stop it and start the stack again)") from None
            if " 401 " in f" {exc} ":
                raise StackError(f"MLflow at {tracking_uri} refused the admin's login: its password is fixed "
                                 "when MLflow's auth database is first created (keep MLFLOW_ADMIN_PASSWORD, or "
                                 "the stack's secrets.json, as it was then)") from None
            raise
        from mlflow import MlflowClient

        settings = load()
        experiment = MlflowClient(tracking_uri).get_experiment_by_name(settings.train.experiment)
        # and MLflow's Default experiment (0, created with the database): runs started without one
        grants = [("experiment", "0"), *([("experiment", experiment.experiment_id)] if experiment else [])]
        with contextlib.suppress(MlflowException):  # absent: the pipeline creates it, so it manages it
            MlflowClient(tracking_uri).get_registered_model(settings.pipeline.model_name)
            grants.append(("registered_model", settings.pipeline.model_name))
        for resource_type, resource in grants:
            with contextlib.suppress(RestException):  # RESOURCE_ALREADY_EXISTS: granted at an earlier start
                admin.grant_user_permission(MLFLOW_PIPELINE_USER, resource_type, resource, "MANAGE")
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _mlflow_command() -> list[str]:
    root = state_dir() / "mlflow"
    root.mkdir(parents=True, exist_ok=True)
    return [
        _bin("mlflow"),
        "server",
        "--app-name",
        "basic-auth",  # logins required (mlflow_auth_config)
        "--backend-store-uri",
        f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination",
        "s3://mlflow/artifacts",
        "--host",
        "127.0.0.1",
        "--port",
        str(ports()["mlflow"]),
        "--workers",
        "1",
    ]


def _mlflow_env() -> dict[str, str]:
    env = client_env()
    root = state_dir() / "mlflow"
    config = root / "basic_auth.ini"
    config.write_text(mlflow_auth_config(f"sqlite:///{root / 'basic_auth.db'}"))
    return {
        "MLFLOW_AUTH_CONFIG_PATH": str(config),
        "MLFLOW_AUTH_ADMIN_PASSWORD": _secret("mlflow_admin"),  # used when the admin is first created
        "MLFLOW_FLASK_SERVER_SECRET_KEY": _secret("mlflow_flask"),  # the auth app's CSRF tokens
        "AWS_ACCESS_KEY_ID": env["AWS_ACCESS_KEY_ID"],
        "AWS_SECRET_ACCESS_KEY": env["AWS_SECRET_ACCESS_KEY"],
        "AWS_DEFAULT_REGION": env["AWS_DEFAULT_REGION"],
        "MLFLOW_S3_ENDPOINT_URL": env["AWS_ENDPOINT_URL"],
        # the job-execution helpers cost ~2 GB of memory and the pipeline does not use them
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }


def _pytriton_dir() -> Path:
    import pytriton

    return Path(pytriton.__file__).parent / "tritonserver"


def _triton_backends() -> Path:
    """Triton's backend folder: the wheel's python backend plus the stub built for this
    interpreter's Python version (the wheel ships one per version beside the backend)."""
    wheel = _pytriton_dir()
    python = state_dir() / "triton" / "backends" / "python"
    python.mkdir(parents=True, exist_ok=True)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for source in (wheel / "backends" / "python" / "libtriton_python.so",
                   wheel / "backends" / "python" / "triton_python_backend_utils.py",
                   wheel / "python_backend_stubs" / version / "triton_python_backend_stub"):
        link = python / source.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(source)
    return python.parent


def _triton_command() -> list[str]:
    port = ports()
    triton_repository().mkdir(parents=True, exist_ok=True)
    return [
        str(_pytriton_dir() / "bin" / "tritonserver"),
        f"--model-repository={triton_repository()}",
        f"--backend-directory={_triton_backends()}",
        "--model-control-mode=explicit",  # deploy loads and unloads versions
        "--strict-readiness=false",
        "--exit-on-error=false",
        "--http-address=127.0.0.1", f"--http-port={port['triton_http']}",
        "--grpc-address=127.0.0.1", f"--grpc-port={port['triton_grpc']}",
        "--metrics-address=127.0.0.1", f"--metrics-port={port['triton_metrics']}",
        "--allow-gpu-metrics=false",
        "--metrics-config=summary_latencies=true",  # latency quantiles per version (the p99 of the dashboard)
        "--log-verbose=0",
    ]


def _triton_env() -> dict[str, str]:
    """The python stub links libpython: it must find this interpreter's (a distribution's
    older libpython of the same minor version breaks it), and import from this venv."""
    import sysconfig

    libs = [str(sysconfig.get_config_var("LIBDIR")), str(_pytriton_dir().parent.parent / "nvidia_pytriton.libs")]
    venv_bin = str(Path(sys.executable).parent)
    return {
        "LD_LIBRARY_PATH": ":".join([*libs, os.environ.get("LD_LIBRARY_PATH", "")]).rstrip(":"),
        "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(Path(sysconfig.get_paths()["purelib"])),
    }


def _openai_api_env() -> dict[str, str]:
    """The front writes its served-traffic capture (serve.capture) with the capture's keys alone:
    it is the process clients reach, and the pipeline's keys could replace what Triton runs."""
    # CAPTURE_CLIENT_KEY keys the hash of each client's address the capture keeps (the drift
    # check counts clients by it): one per stack folder, so a restarted front hashes alike
    return {"PYTHONPATH": str(REPO_ROOT), **capture_env(), "CAPTURE_CLIENT_KEY": _secret("capture_client_key")}


def _openai_api_command() -> list[str]:
    """The OpenAI-compatible front (tasks/serving/front.py): the router sends /v1/* to it."""
    return [sys.executable, "-m", "tasks.serving.front", "--port", str(ports()["openai_api"]),
            "--triton-url", client_env()["TRITON_URL"]]


def _router_command() -> list[str]:
    from tasks.serving.router import nginx_binary, write_router_config

    port = ports()
    conf = write_router_config(router_dir(), port["router"], port["triton_http"], port["openai_api"],
                               port["router_internal"])
    return [nginx_binary(), "-p", str(router_dir()), "-c", str(conf)]


def _airflow_env() -> dict[str, str]:
    port = ports()["airflow"]
    return {
        **steps_env(),  # the steps Airflow launches reach the stack with these
        "AIRFLOW_HOME": str(REPO_ROOT),
        "AIRFLOW__API__HOST": "127.0.0.1",  # loopback only, like every server of the stack
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{port}/execution/",
        # every component must sign and check task tokens with the same key
        "AIRFLOW__API_AUTH__JWT_SECRET": _secret("airflow_jwt"),
        "AIRFLOW__API__SECRET_KEY": _secret("airflow_api"),
    }


def _airflow_health() -> dict[str, object]:
    try:
        url = f"http://127.0.0.1:{ports()['airflow']}/api/v2/monitor/health"
        with urllib.request.urlopen(url, timeout=2) as resp:
            loaded: dict[str, object] = json.loads(resp.read())
            return loaded
    except (OSError, ValueError):
        return {}


def _airflow_component(component: str) -> Server:
    """One Airflow component, run from the orchestrator venv beside this one."""
    airflow = str(REPO_ROOT / ".venvs" / "orchestrator" / "bin" / "airflow")
    key = component.replace("-", "_")

    def healthy() -> bool:
        report = _airflow_health()
        if component == "api-server":
            return bool(report)
        state = report.get(key)
        return isinstance(state, dict) and state.get("status") == "healthy"

    # the scheduler's and triggerer's log servers bind every interface (no host setting): the
    # api-server reads the task logs from the shared local folder instead
    extra = ["--skip-serve-logs"] if component in ("scheduler", "triggerer") else []
    return Server(f"airflow-{component}", lambda: [airflow, component, *extra], _airflow_env, healthy,
                  start_timeout_s=120, port="airflow" if component == "api-server" else None, isolated=False)


AIRFLOW_SERVERS = tuple(_airflow_component(c) for c in ("api-server", "scheduler", "dag-processor", "triggerer"))


def create_airflow_pools(airflow: str | None = None, env: Mapping[str, str] | None = None) -> None:
    """The pools the retrain DAG's steps queue in (params.yaml ``pipeline.pools``), created or
    resized before the scheduler starts: the scheduler never runs a task of a missing pool."""
    pools = load().pipeline.pools
    spec = {name: {"slots": pool.slots, "description": pool.description, "include_deferred": False}
            for name, pool in pools.items()}
    path = state_dir() / "airflow-pools.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec, indent=1))
    airflow = airflow or str(REPO_ROOT / ".venvs" / "orchestrator" / "bin" / "airflow")
    subprocess.run([airflow, "pools", "import", str(path)], env={**os.environ, **(env or _airflow_env())},
                   check=True, stdout=subprocess.DEVNULL)


def init_compose_stack() -> None:
    """docker-compose.yaml's one-shot set-up (its airflow-init service, after ``airflow db
    migrate``), from that container's environment: the buckets, the router's config (listening
    on the compose network, Triton and the OpenAI front by service name), the model repository
    folder, the pools."""
    env = dict(os.environ)
    create_buckets(env)
    router, triton = urllib.parse.urlsplit(env["ROUTER_URL"]), urllib.parse.urlsplit(env["TRITON_URL"])
    openai, internal = urllib.parse.urlsplit(env["OPENAI_API_URL"]), urllib.parse.urlsplit(env["ROUTER_INTERNAL_URL"])
    from tasks.serving.router import write_router_config

    write_router_config(Path(env["ROUTER_DIR"]), router.port or 80, triton.port or 80, openai.port or 80,
                        internal.port or 80,
                        listen_host="0.0.0.0", triton_host=triton.hostname or "triton",
                        openai_host=openai.hostname or "openai-api")
    Path(env["TRITON_REPOSITORY"]).mkdir(parents=True, exist_ok=True)
    create_airflow_pools(shutil.which("airflow") or "airflow", env)


def _debian_bin(name: str) -> str:
    """A server from a Debian package (the Makefile installs it with apt-get when missing)."""
    found = shutil.which(name) or f"/usr/bin/{name}"
    if not Path(found).exists():
        raise RuntimeError(f"{name} is not installed: run `make env` (it installs the Debian package)")
    return found


PROMETHEUS_USER, PUSHGATEWAY_USER = "admin", "pipeline"
# The files of write_metrics_auth: each server's web config (its users' bcrypt hashes), the
# passwords Prometheus scrapes with (itself, and the Pushgateway) and the Pushgateway's own
# (its health check in compose)
PROMETHEUS_WEB, PUSHGATEWAY_WEB = "prometheus-web.yml", "pushgateway-web.yml"
PROMETHEUS_PASSWORD_FILE, PUSHGATEWAY_PASSWORD_FILE = "prometheus.password", "pushgateway.password"


def web_config(username: str, password: str) -> str:
    """A Prometheus server's ``--web.config.file`` (Prometheus and the Pushgateway read the same
    format): one basic-auth user, its password as a bcrypt hash. Every path asks for it, health
    included."""
    import bcrypt

    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=10)).decode()
    return yaml.safe_dump({"basic_auth_users": {username: hashed}})


def write_metrics_auth(prometheus_dir: Path, pushgateway_dir: Path, prometheus_password: str,
                       pushgateway_password: str, mode: int = 0o600) -> None:
    """The logins of Prometheus (people, Grafana, its own scrape) and the Pushgateway (the steps
    push, Prometheus scrapes), as each server reads them from its folder: Prometheus' holds its
    web config and both passwords it scrapes with, the Pushgateway's only its own web config and
    password (one folder locally). ``mode`` 0644 in docker-compose.yaml, where the servers run as
    another user than the one-shot that writes them (each folder is a volume only its server
    mounts)."""
    hashed_prometheus = web_config(PROMETHEUS_USER, prometheus_password)
    hashed_pushgateway = web_config(PUSHGATEWAY_USER, pushgateway_password)
    for folder, files in ((prometheus_dir, {PROMETHEUS_WEB: hashed_prometheus, PROMETHEUS_PASSWORD_FILE: prometheus_password,
                                            PUSHGATEWAY_PASSWORD_FILE: pushgateway_password}),
                          (pushgateway_dir, {PUSHGATEWAY_WEB: hashed_pushgateway,
                                             PUSHGATEWAY_PASSWORD_FILE: pushgateway_password})):
        for name, text in files.items():
            write_private(folder / name, text, mode)


def _metrics_auth_dir() -> Path:
    """The local stack's logins, written again at each start from its secrets (both servers read
    their web config at each request: replacing it with the same passwords changes nothing)."""
    return _write_local_metrics_auth(state_dir() / "metrics-auth")


@functools.cache
def _write_local_metrics_auth(folder: Path) -> Path:
    """Once per process and folder: the Pushgateway's command and Prometheus' config and command
    all name it, and each write hashes both passwords with bcrypt."""
    write_metrics_auth(folder, folder, _secret("prometheus_admin"), _secret("pushgateway_pipeline"))
    return folder


def _pushgateway_command() -> list[str]:
    """The Pushgateway, its pushes kept in this stack's folder across restarts. Debian's build
    defaults to one file for the whole machine (/var/lib/prometheus/pushgateway.data): every stack
    on it (a developer's, the tests', the benchmarks') read and overwrote the others' runs."""
    persisted = state_dir() / "pushgateway" / "metrics.data"
    persisted.parent.mkdir(parents=True, exist_ok=True)
    return [_debian_bin("prometheus-pushgateway"), f"--web.listen-address=127.0.0.1:{ports()['pushgateway']}",
            f"--web.config.file={_metrics_auth_dir() / PUSHGATEWAY_WEB}", f"--persistence.file={persisted}"]


def prometheus_config(targets: dict[str, str], rule_file: str, auth_dir: str) -> dict[str, Any]:
    """Scrape Triton (per-version request counters and latencies) and the Pushgateway (each run's
    figures, labels kept as pushed) and, where one runs, the StatsD exporter holding Airflow's own
    metrics; evaluate the alert rules. ``targets``: host:port of ``prometheus``, ``pushgateway``,
    ``triton`` (its metrics port) and optionally ``statsd_exporter`` (docker-compose.yaml only).
    ``auth_dir``: where the passwords of write_metrics_auth are (Prometheus and the Pushgateway
    ask for logins, itself included)."""
    def login(username: str, password_file: str) -> dict[str, Any]:
        return {"basic_auth": {"username": username, "password_file": f"{auth_dir}/{password_file}"}}

    jobs = [
        {"job_name": "prometheus", **login(PROMETHEUS_USER, PROMETHEUS_PASSWORD_FILE),
         "static_configs": [{"targets": [targets["prometheus"]]}]},
        {"job_name": "pushgateway", "honor_labels": True, **login(PUSHGATEWAY_USER, PUSHGATEWAY_PASSWORD_FILE),
         "static_configs": [{"targets": [targets["pushgateway"]]}]},
        {"job_name": "triton", "static_configs": [{"targets": [targets["triton"]]}]},
    ]
    if "statsd_exporter" in targets:
        jobs.append({"job_name": "airflow", "static_configs": [{"targets": [targets["statsd_exporter"]]}]})
    return {"global": {"scrape_interval": "5s", "evaluation_interval": "5s"}, "rule_files": [rule_file],
            "scrape_configs": jobs}


def write_prometheus_config() -> Path:
    port = ports()
    config = prometheus_config(
        {"prometheus": f"127.0.0.1:{port['prometheus']}", "pushgateway": f"127.0.0.1:{port['pushgateway']}",
         "triton": f"127.0.0.1:{port['triton_metrics']}"},
        str(REPO_ROOT / "observability" / "alerts.yml"), str(_metrics_auth_dir()))
    path = state_dir() / "prometheus" / "prometheus.yml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _prometheus_command() -> list[str]:
    return [_debian_bin("prometheus"), f"--config.file={write_prometheus_config()}",
            f"--storage.tsdb.path={state_dir() / 'prometheus' / 'data'}",
            f"--web.listen-address=127.0.0.1:{ports()['prometheus']}",
            f"--web.config.file={_metrics_auth_dir() / PROMETHEUS_WEB}"]


def _asks_for_login(server: str, path: str) -> bool:
    """``path`` of the Prometheus server named ``server`` (pushgateway, prometheus) answers 200
    to the stack's login and 401 without one (a server started by older code, which asks for
    none, is not reused: it is restarted with its login)."""
    env = client_env()
    url, prefix = f"{env[f'{server.upper()}_URL']}{path}", server.upper()
    if not _http_ok(url, basic_auth(env[f"{prefix}_USERNAME"], env[f"{prefix}_PASSWORD"])):
        return False
    try:
        urllib.request.urlopen(url, timeout=2).close()
        return False
    except urllib.error.HTTPError as exc:
        return exc.code == 401
    except OSError:
        return False


def _router_current(url: str) -> bool:
    """The router answers its route state in this code's form: one started by older code (whose
    nginx.conf lacks the shadow's mirror: a shadow would get no copies) is not reused, it is
    restarted on this code's config, its saved route kept."""
    try:
        with urllib.request.urlopen(f"{url}/router/state", timeout=2) as resp:
            return "shadow" in json.loads(resp.read())
    except (OSError, ValueError):
        return False


SERVERS = (
    Server("seaweedfs", _seaweedfs_command, dict, _s3_healthy, start_timeout_s=60, port="s3"),
    Server(
        "mlflow",
        _mlflow_command,
        _mlflow_env,
        lambda: _http_ok(f"{client_env()['MLFLOW_TRACKING_URI']}/health"),
        start_timeout_s=120,
        port="mlflow",
    ),
    Server("triton", _triton_command, _triton_env,
           lambda: _http_ok(f"{client_env()['TRITON_URL']}/v2/health/ready"), start_timeout_s=60, port="triton_http"),
    Server("openai-api", _openai_api_command, _openai_api_env,
           lambda: _http_ok(f"http://127.0.0.1:{ports()['openai_api']}/health"), start_timeout_s=30, port="openai_api"),
    Server("router", _router_command, dict, lambda: all(_router_current(client_env()[url])
                                                        for url in ("ROUTER_URL", "ROUTER_INTERNAL_URL")),
           start_timeout_s=20, port="router"),
    Server("pushgateway", _pushgateway_command, dict,
           lambda: _asks_for_login("pushgateway", "/-/ready"), start_timeout_s=20, port="pushgateway"),
    Server("prometheus", _prometheus_command, dict,
           lambda: _asks_for_login("prometheus", "/-/ready"), start_timeout_s=30, port="prometheus"),
)


ROUTE_READ_ERRORS = (OSError, ValueError, IndexError, KeyError)  # Triton not answering, a split.conf unreadable


def route_versions_ready(client: Any, serve: ServeSettings, routes: Path | None = None) -> tuple[list[int], bool]:
    """The versions the router's saved route (in ``routes``, the local router's folder by default)
    sends traffic to (stable, any canary), and whether Triton (``client``) has each of them READY
    in both models."""
    from tasks.serving.router import saved_route

    versions = saved_route(routes or router_dir()).versions()
    return versions, all(client.model_ready(model, version) for model in (serve.triton_model, serve.generate_model)
                         for version in versions)


def serving_client(triton_url: str | None = None) -> tuple[Any, ServeSettings]:
    """A client of the stack's Triton (or the one at ``triton_url``) and the ``serve`` settings."""
    from tasks.lib import triton

    return triton.TritonClient(triton_url or client_env()["TRITON_URL"]), load().serve


def reconcile_serving(env: Mapping[str, str] | None = None) -> list[int]:
    """Triton (explicit model control) starts with no model loaded: load what the router's saved
    route serves (stable and any canary) from the model repository, before the router starts
    taking traffic, so a restarted Triton serves the champion with no deploy. ``env``: where
    Triton (``TRITON_URL``), its repository (``TRITON_REPOSITORY``) and the router's folder
    (``ROUTER_DIR``) are: the local stack's by default, the container's in docker-compose.yaml
    (its ``serving-reconcile`` service). Returns the versions it had to load."""
    from tasks.lib.errors import StepError
    from tasks.serving.platforms import serve_versions

    env = env or client_env()
    routes = Path(env["ROUTER_DIR"])
    routes.mkdir(parents=True, exist_ok=True)
    with (routes / "deploy.lock").open("w") as lock:
        try:  # a deploy running now owns what Triton serves (it may be loading a canary)
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return []
        try:
            client, serve = serving_client(env["TRITON_URL"])
            versions, ready = route_versions_ready(client, serve, routes)
            if ready:
                return []
            serve_versions(client, Path(env["TRITON_REPOSITORY"]), serve, versions)
        except (StepError, *ROUTE_READ_ERRORS) as exc:
            raise StackError(f"serving: the route's versions could not be loaded ({exc})") from None
    return versions


def publish_saved_route(env: Mapping[str, str]) -> None:
    """The router's saved route, pushed again (a Pushgateway restarted without its persistence
    file, or with one older than the route, holds another route:
    without it the alert on versions Triton does not serve would see no route until a deploy)."""
    from tasks.serving.platforms import publish_route
    from tasks.serving.router import saved_route

    if env.get("PUSHGATEWAY_URL"):
        publish_route(saved_route(Path(env["ROUTER_DIR"])), env)


def up(with_airflow: bool = False) -> dict[str, str]:
    for server in SERVERS:
        if server.name == "router":
            try:
                reconcile_serving()
            except StackError as exc:  # the rest of the stack still comes up: a deploy repairs serving
                print(f"warning: {exc}; requests for them fail until a deploy", file=sys.stderr)
        server.start()
        if server.name == "seaweedfs":
            create_buckets()
        if server.name == "mlflow":
            ensure_mlflow_pipeline_user(client_env()["MLFLOW_TRACKING_URI"], _secret("mlflow_admin"),
                                        _secret("mlflow_pipeline"))
    env = write_env_file()
    publish_saved_route(env)
    if with_airflow:
        create_airflow_pools()
        for server in AIRFLOW_SERVERS:
            server.start()
    return env


def down() -> None:
    stop_servers(SERVERS + AIRFLOW_SERVERS)


def status() -> dict[str, bool]:
    running = [s for s in AIRFLOW_SERVERS if s.pid()]
    healthy = {server.name: bool(server.pid()) and server.healthy() for server in (*SERVERS, *running)}
    if healthy["triton"]:  # the route names only versions Triton has READY
        try:
            versions, ready = route_versions_ready(*serving_client())
            healthy[f"serving (route: versions {versions or 'none'})"] = ready
        except ROUTE_READ_ERRORS as exc:
            healthy[f"serving (route unreadable: {exc})"] = False
    return healthy
