"""The data-aware schedule: the ingest DAG lands a raw partition and updates the raw data
Asset; the retrain DAG runs on that Asset or its weekly cron (AssetOrTimeSchedule)."""

from __future__ import annotations

import datetime as dt
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import REPO_ROOT, RUNTIME_PY, SEED_DOCUMENTS, sync_dags_to_db


@pytest.fixture(scope="module")
def dags() -> dict[str, Any]:
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO_ROOT / "dags"))
    assert bag.import_errors == {}
    return bag.dags


def test_retrain_runs_on_the_asset_the_ingest_task_updates_or_weekly(dags: dict[str, Any]) -> None:
    from airflow.sdk import AssetOrTimeSchedule, CronTriggerTimetable

    retrain, ingest = dags["llm_retrain"], dags["llm_ingest"]
    schedule = retrain.timetable
    assert isinstance(schedule, AssetOrTimeSchedule) and isinstance(schedule.timetable, CronTriggerTimetable)
    assert schedule.timetable.expression == "0 0 * * 0"  # params.yaml "@weekly"
    consumed = {(a.name, a.uri) for a in schedule.asset_condition.objects}
    produced = {(a.name, a.uri) for a in ingest.get_task("ingest").outlets}
    assert consumed == produced == {("raw_text", "s3://raw/text")}
    assert ingest.get_task("ingest").module == "tasks.seed"
    # the drift check runs daily and on each capture partition the ingest DAG closes, and updates
    # the raw data Asset on drift
    drift = dags["llm_drift"]
    assert isinstance(drift.timetable, AssetOrTimeSchedule) and drift.timetable.timetable.expression == "0 0 * * *"
    assert {(a.name, a.uri) for a in drift.timetable.asset_condition.objects} == {
        (a.name, a.uri) for a in ingest.get_task("close_served").outlets} == {("served_traffic", "s3://raw/served")}
    assert {(a.name, a.uri) for a in drift.get_task("request_retrain").outlets} == {("raw_text", "s3://raw/text")}


@pytest.fixture
def retrain_unpaused(dags: dict[str, Any], airflow_db: None) -> Iterator[None]:
    """Both DAGs in the database and llm_retrain unpaused (a paused DAG gets no asset-triggered
    runs); paused again and its queue emptied afterwards, so no later test's scheduler runs it."""
    from airflow.models.asset import AssetDagRunQueue
    from airflow.models.dag import DagModel
    from airflow.utils.session import create_session
    from sqlalchemy import delete, update

    def pause(paused: bool) -> None:
        with create_session() as session:
            session.execute(update(DagModel).where(DagModel.dag_id == "llm_retrain").values(is_paused=paused))
            session.execute(delete(AssetDagRunQueue).where(AssetDagRunQueue.target_dag_id == "llm_retrain"))

    sync_dags_to_db()
    pause(False)
    try:
        yield
    finally:
        pause(True)


@pytest.mark.integration
def test_landing_a_partition_queues_a_retrain(dags: dict[str, Any], stack_env: dict[str, str], retrain_unpaused: None,
                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.models.asset import AssetDagRunQueue, AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["seed"]["max_documents"] = SEED_DOCUMENTS  # small days
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    monkeypatch.setenv("PIPELINE_PARAMS", str(tmp_path / "params.yaml"))
    # the day's captured traffic: one part the OpenAI API wrote
    part = "s3://raw/served/date=2026-11-22/part-test-1.jsonl"
    write = subprocess.run([str(RUNTIME_PY), "-c", "import sys; from tasks.lib import storage; "
                            "storage.write_bytes(sys.argv[1], b'{}\\n{}\\n')", part], cwd=REPO_ROOT, capture_output=True, text=True)
    assert write.returncode == 0, write.stderr[-2000:]
    run = dags["llm_ingest"].test(logical_date=dt.datetime(2026, 11, 23, tzinfo=dt.UTC))
    assert run.state == "success"
    landed = next(ti for ti in run.get_task_instances() if ti.task_id == "ingest").xcom_pull(task_ids="ingest")
    closed = next(ti for ti in run.get_task_instances() if ti.task_id == "close_served").xcom_pull(task_ids="close_served")
    assert closed == {"partition": "s3://raw/served/date=2026-11-22", "parts": 1, "records": 2}
    assert landed["output_uri"] == "s3://raw/text" and landed["days"][-1] == "2026-11-22"  # the day that ended
    with create_session() as session:
        events = session.execute(
            select(AssetEvent.source_run_id).join(AssetModel, AssetEvent.asset_id == AssetModel.id)
            .where(AssetModel.uri == "s3://raw/text", AssetEvent.source_dag_id == "llm_ingest")).scalars().all()
        queued = session.execute(select(AssetDagRunQueue.target_dag_id)).scalars().all()
    assert events == [run.run_id]
    with create_session() as session:  # the served traffic's partition, closed: the drift check's event
        served = session.execute(
            select(AssetEvent.source_run_id).join(AssetModel, AssetEvent.asset_id == AssetModel.id)
            .where(AssetModel.uri == "s3://raw/served")).scalars().all()
    assert served == [run.run_id]
    assert queued == ["llm_retrain"]  # what the scheduler turns into an asset-triggered run
