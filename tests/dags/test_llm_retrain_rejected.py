"""A challenger the gate rejects, through the retrain DAG: a module apart from test_llm_retrain's,
so make test's second xdist process runs it beside the shared end-to-end run
(tests/helpers.py SHARED_RUN_MODULES)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from helpers import SEED_URI, ti_states, xcom


@pytest.mark.integration
def test_rejected_challenger_ends_the_run_cleanly(dags: dict[str, Any], airflow_db: None, seeded_raw: str) -> None:
    """A gate that says no (the trigger form's threshold): evaluate and register are skipped,
    the run itself succeeds."""
    run = dags["llm_retrain"].test(
        logical_date=dt.datetime(2026, 11, 15, 6, tzinfo=dt.UTC),
        run_conf={"raw_data_uri": SEED_URI, "train_max_steps": 10, "max_eval_perplexity": 1.5},
    )
    states = ti_states(run)
    assert run.state == "success", states
    assert states["train"] == "success" and states["evaluate"] == "skipped" and states["register"] == "skipped"
    assert states["export"] == "skipped" and states["deploy"] == "skipped"
    verdict = xcom(run, "evaluate")
    assert verdict["passed"] is False and "> max 1.5" in verdict["reasons"][0]
    assert states["report"] == "success" and xcom(run, "report")["verdict"] == "rejected"
