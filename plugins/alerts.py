"""Alerts: one clear line in the log for a failed task or a run past its time limit, and the
same as JSON to a webhook when one is configured.

The webhook's URL comes from the environment, ``PIPELINE_ALERT_WEBHOOK_URL`` (a secret: a
Kubernetes Secret or ``.stack/stack.env``, never params.yaml). The payload carries ``text`` (the
line, which Slack and Mattermost incoming webhooks show as the message) and the fields a
receiver may route on. A webhook that cannot be reached is logged, never raised: an alert must
not fail, or retry, the task it reports on.
"""

from __future__ import annotations

import json
import logging
import os
import urllib.request
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("airflow.alerts")
WEBHOOK_ENV = "PIPELINE_ALERT_WEBHOOK_URL"
# a pod's failure carries its log's tail and the pod's state: the webhook gets the start of it
ERROR_FIELD_CHARS = 4000


def post(payload: dict[str, Any], timeout_s: float = 10.0) -> bool:
    """Send ``payload`` to the webhook, if one is configured; True when it answered 2xx."""
    url = os.environ.get(WEBHOOK_ENV, "")
    if not url:
        return False
    request = urllib.request.Request(url, data=json.dumps(payload, default=str).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return 200 <= resp.status < 300
    except OSError as exc:  # URLError, timeouts, refused connections
        log.warning("alert webhook %s: %s", url.split("?")[0], exc)
        return False


def failure_line(context: Mapping[str, Any]) -> str:
    ti = context["ti"]
    error = str(context.get("exception") or "unknown error").splitlines()[0][:500]
    return (f"ALERT {ti.dag_id} run {context.get('run_id')}: task {ti.task_id} failed "
            f"(try {ti.try_number}): {error}")


def on_task_failure(context: Mapping[str, Any]) -> None:
    """A task failed for good (after its retries, or at once on bad input)."""
    line = failure_line(context)
    log.error("%s", line)
    ti = context["ti"]
    post({"text": line, "event": "task_failed", "dag_id": ti.dag_id, "run_id": context.get("run_id"),
          "task_id": ti.task_id, "try_number": ti.try_number,
          "error": str(context.get("exception") or "")[:ERROR_FIELD_CHARS]})


def on_run_failure(context: Mapping[str, Any]) -> None:
    """A run that failed as a whole. Its failed tasks have alerted already; what is left is a run
    past ``dagrun_timeout`` (still going too long: the scheduler fails it)."""
    reason = str(context.get("reason") or "")
    if "timed_out" not in reason and "timed out" not in reason:
        return
    dag_run = context.get("dag_run")
    dag_id, run_id = getattr(dag_run, "dag_id", "?"), getattr(dag_run, "run_id", context.get("run_id", "?"))
    line = f"ALERT {dag_id} run {run_id}: not finished within its time limit ({reason}): failed by the scheduler"
    log.error("%s", line)
    post({"text": line, "event": "run_timed_out", "dag_id": dag_id, "run_id": run_id})


def step_defaults() -> dict[str, Any]:
    """A pipeline DAG's ``default_args``: retries with backoff (params.yaml ``pipeline``), and the
    alert of a task that failed for good."""
    import datetime as dt

    from pipeline_params import pipeline_params

    pipeline = pipeline_params().pipeline
    return {
        # a task that failed for good: one alert line, and the webhook (PIPELINE_ALERT_WEBHOOK_URL)
        "on_failure_callback": on_task_failure,
        "retries": pipeline.retries,
        "retry_delay": dt.timedelta(seconds=pipeline.retry_delay_s),
        "retry_exponential_backoff": True,
        "max_retry_delay": dt.timedelta(seconds=pipeline.max_retry_delay_s),
    }
