"""Roll serving back by hand: the target version (default: the ``previous`` champion) gets all
traffic through the router and becomes ``champion``; the version it replaces is unloaded.

Triggered from the UI (Params form) or ``airflow dags trigger llm_rollback -c '{"target": "7"}'``.
"""

from __future__ import annotations

import datetime as dt

from airflow.sdk import DAG, Param

from launcher import step
from pipeline_params import pipeline_params

pipeline = pipeline_params().pipeline

with DAG(
    dag_id="llm_rollback",
    description="Serve an earlier model version again and make it champion",
    schedule=None,
    start_date=dt.datetime.fromisoformat(pipeline.start_date).replace(tzinfo=dt.UTC),
    catchup=False,
    max_active_runs=1,
    params={
        "target": Param(
            "previous", type="string", pattern=r"^([a-z][a-z0-9_-]*|[0-9]+)$",
            description="A registry alias (previous, champion, challenger) or a version number of "
            f"{pipeline.model_name}.",
        ),
    },
    tags=["llm", "serving"],
    doc_md=__doc__,
) as dag:
    step("rollback", "tasks.deploy", ["rollback", "--target", "{{ params.target }}"], retries=1)
