"""Land each day's raw partition, then tell Airflow the raw data changed: the task's outlet is
the raw data Asset, and the retrain DAG runs on "that Asset or its weekly schedule". Close the
day's partition of captured served traffic too: its Asset runs the drift check (llm_drift).

Locally the demo generator stands in for an ingestion job (``tasks.seed``: the partitions of
its window missing under ``raw_data_uri``, never rewriting one); a deployment replaces the task
with its own, keeping the ``date=YYYY-MM-DD/`` layout and the outlet.
"""

from __future__ import annotations

import datetime as dt

from airflow.sdk import DAG

from launcher import step
from pipeline_params import pipeline_params, raw_data_asset, served_traffic_asset

params = pipeline_params()
pipeline, ingest = params.pipeline, params.ingest

with DAG(
    dag_id=ingest.dag_id,
    description="Land the day's raw partition and update the raw data Asset",
    schedule=ingest.schedule,
    start_date=dt.datetime.fromisoformat(pipeline.start_date).replace(tzinfo=dt.UTC),
    catchup=False,
    max_active_runs=1,
    tags=["llm", "data"],
    doc_md=__doc__,
) as dag:
    # the day that just ended: a run at midnight lands yesterday's partition
    yesterday = "{{ macros.ds_add((dag_run.logical_date or dag_run.run_after) | ds, -1) }}"
    step("ingest", "tasks.seed", ["--output", pipeline.raw_data_uri, "--end-date", yesterday],
         retries=pipeline.retries, outlets=[raw_data_asset()])
    # ... and closes yesterday's partition of the served traffic the OpenAI API captured: its
    # Asset event runs the drift check (a day without traffic: skipped, no event)
    step("close_served", "tasks.drift", ["close", "--date", yesterday], retries=pipeline.retries,
         outlets=[served_traffic_asset()])
