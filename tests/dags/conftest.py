"""The DAGs' session fixtures: one end-to-end retrain run the modules share (its champion serves
the drift check's traffic; its registered version is replayed), whichever module asks first."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from helpers import REPO_ROOT, SEED_URI


@pytest.fixture(scope="session")
def dags() -> dict[str, Any]:
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO_ROOT / "dags"))
    assert bag.import_errors == {}
    return dict(bag.dags)


@pytest.fixture(scope="session")
def retrain_run(dags: dict[str, Any], airflow_db: None, seeded_raw: str) -> Any:
    """The retrain DAG run end to end (tests/dags/test_llm_retrain.py checks it): registered,
    exported, canaried and promoted, so its version serves as champion."""
    return dags["llm_retrain"].test(  # 06:00, off the weekly ticks: test_trigger_paths backfills the Sundays at midnight
        logical_date=dt.datetime(2026, 11, 22, 6, tzinfo=dt.UTC),
        # one traffic step after the shadow (tests/tasks/test_serving.py walks 10 -> 50 -> 100)
        run_conf={"raw_data_uri": SEED_URI, "num_shards": 2, "train_max_steps": 60, "canary_steps": [100]},
    )
