"""Cluster policies: a backfill's tasks queue behind those of regular runs."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import airflow_local_settings as policies
import pytest
from helpers import REPO_ROOT, sync_dags_to_db


def test_only_backfill_weights_drop_and_a_second_call_changes_nothing() -> None:
    backfill = SimpleNamespace(run_id="backfill__2026-11-01T00:00:00+00:00", priority_weight=12)
    policies.task_instance_mutation_hook(backfill, SimpleNamespace(run_type="backfill"))
    lowered = backfill.priority_weight
    assert lowered < 0
    policies.task_instance_mutation_hook(backfill, SimpleNamespace(run_type="backfill"))
    assert backfill.priority_weight == lowered
    scheduled = SimpleNamespace(run_id="scheduled__2026-11-22T00:00:00+00:00", priority_weight=12)
    policies.task_instance_mutation_hook(scheduled, SimpleNamespace(run_type="scheduled"))
    assert scheduled.priority_weight == 12
    without_run = SimpleNamespace(run_id="backfill__2026-11-08T00:00:00+00:00", priority_weight=1)
    policies.task_instance_mutation_hook(without_run, None)  # a refresh that has no run at hand
    assert without_run.priority_weight < 0


@pytest.fixture
def backfill_run(airflow_db: None) -> Iterator[Any]:
    """A real backfill of one date, created as `airflow backfill create` does; removed afterwards
    (its queued run must not reach a later test's scheduler)."""
    from airflow.models.backfill import Backfill, BackfillDagRun, _create_backfill
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import delete, select, update

    sync_dags_to_db()
    day = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)
    # A backfill skips a date that already has a run, and by now the DAG tests have run every
    # Sunday from the start date on (11-01 by test_trigger_paths): remove that finished run, and
    # close the backfill a stopped scheduler left open (Airflow allows one at a time per DAG).
    with create_session() as session:
        earlier = select(DagRun.id).where(DagRun.dag_id == "llm_retrain", DagRun.logical_date == day)
        session.execute(delete(BackfillDagRun).where(BackfillDagRun.dag_run_id.in_(earlier)))
        session.execute(delete(DagRun).where(DagRun.dag_id == "llm_retrain", DagRun.logical_date == day))
        session.execute(update(Backfill).where(Backfill.dag_id == "llm_retrain", Backfill.completed_at.is_(None))
                        .values(completed_at=dt.datetime.now(dt.UTC)))
    backfill = _create_backfill(dag_id="llm_retrain", from_date=day, to_date=day, max_active_runs=1, reverse=False,
                                dag_run_conf={}, triggering_user_name="test")
    try:
        with create_session() as session:
            run = session.scalars(select(DagRun).where(DagRun.backfill_id == backfill.id)).one()
            yield [(ti.task_id, ti.priority_weight) for ti in run.get_task_instances(session=session)]
    finally:
        with create_session() as session:
            session.execute(delete(BackfillDagRun).where(BackfillDagRun.backfill_id == backfill.id))
            session.execute(delete(DagRun).where(DagRun.backfill_id == backfill.id))
            session.execute(delete(Backfill).where(Backfill.id == backfill.id))


def test_a_backfill_run_is_created_below_every_regular_task(backfill_run: list[tuple[str, int]]) -> None:
    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=str(REPO_ROOT / "dags")).dags["llm_retrain"]
    weights = dict(backfill_run)
    assert set(weights) == set(dag.task_ids)
    assert all(weight is not None and weight < 0 for weight in weights.values()), weights
    regular = {task_id: weight + policies.BACKFILL_PRIORITY_OFFSET for task_id, weight in weights.items()}
    assert min(regular.values()) >= 1  # what a regular run's tasks weigh: all above any backfill task
    assert regular["train"] > regular["report"]  # and the backfill keeps its own order
