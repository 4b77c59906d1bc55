"""The local stack: real SeaweedFS, MLflow, Triton, nginx, Pushgateway and Prometheus servers, started once per
session."""

from __future__ import annotations

import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers import run_module

from tasks.lib import metrics, storage

pytestmark = pytest.mark.integration


def pids(stack_dir: str) -> dict[str, str]:
    return {p.stem: p.read_text() for p in Path(stack_dir).glob("*.pid")}


def test_up_is_idempotent_and_reuses_healthy_servers(stack_env: dict[str, str]) -> None:
    before = pids(stack_env["STACK_DIR"])
    assert set(before) == {"seaweedfs", "mlflow", "triton", "openai-api", "router", "pushgateway", "prometheus"}
    proc = run_module("stack", "up")
    assert proc.returncode == 0, proc.stderr
    assert pids(stack_env["STACK_DIR"]) == before
    status = run_module("stack", "status")
    assert status.returncode == 0 and status.stdout.count("healthy") == 8  # 7 servers and serving (the route's versions)
    assert "serving (routes: demo versions " in status.stdout


def test_up_refuses_a_port_another_stack_holds(stack_env: dict[str, str], tmp_path: Path) -> None:
    """A second stack folder on the same ports stops at the first server with one line: its
    health checks would have passed against the other stack's servers (Triton, nginx, ...),
    whose repository and routes are not its own (a deploy then failed to load its model)."""
    other = tmp_path / "other-stack"
    proc = run_module("stack", "up", env={"STACK_DIR": str(other)})
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"error: seaweedfs: port {stack_env['AWS_ENDPOINT_URL'].rsplit(':', 1)[1]} is held by a process this stack "
        f"({other}) did not start: stop it, or give this stack other ports (STACK_PORT_S3)"]
    assert not list(other.glob("*.pid"))
    assert run_module("stack", "status").returncode == 0  # the session's stack untouched


def test_generated_credentials_are_required(stack_env: dict[str, str]) -> None:
    import boto3
    from botocore.exceptions import ClientError

    stranger = boto3.client(
        "s3", endpoint_url=stack_env["AWS_ENDPOINT_URL"], aws_access_key_id="nobody",
        aws_secret_access_key="wrong-secret", region_name="us-east-1",
    )
    with pytest.raises(ClientError):
        stranger.list_objects_v2(Bucket="pipeline")
    assert {"pipeline", "raw", "dvc", "mlflow"} <= {
        b["Name"] for b in storage.s3_client().list_buckets()["Buckets"]
    }


def test_s3_round_trip(stack_env: dict[str, str]) -> None:
    client = storage.s3_client()
    client.put_object(Bucket="pipeline", Key="tests/roundtrip.bin", Body=os.urandom(1 << 16))
    body = client.get_object(Bucket="pipeline", Key="tests/roundtrip.bin")["Body"].read()
    assert len(body) == 1 << 16
    client.delete_object(Bucket="pipeline", Key="tests/roundtrip.bin")


def test_mlflow_logs_a_run_with_its_artifact_on_s3(stack_env: dict[str, str], tmp_path: Path) -> None:
    import mlflow

    mlflow.set_tracking_uri(stack_env["MLFLOW_TRACKING_URI"])
    mlflow.set_experiment("stack-test")
    report = tmp_path / "report.txt"
    report.write_text("loss went down")
    with mlflow.start_run() as run:
        mlflow.log_param("lr", 0.001)
        mlflow.log_metric("loss", 1.5, step=1)
        mlflow.log_artifact(str(report))
    fetched = mlflow.get_run(run.info.run_id)
    assert fetched.data.metrics["loss"] == 1.5 and fetched.info.status == "FINISHED"
    # artifacts are proxied by the server into the S3 bucket
    keys = storage.list_files("s3://mlflow/artifacts")
    assert any(k.endswith(f"{run.info.run_id}/artifacts/report.txt") for k in keys)
    local = mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="report.txt",
                                                dst_path=str(tmp_path / "dl"))
    assert Path(local).read_text() == "loss went down"


