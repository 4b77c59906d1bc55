"""Retrain the language model: snapshot -> validate -> tokenize -> train -> evaluate -> register
-> export -> deploy (a canary on Triton behind the router: promoted to champion, or rolled back).

This file only wires steps. Each step is ``python -m tasks.<step>`` run by the launcher in
``plugins/launcher.py`` (a pod in a cluster, a local process by default); settings come from
params.yaml, outputs are run-scoped URIs, XCom carries only small JSON results.
"""

from __future__ import annotations

import datetime as dt

from airflow.sdk import DAG, Param

from launcher import distributed_step, mapped_step, run_output_uri, shard_arguments, step
from pipeline_params import pipeline_params

params = pipeline_params()
pipeline = params["pipeline"]


def result(task_id: str, *keys: str) -> str:
    """Template reading one field (``keys``: its path) of an upstream step's result."""
    path = "".join(f"['{key}']" for key in keys)
    return f"{{{{ ti.xcom_pull(task_ids='{task_id}'){path} }}}}"


# Dates read from the DagRun's attributes only: a run triggered without a logical date (the
# CLI's `dags trigger`, the REST API with "logical_date": null) has None there, while the
# context leaves the top-level `logical_date`/`data_interval_*` names out altogether.
# End of the data interval (exclusive): a manual override, else the run's interval end, else
# the time it was triggered.
END_DATE = "{{ params.end_date or ((dag_run.data_interval_end or dag_run.run_after) | ds) }}"
LOGICAL_DATE = "{{ (dag_run.logical_date or dag_run.run_after) | ds }}"
# names this DAG run's MLflow run and registered version (retries find them by it)
MLFLOW_RUN_TAG = "{{ dag.dag_id }}/{{ run_id }}"

with DAG(
    dag_id=pipeline["dag_id"],
    description="Retrain the language model on the latest data window",
    schedule=pipeline["schedule"],
    start_date=dt.datetime.fromisoformat(pipeline["start_date"]).replace(tzinfo=dt.UTC),
    catchup=False,
    max_active_runs=2,
    default_args={
        "retries": pipeline["retries"],
        "retry_delay": dt.timedelta(seconds=pipeline["retry_delay_s"]),
        "retry_exponential_backoff": True,
        "max_retry_delay": dt.timedelta(seconds=pipeline["max_retry_delay_s"]),
    },
    params={
        "end_date": Param(
            None, type=["null", "string"], format="date",
            description="Read the look-back window ending before this date (YYYY-MM-DD); empty: the run's data interval.",
        ),
        "lookback_days": Param(
            pipeline["lookback_days"], type="integer", minimum=1, maximum=366,
            description="How many daily partitions before the end date to snapshot.",
        ),
        "raw_data_uri": Param(
            pipeline["raw_data_uri"], type="string", pattern=r"^(s3://|/).+",
            description="Raw JSON Lines partitioned as date=YYYY-MM-DD/ (s3:// URI or absolute path).",
        ),
        "num_shards": Param(
            params["tokenize"]["num_shards"], type="integer", minimum=1, maximum=256,
            description="Parallel tokenization tasks (one pod each in a cluster).",
        ),
        "train_max_steps": Param(
            params["train"]["max_steps"], type="integer", minimum=1,
            description="Optimizer steps of the train step (the rest of its settings: params.yaml train).",
        ),
        "tokenizer_uri": Param(
            None, type=["null", "string"],
            description="Use this tokenizer.json; empty: the production model's, or train one on first run.",
        ),
    },
    tags=["llm", "retrain"],
    doc_md=__doc__,
) as dag:
    snapshot = step(
        "snapshot",
        "tasks.snapshot",
        [
            "--source", "{{ params.raw_data_uri }}",
            "--end-date", END_DATE,
            "--lookback-days", "{{ params.lookback_days }}",
            "--output", run_output_uri("snapshot"),
        ],
    )
    validate = step(
        "validate",
        "tasks.validate",
        ["--snapshot", result("snapshot", "snapshot_uri"), "--output", run_output_uri("validate")],
    )
    tokenizer = step(
        "tokenizer",
        "tasks.tokenize",
        [
            "prepare",
            "--snapshot", result("snapshot", "snapshot_uri"),
            "--output", run_output_uri("tokenize/tokenizer"),
            "--tokenizer", "{{ params.tokenizer_uri or '' }}",
        ],
    )
    shard_args = shard_arguments(
        [
            "encode",
            "--snapshot", result("snapshot", "snapshot_uri"),
            "--tokenizer", result("tokenizer", "tokenizer_uri"),
        ],
        output_root=run_output_uri("tokenize/shards"),
        num_shards="{{ params.num_shards }}",
    )
    encode = mapped_step("tokenize_shard", "tasks.tokenize", shard_args)
    merge = step(
        "tokenize_merge",
        "tasks.tokenize",
        [
            "merge",
            "--snapshot", result("snapshot", "snapshot_uri"),
            "--tokenizer", result("tokenizer", "tokenizer_uri"),
            "--num-shards", "{{ params.num_shards }}",
            "--shards", run_output_uri("tokenize/shards"),
            "--output", run_output_uri("tokenize/dataset"),
        ],
    )

    train_params = params["train"]
    train = distributed_step(
        "train",
        "tasks.train",
        [
            "--dataset", result("tokenize_merge", "dataset_uri"),
            # run-scoped: a retry or a restarted worker resumes from the newest complete checkpoint
            "--checkpoints", run_output_uri("train/checkpoints"),
            "--output", run_output_uri("train/model"),
            "--mlflow-run-tag", MLFLOW_RUN_TAG,
            "--set", "max_steps={{ params.train_max_steps }}",
        ],
        nodes=train_params["nodes"],
        procs_per_node=train_params["procs_per_node"],
        max_restarts=train_params["max_restarts"],
    )

    # a rejected challenger exits 99: the task is skipped, and so is everything after it
    evaluate = step(
        "evaluate",
        "tasks.evaluate",
        [
            "--model", result("train", "model_uri"),
            "--dataset", result("tokenize_merge", "dataset_uri"),
            "--output", run_output_uri("evaluate"),
            "--mlflow-run-tag", MLFLOW_RUN_TAG,
        ],
    )
    register = step(
        "register",
        "tasks.register",
        [
            "--model", result("train", "model_uri"),
            "--evaluation", result("evaluate", "report_uri"),
            "--mlflow-run-tag", MLFLOW_RUN_TAG,
            "--lineage", "data_version=" + result("snapshot", "data_version", "tag"),
            "--lineage", "data_content_hash=" + result("snapshot", "data_version", "content_hash"),
            "--lineage", "data_end=" + END_DATE,
            "--lineage", "dag_id={{ dag.dag_id }}",
            "--lineage", "dag_run_id={{ run_id }}",
            "--lineage", "logical_date=" + LOGICAL_DATE,
        ],
    )

    export = step(
        "export",
        "tasks.export",
        [
            "--model-version", result("register", "version"),
            "--output", run_output_uri("export"),
            "--mlflow-run-tag", MLFLOW_RUN_TAG,
        ],
    )
    # a failed canary is rolled back inside the step and exits 2: the task fails without retries
    deploy = step(
        "deploy",
        "tasks.deploy",
        [
            "canary",
            "--model-version", result("register", "version"),
            "--export", result("export", "export_uri"),
            "--output", run_output_uri("deploy"),
            "--mlflow-run-tag", MLFLOW_RUN_TAG,
        ],
    )

    snapshot >> validate >> tokenizer >> shard_args >> encode >> merge >> train >> evaluate >> register
    register >> export >> deploy
