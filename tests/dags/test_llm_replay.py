"""The replay DAG: its wiring, a version the suite trained rebuilt bit for bit through the real
launcher (torchrun, 2 nodes), S3, the DVC registry and MLflow, and the refusal when an input is gone."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
from helpers import REPO_ROOT, RUNTIME_PY, mlflow_rest, ti_states, xcom

from tasks.contract import ERROR_XCOM_KEY

MODEL = "llm-retrain"




def versions() -> dict[str, dict[str, str]]:
    found = mlflow_rest(f"/api/2.0/mlflow/model-versions/search?filter=name%3D%27{MODEL}%27&max_results=1000")
    return {v["version"]: {t["key"]: t["value"] for t in v.get("tags", [])} for v in found.get("model_versions", [])}


def test_the_replay_reads_each_input_from_the_plan(dags: dict[str, Any]) -> None:
    replay = dags["llm_replay"]
    assert replay.schedule is None and replay.params["version"] == 1
    upstream = {t.task_id: sorted(t.upstream_task_ids) for t in replay.tasks}
    assert upstream == {
        "replay_plan": [], "snapshot": ["replay_plan"], "shard_plan": ["replay_plan", "snapshot"],
        "tokenize_shard": ["shard_plan"], "tokenize_merge": ["replay_plan", "snapshot", "tokenize_shard"],
        "train": ["replay_plan", "tokenize_merge"], "replay_compare": ["train"]}
    train = replay.get_task("train")
    assert "--settings" in train.arguments and train.nodes == "{{ ti.xcom_pull(task_ids='replay_plan')['nodes'] }}"
    assert train.pool == "training" and all(t.execution_timeout for t in replay.tasks if t.task_id != "shard_plan")


@pytest.fixture(scope="module")
def trained_version(retrain_run: Any) -> tuple[str, dict[str, str]]:
    """The version the suite's end-to-end retrain registered (tests/dags/conftest.py), its tags."""
    version = str(xcom(retrain_run, "register")["version"])
    return version, versions()[version]


@pytest.mark.integration
def test_a_registered_version_is_rebuilt_bit_for_bit(dags: dict[str, Any], trained_version: tuple[str, dict[str, str]]) -> None:
    version, tags = trained_version
    before = versions()
    aliases = mlflow_rest(f"/api/2.0/mlflow/registered-models/get?name={MODEL}")["registered_model"].get("aliases")
    run = dags["llm_replay"].test(run_conf={"version": int(version)})
    states = ti_states(run)
    assert run.state == "success", states
    # the same data version, tokenizer and layout as the registered run
    assert xcom(run, "snapshot")["data_version"]["tag"] == tags["data_version"]
    assert xcom(run, "tokenize_merge")["tokenizer_hash"] == tags["tokenizer_hash"]
    trained = xcom(run, "train")
    assert trained["world_size"] == int(tags["train.world_size"]) and trained["initialized_from"] is None
    compared = xcom(run, "replay_compare")
    assert compared["identical"] is True and compared["tensors"] > 10 and compared["differences"] == [], compared
    # it registered nothing and moved no alias
    assert versions().keys() == before.keys()
    assert mlflow_rest(f"/api/2.0/mlflow/registered-models/get?name={MODEL}")["registered_model"].get("aliases") == aliases
    shown = subprocess.run([str(RUNTIME_PY), "-m", "tasks.replay", "show", "--model-version", version], cwd=REPO_ROOT,
                           capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert shown.stdout.startswith(f"REPRODUCED: models:/{MODEL}/{version} retrained from its lineage is identical, "
                                   f"{compared['tensors']} of {compared['tensors']} tensors bit for bit"), shown.stdout


def s3(code: str, uri: str, stdin: bytes = b"") -> bytes:
    """Run ``code`` on the object ``uri`` with the runtime's S3 client (``client``, ``bucket``,
    ``key``, ``data``: stdin); its stdout."""
    prelude = ("import sys; from tasks.lib import storage; client = storage.s3_client(); "
               "bucket, key = storage.split_s3(sys.argv[1]); data = sys.stdin.buffer.read(); ")
    return subprocess.run([str(RUNTIME_PY), "-c", prelude + code, uri], input=stdin, cwd=REPO_ROOT,
                          capture_output=True, check=True).stdout


@pytest.mark.integration
def test_a_replay_whose_tokenizer_is_gone_is_refused_up_front(dags: dict[str, Any],
                                                             trained_version: tuple[str, dict[str, str]]) -> None:
    version, tags = trained_version
    tokenizer = tags["tokenizer_uri"]
    kept = s3("sys.stdout.buffer.write(client.get_object(Bucket=bucket, Key=key)['Body'].read())", tokenizer)
    s3("client.delete_object(Bucket=bucket, Key=key)", tokenizer)
    try:
        run = dags["llm_replay"].test(run_conf={"version": int(version)})
    finally:  # content-addressed: other runs of the suite read it
        s3("client.put_object(Bucket=bucket, Key=key, Body=data)", tokenizer, stdin=kept)
    states = ti_states(run)
    assert run.state == "failed" and states["replay_plan"] == "failed", states
    assert {state for task, state in states.items() if task != "replay_plan"} == {"upstream_failed"}, states
    assert xcom(run, "replay_plan", ERROR_XCOM_KEY) == (
        f"ERROR python -m tasks.replay: models:/{MODEL}/{version}: its tokenizer {tokenizer} is gone "
        f"(content hash {tags['tokenizer_hash'][:12]})")