def test_mlflow_asks_for_a_login_and_the_pipeline_writes_only_what_it_manages(
        stack_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow's basic-auth app: no login or a wrong password is a 401 (nothing registered, no
    alias moved); the pipeline's user reads everything, writes what it created (its experiments
    and models), and gets a 403 on a model someone else (the admin) created."""
    import json

    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from stack.credentials import MLFLOW_ADMIN, secret

    uri = stack_env["MLFLOW_TRACKING_URI"]

    def status(path: str, login: tuple[str, str] | None, body: dict[str, str] | None = None) -> int:
        headers = {"Content-Type": "application/json"}
        if login:
            headers.update(metrics.basic_auth(*login))
        request = urllib.request.Request(uri + path, data=json.dumps(body).encode() if body else None, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    pipeline = (stack_env["MLFLOW_TRACKING_USERNAME"], stack_env["MLFLOW_TRACKING_PASSWORD"])
    assert status("/api/2.0/mlflow/experiments/search?max_results=1", None) == 401
    assert status("/api/2.0/mlflow/experiments/search?max_results=1", (pipeline[0], "wrong")) == 401
    assert status("/api/2.0/mlflow/registered-models/create", None, {"name": "anonymous-model"}) == 401
    assert status("/api/2.0/mlflow/experiments/search?max_results=1", pipeline) == 200
    assert status("/health", None) == 200  # health checks need no login

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", MLFLOW_ADMIN)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", secret("mlflow_admin"))
    MlflowClient(uri).create_registered_model("admins-model")
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", pipeline[0])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", pipeline[1])
    client = MlflowClient(uri)
    assert client.get_registered_model("admins-model").name == "admins-model"  # reads it
    with pytest.raises(MlflowException, match="403"):
        client.create_model_version("admins-model", "s3://mlflow/x")
    client.create_registered_model("pipelines-model")  # its own: it manages it
    version = client.create_model_version("pipelines-model", "s3://mlflow/x").version
    client.set_registered_model_alias("pipelines-model", "champion", version)
    assert client.get_model_version_by_alias("pipelines-model", "champion").version == version


def test_secret_files_are_private_from_creation(stack_env: dict[str, str], tmp_path: Path) -> None:
    from stack.state import write_private

    old = os.umask(0)  # the most permissive umask: the mode must come from the create call itself
    try:
        write_private(tmp_path / "secret.json", "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "secret.json").stat().st_mode & 0o777 == 0o600
    stack_dir = Path(stack_env["STACK_DIR"])
    for name in ("credentials.json", "secrets.json", "stack.env", "seaweedfs/s3.json"):
        if (stack_dir / name).exists():
            assert (stack_dir / name).stat().st_mode & 0o777 == 0o600, name


def test_stop_servers_ends_every_group_and_reaps_its_own_children(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """One server obeys SIGTERM, the other ignores it (killed after the grace period); both were
    started by this process, whose exited leaders must be reaped rather than waited on as
    zombies (which made every Airflow component use its whole grace period)."""
    import sys
    import time

    from stack.supervise import Server, stop_servers

    monkeypatch.setenv("STACK_DIR", str(tmp_path))
    ready = tmp_path / "ignoring"
    obeys = "import time; time.sleep(120)"
    ignores = ("import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
               "pathlib.Path(sys.argv[1]).touch(); time.sleep(120)")
    started = []
    for name, code in (("obeys", obeys), ("ignores", ignores)):
        server = Server(name, lambda code=code: [sys.executable, "-c", code, str(ready)], dict, lambda: True, 5)
        proc = subprocess.Popen(server.command(), start_new_session=True)
        server.pid_file.write_text(str(proc.pid))
        started.append((server, proc))
    while not ready.exists():  # SIGTERM must find the handler installed
        time.sleep(0.05)
    stop_servers([server for server, _ in started])
    for server, proc in started:
        assert not server.pid_file.exists()
        with pytest.raises(ProcessLookupError):
            os.killpg(proc.pid, 0)


def replaced_by_up(name: str, command: list[str], answering: str) -> subprocess.Popen[bytes]:
    """The stack's server ``name`` stopped and ``command`` (as older code started it) put in its
    place, answering ``answering``; then `stack up`, which must stop it, not reuse it."""
    from stack.servers import SERVERS

    server = next(server for server in SERVERS if server.name == name)
    server.stop()
    old = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    threading.Thread(target=old.wait, daemon=True).start()  # reaped once stopped: up sees it gone at once
    server.pid_file.write_text(str(old.pid))
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(answering, timeout=2).close()
                break
            except OSError:
                time.sleep(0.1)
        proc = run_module("stack", "up")
        assert proc.returncode == 0, proc.stderr
        assert old.wait(timeout=15) is not None  # stopped, not reused
    except BaseException:
        old.kill()
        raise
    return old


def test_a_pushgateway_started_without_a_login_is_replaced_by_up(stack_env: dict[str, str]) -> None:
    """A Pushgateway started by older code (no login asked) answers the login's health check too:
    `up` must not reuse it, or anonymous pushes would go on being taken."""

    from stack.supervise import debian_bin

    url = stack_env["PUSHGATEWAY_URL"]
    old = replaced_by_up("pushgateway", [debian_bin("prometheus-pushgateway"),
                                         f"--web.listen-address={url.split('//')[1]}",
                                         "--persistence.file="],  # memory only: not the machine's shared file
                         f"{url}/-/ready")  # listening, anonymous reads answered
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{url}/-/ready", timeout=5)
        assert refused.value.code == 401
        assert pids(stack_env["STACK_DIR"])["pushgateway"] != str(old.pid)
    finally:
        if old.poll() is None:
            old.kill()


def test_the_pushgateway_keeps_runs_across_a_restart_in_the_stacks_own_folder(stack_env: dict[str, str]) -> None:
    """A run's figures survive the Pushgateway's restart (the alert on no successful retrain reads
    them), in this stack's folder: Debian's default file is shared by every stack on the machine."""
    import json

    from stack.servers import SERVERS

    run_id = f"manual__{time.time_ns()}"
    assert metrics.push({"dag_id": "llm_retrain", "run_id": run_id}, {"llm_pipeline_run_success": 1.0}, {})
    gateway = next(server for server in SERVERS if server.name == "pushgateway")
    gateway.stop()  # SIGTERM: it writes its persistence file on the way out
    persisted = Path(stack_env["STACK_DIR"]) / "pushgateway" / "metrics.data"
    assert persisted.exists() and run_id.encode() in persisted.read_bytes()
    proc = run_module("stack", "up")
    assert proc.returncode == 0, proc.stderr
    request = urllib.request.Request(f"{stack_env['PUSHGATEWAY_URL']}/api/v1/metrics",
                                     headers=metrics.basic_auth(stack_env["PUSHGATEWAY_USERNAME"],
                                                        stack_env["PUSHGATEWAY_PASSWORD"]))
    with urllib.request.urlopen(request, timeout=10) as resp:
        groups = [group["labels"] for group in json.loads(resp.read())["data"]]
    assert {"dag_id": "llm_retrain", "job": "llm_pipeline", "run_id": run_id} in groups


def test_the_steps_get_no_prometheus_login(stack_env: dict[str, str]) -> None:
    """stack.env (what `make pipeline` gives Airflow and its steps) and Airflow's own environment
    hold the Pushgateway's login but not Prometheus' (people's: `python -m stack env`)."""
    from stack.airflow_servers import airflow_env
    from stack.credentials import PEOPLE_ONLY

    steps = dict(line.split("=", 1) for line in (Path(stack_env["STACK_DIR"]) / "stack.env").read_text().splitlines())
    assert "PUSHGATEWAY_PASSWORD" in steps and not PEOPLE_ONLY & set(steps)
    assert "PUSHGATEWAY_PASSWORD" in airflow_env() and not PEOPLE_ONLY & set(airflow_env())
    printed = run_module("stack", "env").stdout
    assert all(f"export {key}=" in printed for key in PEOPLE_ONLY)


def test_a_router_started_by_older_code_is_replaced_by_up(stack_env: dict[str, str], tmp_path: Path) -> None:
    """A router whose config predates the shadow (its route state has no ``shadow``: its /v1
    would mirror nothing, and a shadow stage would judge no copies), or one line's state alone
    (before one API served every line), is restarted on this code's config by `up`, the saved
    route kept."""
    import json

    from tasks.serving.router import nginx_binary

    old_state = {"stable": None, "canary": None, "canary_weight": 0.0, "generation": 0}
    listeners = "\n".join(
        f"server {{ listen {stack_env[url].split('//')[1]}; location = /router/state "
        f"{{ default_type application/json; return 200 '{json.dumps(old_state)}'; }} }}"
        for url in ("ROUTER_URL", "ROUTER_INTERNAL_URL"))
    (tmp_path / "nginx.conf").write_text(
        f"daemon off; pid {tmp_path / 'nginx.pid'}; error_log {tmp_path / 'error.log'};\n"
        f"events {{}}\nhttp {{ access_log off; {listeners} }}\n")
    old = replaced_by_up("router", [nginx_binary(), "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")],
                         f"{stack_env['ROUTER_URL']}/router/state")
    try:
        with urllib.request.urlopen(f"{stack_env['ROUTER_URL']}/router/state", timeout=5) as resp:
            assert "shadow" in json.loads(resp.read())["demo"]
    finally:
        if old.poll() is None:
            old.kill()


