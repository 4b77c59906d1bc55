"""Watch what the champion is asked: the served prompts the OpenAI API captured (serve.capture)
in the last window against the champion's training data; when they drifted, update the raw
data Asset, which starts llm_retrain (its run report links the drift report that started it).

drift_check (``python -m tasks.drift check``: the figures, the verdict, report.html, the
Pushgateway) -> drift_gate (drift, and no retrain already started for this champion within
``drift.cooldown_h``) -> request_retrain (the Asset event, with the drift report's URI and
reasons as its extra). Runs daily and on each capture partition llm_ingest closes; from the UI
or ``airflow dags trigger llm_drift`` with a window of its own (Params).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from airflow.providers.standard.operators.python import ShortCircuitOperator
from airflow.sdk import DAG, AssetOrTimeSchedule, CronTriggerTimetable, Param, get_current_context, task
from alerts import on_run_failure, step_defaults

from launcher import run_output_uri, step
from pipeline_params import pipeline_params, raw_data_asset, served_traffic_asset

params = pipeline_params()
pipeline, drift = params.pipeline, params.drift
# the window ends when the run was due (its tick, or when the Asset event queued it), unless given
WINDOW_END = "{{ params.end or (dag_run.data_interval_end or dag_run.run_after).isoformat() }}"

with DAG(
    dag_id=drift.dag_id,
    description="Compare served traffic with the champion's training data; start a retrain on drift",
    schedule=AssetOrTimeSchedule(timetable=CronTriggerTimetable(drift.schedule, timezone="UTC"),
                                 assets=[served_traffic_asset()]),
    start_date=dt.datetime.fromisoformat(pipeline.start_date).replace(tzinfo=dt.UTC),
    catchup=False,
    max_active_runs=1,  # two checks at once could both start a retrain
    on_failure_callback=on_run_failure,
    default_args=step_defaults(),  # retries with backoff, the alert of a task that failed for good
    params={
        "window_hours": Param(drift.window_h, type="number", exclusiveMinimum=0, maximum=24 * 31, title="Window (hours)",
                              description="The captured requests of this many hours before the end are compared."),
        "end": Param(None, type=["null", "string"], title="Window end",
                     description="ISO date-time (UTC); empty: when the run was due."),
    },
    tags=["llm", "monitoring"],
    doc_md=__doc__,
) as dag:
    check = step("drift_check", "tasks.drift",
                 ["check", "--end", WINDOW_END, "--window-hours", "{{ params.window_hours }}",
                  "--output", run_output_uri("drift")])
    gate = ShortCircuitOperator(
        task_id="drift_gate", python_callable=lambda ti: ti.xcom_pull(task_ids="drift_check")["request_retrain"])

    @task(task_id="request_retrain", outlets=[raw_data_asset()])
    def request_retrain(found: Any) -> dict[str, Any]:  # found: drift_check's result (an XComArg when wired)
        """The raw data Asset's event: llm_retrain runs on it; its extra is what the report links."""
        context = get_current_context()
        extra = {"drift_report": found["report_uri"], "drift_reasons": found["reasons"],
                 "drift_clients": found.get("clients"),  # who drove it (hashed addresses)
                 "drift_run": f"{context['dag'].dag_id}/{context['run_id']}", "champion": found["champion"]}
        context["outlet_events"][raw_data_asset()].extra = extra
        return extra

    check >> gate >> request_retrain(check.output)
