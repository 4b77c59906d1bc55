"""Replay a registered version: rebuild it from its lineage alone and compare its weights with
the registered ones, tensor by tensor (identical, or the first difference and why).

replay_plan (the version's lineage checked: refused with one line when an input is gone) ->
snapshot (restored from its DVC tag) -> tokenize (the recorded tokenizer) -> train (the recorded
settings, starting weights and node/process layout) -> replay_compare. It registers nothing and
serves nothing. Triggered from the UI (Params form), ``make replay VERSION=N``, or
``airflow dags trigger llm_replay -c '{"version": 3}'``; a model line's is ``llm_replay__<line>``.
"""

from __future__ import annotations

import datetime as dt

from airflow.sdk import DAG, Param
from alerts import on_run_failure, step_defaults

from launcher import Torchrun, distributed_step, result, run_output_uri, step, tokenize_steps
from pipeline_params import Settings, dags_per_line, line_dag_id, line_dag_shared
from tasks.contract import REPLAY_DAG


def replay_dag(line: str, params: Settings) -> DAG:
    """The replay DAG of one model line: rebuilds a version of its registered model."""
    pipeline = params.pipeline
    with DAG(
        dag_id=line_dag_id(REPLAY_DAG, line),
        description="Rebuild a registered model version from its lineage and compare the weights",
        schedule=None,
        **line_dag_shared(line, params, "audit"),
        max_active_runs=1,
        dagrun_timeout=dt.timedelta(minutes=pipeline.deadline_min),
        on_failure_callback=on_run_failure,
        default_args=step_defaults(),  # retries with backoff, the alert of a task that failed for good
        params={
            "version": Param(
                1, type="integer", minimum=1, title="Version",
                description=f"The registered version of {pipeline.model_name} to rebuild.",
            ),
        },
        doc_md=__doc__,
    ) as dag:
        plan = step("replay_plan", "tasks.replay",
                    ["plan", "--model-version", "{{ params.version }}", "--output", run_output_uri("plan")])
        snapshot = step("snapshot", "tasks.snapshot",
                        ["--restore", result(plan, "data_version"), "--output", run_output_uri("snapshot"),
                         "--run-id", "{{ run_id }}"])
        # the split the version's dataset had (tokenize.val_fraction then), whatever params.yaml says now
        split = ["--set", "val_fraction=" + result(plan, "val_fraction")]
        merge = tokenize_steps(result(snapshot, "snapshot_uri"), result(plan, "tokenizer_uri"),
                               str(params.tokenize.num_shards),  # the merged dataset is the same for any count
                               extra=split)
        train = distributed_step(
            "train",
            "tasks.train",
            [
                "--dataset", result(merge, "dataset_uri"),
                "--checkpoints", run_output_uri("train/checkpoints"),
                "--output", run_output_uri("train/model"),
                "--mlflow-run-tag", "{{ dag.dag_id }}/{{ run_id }}",
                "--init-from", result(plan, "init_from"),
                "--settings", result(plan, "settings_uri"),
            ],
            # replay_plan refuses a version trained with another procs_per_node
            Torchrun(result(plan, "nodes"), params.train.procs_per_node, params.train.max_restarts),
        )
        step("replay_compare", "tasks.replay",
             ["compare", "--model-version", "{{ params.version }}", "--model", result(train, "model_uri"),
              "--output", run_output_uri("compare")])
    return dag


globals().update(dags_per_line(replay_dag))  # Airflow finds a DAG as a module global: one per line