def process_environ(stack_dir: str, server: str) -> dict[str, str]:
    """The environment a running server of the stack was started with."""
    raw = Path(f"/proc/{pids(stack_dir)[server]}/environ").read_bytes().decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def test_the_openai_front_holds_a_key_that_writes_the_capture_only(stack_env: dict[str, str]) -> None:
    """The front is the process clients reach: it holds the capture's key alone (not the
    pipeline's, which the process that ran `stack up` held), and SeaweedFS lets that key write
    under serve.capture.uri and nothing else: not the exports Triton runs, not the raw training
    data beside the capture, and it reads nothing back."""
    import boto3
    from botocore.exceptions import ClientError

    from stack.credentials import capture_credentials, credentials
    from tasks.config import load

    front, pipeline = process_environ(stack_env["STACK_DIR"], "openai-api"), credentials()
    assert front["AWS_ACCESS_KEY_ID"] == capture_credentials()["access_key"]
    assert front["AWS_ENDPOINT_URL"] == stack_env["AWS_ENDPOINT_URL"]
    assert not {pipeline["access_key"], pipeline["secret_key"], stack_env["MLFLOW_TRACKING_PASSWORD"],
                stack_env["PUSHGATEWAY_PASSWORD"]} & set(front.values())
    # SeaweedFS would adopt AWS keys in its environment as one more admin identity
    assert not [key for key in process_environ(stack_env["STACK_DIR"], "seaweedfs") if key.startswith("AWS_")]

    capture = boto3.client("s3", endpoint_url=front["AWS_ENDPOINT_URL"], aws_access_key_id=front["AWS_ACCESS_KEY_ID"],
                           aws_secret_access_key=front["AWS_SECRET_ACCESS_KEY"], region_name=front["AWS_DEFAULT_REGION"])
    bucket, prefix = storage.split_s3(load().serve.capture.uri)
    written = f"{prefix}/date=1999-01-01/part-credentials-test.jsonl"  # a day no drift check reads
    capture.put_object(Bucket=bucket, Key=written, Body=b"{}\n")
    try:
        refused = [("put_object", {"Bucket": "pipeline", "Key": "runs/x/export/triton/llm_generate/1/model.py"}),
                   ("put_object", {"Bucket": bucket, "Key": "text/date=1999-01-01/part.jsonl"}),
                   ("put_object", {"Bucket": bucket, "Key": f"{prefix}-beside/x.jsonl"}),
                   ("get_object", {"Bucket": bucket, "Key": written}),
                   ("list_objects_v2", {"Bucket": bucket, "Prefix": prefix}),
                   ("delete_object", {"Bucket": "pipeline", "Key": "runs/x"})]
        for operation, kwargs in refused:
            with pytest.raises(ClientError) as denied:
                getattr(capture, operation)(**({"Body": b"x"} if operation == "put_object" else {}), **kwargs)
            assert denied.value.response["Error"]["Code"] == "AccessDenied", (operation, kwargs)
        assert storage.read_bytes(f"s3://{bucket}/{written}") == b"{}\n"
    finally:
        storage.s3_client().delete_object(Bucket=bucket, Key=written)


def test_a_seaweedfs_started_without_the_capture_identity_is_replaced_by_up(stack_env: dict[str, str],
                                                                              tmp_path: Path) -> None:
    """SeaweedFS reads its identities when it starts: one started on an older s3.json (the
    pipeline's identity alone) would refuse every capture the front writes. `up` restarts it on
    this code's identities."""
    import json

    import boto3

    from stack.credentials import capture_env, credentials
    from stack.seaweedfs import seaweedfs_command

    keys = credentials()
    older = tmp_path / "s3.json"
    older.write_text(json.dumps({"identities": [{
        "name": "pipeline", "credentials": [{"accessKey": keys["access_key"], "secretKey": keys["secret_key"]}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    command = [f"-s3.config={older}" if arg.startswith("-s3.config=") else arg for arg in seaweedfs_command()]
    old = replaced_by_up("seaweedfs", command, f"{stack_env['AWS_ENDPOINT_URL']}/healthz")
    try:
        assert pids(stack_env["STACK_DIR"])["seaweedfs"] != str(old.pid)
        env = capture_env()
        capture = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                               aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_DEFAULT_REGION"])
        capture.list_buckets()  # known: InvalidAccessKeyId from the older server
    finally:
        if old.poll() is None:
            old.kill()
