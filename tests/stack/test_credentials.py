"""Which S3 keys each process of the local stack holds, checked without starting it: the OpenAI
front (the process clients reach) gets the capture's keys alone, whatever the environment of
whoever runs `stack up`; SeaweedFS's identities scope those keys to the capture's prefix. The
real servers are checked in test_stack.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from stack.airflow_servers import AIRFLOW_SERVERS
from stack.credentials import capture_credentials, client_env, credentials, steps_env
from stack.seaweedfs import capture_actions, s3_identities
from stack.servers import SERVERS
from stack.supervise import Server


@pytest.fixture
def stack_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("STACK_DIR", str(tmp_path))
    return tmp_path


def server(name: str) -> Server:
    return next(s for s in (*SERVERS, *AIRFLOW_SERVERS) if s.name == name)


def test_the_front_holds_the_capture_keys_alone_whatever_the_starter_holds(
        stack_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shell that sourced stack.env (or the tests' environment) holds the pipeline's keys and
    logins: the front's process gets none of them, only the capture's keys and the endpoint."""
    pipeline, capture = credentials(), capture_credentials()
    starter = {**steps_env(), "AWS_SESSION_TOKEN": "a-developers-token", "AWS_PROFILE": "prod",
               "AIRFLOW__API_AUTH__JWT_SECRET": "jwt", "LANG": "C.UTF-8", "TOKENIZERS_PARALLELISM": "true"}
    for key, value in starter.items():
        monkeypatch.setenv(key, value)
    front = server("openai-api").process_env()
    assert {k: front[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL")} == {
        "AWS_ACCESS_KEY_ID": capture["access_key"], "AWS_SECRET_ACCESS_KEY": capture["secret_key"],
        "AWS_ENDPOINT_URL": client_env()["AWS_ENDPOINT_URL"]}
    held = set(front.values())
    assert not held & {pipeline["access_key"], pipeline["secret_key"], starter["MLFLOW_TRACKING_PASSWORD"],
                       starter["PUSHGATEWAY_PASSWORD"], "a-developers-token", "jwt"}
    assert not {"AWS_PROFILE", "MLFLOW_TRACKING_URI", "ROUTER_INTERNAL_URL"} & set(front)
    assert front["LANG"] == "C.UTF-8" and front["TOKENIZERS_PARALLELISM"] == "true"  # the rest is kept
    # SeaweedFS would adopt a starter's AWS keys as one more admin identity: it gets none
    assert not [k for k in server("seaweedfs").process_env() if k.startswith("AWS_")]
    # MLflow's artifacts proxy holds the pipeline's keys, as its own env() gives them
    (stack_dir / "mlflow").mkdir()  # (its command makes the folder its env() writes to)
    assert server("mlflow").process_env()["AWS_ACCESS_KEY_ID"] == pipeline["access_key"]
    # Airflow's components run the steps: they keep the starter's settings and get the steps' keys
    scheduler = server("airflow-scheduler").process_env()
    assert scheduler["AIRFLOW__API_AUTH__JWT_SECRET"] != "jwt"  # the stack's own (every component alike)
    assert scheduler["AWS_ACCESS_KEY_ID"] == pipeline["access_key"] and scheduler["AWS_PROFILE"] == "prod"


def test_the_capture_identity_may_write_under_the_capture_prefix_only(stack_dir: Path) -> None:
    pipeline, capture = credentials(), capture_credentials()
    assert capture["access_key"] != pipeline["access_key"] and capture["access_key"].startswith("capture")
    assert capture_credentials() == capture  # generated once per stack folder
    config = s3_identities(pipeline, capture, "s3://raw/served")
    identities = {i["name"]: i for i in config["identities"]}
    assert identities["capture"]["actions"] == ["Write:raw/served/*"]
    assert identities["capture"]["credentials"] == [{"accessKey": capture["access_key"],
                                                     "secretKey": capture["secret_key"]}]
    assert "Admin" in identities["pipeline"]["actions"]
    assert capture_actions("s3://raw/") == ["Write:raw/*"]
    assert capture_actions("s3://raw/served/x/") == ["Write:raw/served/x/*"]  # the boundary is the '/'
    assert capture_actions("/var/capture") == []  # not on S3: the key can do nothing
    with pytest.raises(ValueError, match="the pipeline's: give the OpenAI front its own"):
        s3_identities(pipeline, {**capture, "access_key": pipeline["access_key"]}, "s3://raw/served")
