"""Cluster policies of this deployment. Airflow imports ``airflow_local_settings`` from its
path at start-up (the plugins folder is on it); each process applies the hooks itself.

Backfills queue behind regular runs: a backfill over past weeks must not hold the training pool
or the executor's slots while this week's scheduled run, or an operator's manual run, waits.
"""

from __future__ import annotations

from typing import Any

# subtracted from a backfill task's weight: below every regular task's (those are positive:
# the default "downstream" rule sums the weights of what follows, 1 each, 10 for train/deploy)
BACKFILL_PRIORITY_OFFSET = 1_000_000
BACKFILL_RUN_ID_PREFIX = "backfill__"


def is_backfill(task_instance: Any, dag_run: Any | None) -> bool:
    run_type = getattr(dag_run, "run_type", None)
    if run_type is not None:
        return str(run_type) == "backfill"
    return str(getattr(task_instance, "run_id", "") or "").startswith(BACKFILL_RUN_ID_PREFIX)


def task_instance_mutation_hook(task_instance: Any, dag_run: Any | None = None) -> None:
    """Lower a backfill task's priority weight below any regular run's. Airflow calls this at
    creation and again after recomputing the weight from the task (clears, retries), and on
    loaded instances too: only a positive weight is lowered, so a second call changes nothing."""
    weight = task_instance.priority_weight
    if weight is not None and weight > 0 and is_backfill(task_instance, dag_run):
        task_instance.priority_weight = weight - BACKFILL_PRIORITY_OFFSET
