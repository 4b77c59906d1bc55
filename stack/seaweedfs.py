"""SeaweedFS, the stack's S3: its identities (the pipeline's keys, the capture's write-only ones),
its command, its health, the buckets."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stack.credentials import capture_credentials, capture_env, client_env, credentials
from stack.state import ports, state_dir, write_private
from stack.supervise import bin_path, http_ok
from tasks.config import load

BUCKETS = ("pipeline", "raw", "dvc", "mlflow")


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


def seaweedfs_command() -> list[str]:
    port = ports()
    root = state_dir() / "seaweedfs"
    (root / "data").mkdir(parents=True, exist_ok=True)
    (root / "logs").mkdir(parents=True, exist_ok=True)
    return [
        bin_path("weed"),
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


def s3_healthy() -> bool:
    # SeaweedFS answers its health path without credentials once the S3 gateway is serving; it
    # reads its identities at start only: one started on an older s3.json (no capture identity)
    # is restarted, or the front's captures would all be refused
    return (http_ok(f"http://127.0.0.1:{ports()['s3']}/healthz") and _buckets_reachable()
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
