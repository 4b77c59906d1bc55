"""Roll serving back by hand: the target version (default: the ``previous`` champion) gets all
traffic through the router and becomes ``champion``; the version it replaces is unloaded.

Triggered from the UI (Params form) or ``airflow dags trigger llm_rollback -c '{"target": "7"}'``; a
model line's is ``llm_rollback__<line>`` (docs/lines.md).
"""

from __future__ import annotations

from airflow.sdk import DAG, Param

from launcher import step
from pipeline_params import Settings, dags_per_line, line_dag_id, line_dag_shared

ROLLBACK_DAG = "llm_rollback"


def rollback_dag(line: str, params: Settings) -> DAG:
    """The rollback DAG of one model line: its registered model, its serving pool."""
    pipeline = params.pipeline
    with DAG(
        dag_id=line_dag_id(ROLLBACK_DAG, line),
        description="Serve an earlier model version again and make it champion",
        schedule=None,
        **line_dag_shared(line, params, "serving"),
        max_active_runs=1,
        params={
            "target": Param(
                "previous", type="string", pattern=r"^([a-z][a-z0-9_-]*|[0-9]+)$",
                description="A registry alias (previous, champion, challenger) or a version number of "
                f"{pipeline.model_name}.",
            ),
        },
        doc_md=__doc__,
    ) as dag:
        step("rollback", "tasks.deploy", ["rollback", "--target", "{{ params.target }}"], retries=1)
    return dag


globals().update(dags_per_line(rollback_dag))  # Airflow finds a DAG as a module global: one per line
