"""Retrain the language model: snapshot -> validate -> tokenize -> train -> evaluate -> register
-> export -> deploy (a canary on Triton behind the router: promoted to champion, or rolled back;
with the approval Param, or where params.yaml requires it, it holds for a person: approve_rollout,
then deploy_finish)
-> drift_recheck (a run the drift check started: that check again on its window with the promoted
version, before and after; any other run skips it)
-> report (a teardown: the run report, whatever happened before it).

This file only wires steps. Each step is ``python -m tasks.<step>`` run by the launcher in
``plugins/launcher.py`` (a pod in a cluster, a local process by default); settings come from
params.yaml, outputs are run-scoped URIs, XCom carries only small JSON results.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from airflow.providers.standard.operators.python import ShortCircuitOperator
from airflow.sdk import DAG, AssetOrTimeSchedule, CronTriggerTimetable, Param, TriggerRule
from alerts import on_run_failure, step_defaults
from approval import RolloutApproval

from launcher import (
    Torchrun,
    answer,
    distributed_step,
    result,
    run_output_uri,
    scheduling,
    step,
    tokenize_steps,
)
from pipeline_params import (
    DEMO,
    SettingParam,
    Settings,
    dags_per_line,
    line_dag_shared,
    pipeline_params,
    raw_data_asset,
    set_arguments,
)
from tasks.contract import DECISIONS, ERROR_XCOM_KEY, REPORTED_STEPS, ROLL_BACK, ROLLOUT_VERDICT, RolloutVerdict


# The trigger form's Params that stand for settings of params.yaml: default and type from the
# settings, bounds and words here; a Param with a set_key reaches the steps of its section as
# `--set` (set_arguments), the others as arguments of their own below.
def run_settings(params: Settings) -> dict[str, SettingParam]:
    """A line's trigger-form Params that stand for its settings (their bounds read its gate limits,
    presets and approval)."""
    train_params, gate, approval = params.train, params.evaluate, params.canary.approval
    # a deployment that requires the approval: the Param is a constant (the trigger form hides it),
    # and a run that switches it off is refused when it is created (REST API, CLI, backfill); deploy
    # overrides a false one from a run created before, with a warning line
    approval_schema: dict[str, Any] = {"const": True} if approval.required else {}
    return {
        "lookback_days": SettingParam(
            "pipeline.lookback_days", "Look-back days", "How many daily partitions before the end date to snapshot.",
            {"minimum": 1, "maximum": 366}),
        "raw_data_uri": SettingParam(
            "pipeline.raw_data_uri", "Raw data",
            "Raw JSON Lines partitioned as date=YYYY-MM-DD/ (s3:// URI or absolute path).", {"pattern": r"^(s3://|/).+"}),
        "eval_set_uri": SettingParam(
            "evaluate.eval_set_uri", "Held-out text",
            "JSON Lines of held-out text (never trained on) the gate measures perplexity on and the export checks "
            "parity with (s3:// URI or absolute path).", {"pattern": r"^(s3://|/).+"}),
        "num_shards": SettingParam(
            "tokenize.num_shards", "Tokenization shards", "Parallel tokenization tasks (one pod each in a cluster).",
            {"minimum": 1, "maximum": 256}),
        "train_preset": SettingParam(
            "train.preset", "Model preset", "Model size (params.yaml train.presets): cpu-* on CPUs, gpu-* on GPU nodes.",
            {"enum": sorted(train_params.presets)}, set_key="preset"),
        "train_engine": SettingParam(
            "train.engine", "Training engine", "FSDP2 (sharded), DDP (replicated), DeepSpeed ZeRO, or one process.",
            set_key="engine"),
        "train_precision": SettingParam(
            "train.precision", "Training precision",
            "bf16 autocast: auto on GPUs only; bf16 on CPU nodes with AMX too (~2x there), fp32 never.",
            set_key="precision"),
        "train_nodes": SettingParam(
            "train.nodes", "Training nodes", "torchrun nodes: local processes, or pods of the Indexed Job in a cluster.",
            {"minimum": 1, "maximum": 64}),
        "train_max_steps": SettingParam(
            "train.max_steps", "Training steps",
            "Optimizer steps of the train step (the rest of its settings: params.yaml train).",
            {"minimum": 1, "maximum": 10_000_000}, set_key="max_steps"),
        "train_init_from": SettingParam(
            "train.init_from", "Start training from",
            "champion: continue from the production model's weights (same architecture and vocabulary, else "
            "scratch); scratch: a random initialization.", set_key="init_from"),
        # the gate: a run may tighten it, never loosen it past params.yaml's evaluate.limits (the
        # evaluate step refuses a looser value too, whatever created the run)
        "max_regression": SettingParam(
            "evaluate.max_regression", "Gate: largest regression",
            "Largest relative perplexity increase over the champion the gate accepts (0.05: 5%); "
            f"at most {gate.limits.max_regression:g} (evaluate.limits).",
            {"minimum": 0, "maximum": gate.limits.max_regression}, set_key="max_regression"),
        "max_eval_perplexity": SettingParam(
            "evaluate.max_eval_perplexity", "Gate: highest perplexity",
            "Held-out perplexity above this is rejected, whatever the champion's; at most "
            f"{gate.limits.max_eval_perplexity:g} (evaluate.limits).",
            {"exclusiveMinimum": 1, "maximum": gate.limits.max_eval_perplexity}, set_key="max_eval_perplexity"),
        "min_eval_accuracy": SettingParam(
            "evaluate.min_eval_accuracy", "Gate: lowest accuracy",
            f"Held-out next-token accuracy below this is rejected; at least {gate.limits.min_eval_accuracy:g} "
            "(evaluate.limits).", {"minimum": gate.limits.min_eval_accuracy, "maximum": 1}, set_key="min_eval_accuracy"),
        "canary_steps": SettingParam(
            "canary.steps", "Canary traffic steps (%)",
            "Traffic share of the new version at each canary step, ending at 100 (then promotion).",
            {"minItems": 1, "maxItems": 10, "items": {"type": "number", "exclusiveMinimum": 0, "maximum": 100}},
            set_key="steps"),
        "deploy_older_data": SettingParam(
            "canary.deploy_older_data", "Deploy over a newer champion",
            "Deploy even when the model's data window ends before the champion's (a backfill's usually does: it is "
            "registered and exported, not deployed).", set_key="deploy_older_data"),
        "approval": SettingParam(
            "canary.approval.enabled", "Approve the rollout",
            f"Hold the canary before its {approval.hold_before:g}% step until a person answers (Promote, Roll back, "
            f"Extend) in Airflow's Required Actions; no answer within {approval.timeout_s:g}s rolls it back."
            + (" Required by this deployment (canary.approval.required): a run cannot switch it off."
               if approval.required else ""),
            approval_schema, set_key="approval.enabled", default=approval.active),
        "grow_vocabulary": SettingParam(
            "tokenize.grow_vocabulary", "Grow the vocabulary",
            "When the drift check that started this run found the drifted prompts falling back to single bytes, "
            "extend the champion's tokenizer with tokens learned on the window's non-ASCII words (old ids "
            "unchanged) and grow the model's embeddings with them (docs/operations.md).", set_key="grow_vocabulary"),
        # null, not "": the trigger form refuses an empty required string
        "train_base": SettingParam(
            "train.base", "Base checkpoint",
            "A Hugging Face checkpoint (Llama, Mistral, Qwen2): a folder, an s3:// URI or a registered version "
            "(models:/NAME/VERSION, models:/NAME@ALIAS). The line starts from: its weights, tokenizer and "
            "architecture; retrains continue from their champion while it descends from this base. Empty: the "
            "preset, from scratch (train.base).", nullable=True),
    }


# Dates read from the DagRun's attributes only: a run triggered without a logical date (the
# CLI's `dags trigger`, the REST API with "logical_date": null) has None there, while the
# context leaves the top-level `logical_date`/`data_interval_*` names out altogether.
# End of the data interval (exclusive): a manual override, else the run's interval end, else
# the time it was triggered.
END_DATE = "{{ params.end_date or ((dag_run.data_interval_end or dag_run.run_after) | ds) }}"
LOGICAL_DATE = "{{ (dag_run.logical_date or dag_run.run_after) | ds }}"
# what the person deciding a held rollout reads: deploy's account of the rollout so far (its
# figures and report), and the evaluation
APPROVAL_BODY = """{% set ev = ti.xcom_pull(task_ids='evaluate') %}{% set ch = ev['champion'] %}
{{ ti.xcom_pull(task_ids='deploy')['approval_text'] }}

Evaluation on held-out text: perplexity {{ '%.1f' % ev['challenger']['eval_perplexity'] }}
{%- if ch %} (champion v{{ ch['registry_version'] }}: {{ '%.1f' % ch['eval_perplexity'] }}){% endif %},
next-token accuracy {{ '%.3f' % ev['challenger']['eval_accuracy'] }}
{%- if ch %} ({{ '%.3f' % ch['eval_accuracy'] }}){% endif %}; report `{{ ev['report_uri'] }}`."""


def reported_xcoms(option: str, key: str, steps: list[Any]) -> list[str]:
    """``option STEP=<the step's XCom under key, as JSON>`` for each reported step (the report's arguments)."""
    return [arg for step in steps for arg in (option, f"{step.task_id}=" + result(step, xcom_key=key))]


# the drift check that started this run, if one did: the extra of the newest raw data Asset event
# llm_drift emitted (its report, reasons, run) among the events the run consumed, as JSON; {} for
# a run something else started
# a run started by hand for a drift check (its drift_report Param: make drift-loop) gets {"drift_report": URI}
DRIFT_TRIGGER = ("{% if params.drift_report %}{{ {'drift_report': params.drift_report} | tojson }}{% else %}"
                 "{% set found = namespace(extra={}, at=none) %}{% for events in triggering_asset_events.values() %}"
                 "{% for event in events %}{% if (event.extra or {}).get('drift_report') and "
                 "(found.at is none or event.timestamp > found.at) %}{% set found.extra = event.extra %}"
                 "{% set found.at = event.timestamp %}{% endif %}{% endfor %}{% endfor %}{{ found.extra | tojson }}"
                 "{% endif %}")
# names this DAG run's MLflow run and registered version (retries find them by it)
MLFLOW_RUN_TAG = "{{ dag.dag_id }}/{{ run_id }}"


def retrain_dag(line: str, params: Settings) -> DAG:
    """The retrain DAG of one model line, from its settings."""
    pipeline, train_params, approval = params.pipeline, params.train, params.canary.approval
    settings_params = run_settings(params)
    with DAG(
        dag_id=pipeline.dag_id,
        description="Retrain the language model on the latest data window",
        # weekly, and whenever the ingest DAG lands new raw data (an asset-triggered run has no
        # logical date: its window ends the day it was triggered, see END_DATE)
        schedule=AssetOrTimeSchedule(timetable=CronTriggerTimetable(pipeline.schedule, timezone="UTC"),
                                     assets=[raw_data_asset()]),
        **line_dag_shared(line, params, "retrain"),
        max_active_runs=2,
        # a run going on this long is failed by the scheduler, with one alert line (and the webhook).
        # (Airflow 3.3.2's DeadlineAlert, which would only alert, crashes `airflow dags test`.)
        dagrun_timeout=dt.timedelta(minutes=pipeline.deadline_min),
        on_failure_callback=on_run_failure,
        default_args=step_defaults(),  # retries with backoff, the alert of a task that failed for good
        params={
            # the trigger form: what an operator changes for a manual run, refused by the form when out of bounds
            "end_date": Param(
                None, type=["null", "string"], format="date", title="Data window end",
                description="Read the look-back window ending before this date (YYYY-MM-DD); empty: the run's data interval.",
            ),
            **{name: setting.param(params) for name, setting in settings_params.items()},
            "skip_deploy": Param(
                False, type="boolean", title="Skip deploy",
                description="Register and export the model, but do not canary or promote it.",
            ),
            "tokenizer_uri": Param(
                None, type=["null", "string"], title="Tokenizer",
                description="Use this tokenizer.json; empty: the base's, the production model's, or train one on "
                            "first run.",
            ),
            "drift_report": Param(
                None, type=["null", "string"], title="Drift report",
                description="The drift check (its report.html URI) this run answers, as if that check had started "
                            "it: the window must hold data newer than the champion's, and the check runs again "
                            "on its window once a version is promoted. Empty: the Asset event that started the "
                            "run, if the drift check emitted it.",
            ),
        },
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
                "--run-id", "{{ run_id }}",  # claims the run's storage folder: two ids may share a key
                "--trigger", DRIFT_TRIGGER,  # a retrain the drift check started needs data newer than the champion's
            ],
        )
        validate = step(
            "validate",
            "tasks.validate",
            ["--snapshot", result(snapshot, "snapshot_uri"), "--output", run_output_uri("validate")],
        )
        tokenizer = step(
            "tokenizer",
            "tasks.tokenize",
            [
                "prepare",
                "--snapshot", result(snapshot, "snapshot_uri"),
                "--output", run_output_uri("tokenize/tokenizer"),
                "--tokenizer", "{{ params.tokenizer_uri or '' }}",
                "--base", "{{ params.train_base or '' }}",
                "--preset", "{{ params.train_preset }}",
                "--trigger", DRIFT_TRIGGER,  # a drift check that found byte fallback may grow the vocabulary
                *set_arguments(settings_params, "tokenize", params),
            ],
        )
        merge = tokenize_steps(result(snapshot, "snapshot_uri"), result(tokenizer, "tokenizer_uri"),
                               "{{ params.num_shards }}")

        train = distributed_step(
            "train",
            "tasks.train",
            [
                "--dataset", result(merge, "dataset_uri"),
                # run-scoped: a retry or a restarted worker resumes from the newest complete checkpoint
                "--checkpoints", run_output_uri("train/checkpoints"),
                "--output", run_output_uri("train/model"),
                "--mlflow-run-tag", MLFLOW_RUN_TAG,
                "--init-from", result(tokenizer, "init_model_uri"),
                *set_arguments(settings_params, "train", params),
            ],
            Torchrun("{{ params.train_nodes }}", train_params.procs_per_node, train_params.max_restarts),
        )

        # a rejected challenger exits 99: the task is skipped, and so is everything after it
        evaluate = step(
            "evaluate",
            "tasks.evaluate",
            [
                "--model", result(train, "model_uri"),
                "--dataset", result(merge, "dataset_uri"),
                "--eval-set", "{{ params.eval_set_uri }}",
                "--output", run_output_uri("evaluate"),
                "--mlflow-run-tag", MLFLOW_RUN_TAG,
                "--trigger", DRIFT_TRIGGER,  # a drift-started run is judged on the drifted prompts too
                *set_arguments(settings_params, "evaluate", params),
            ],
        )
        register = step(
            "register",
            "tasks.register",
            [
                "--model", result(train, "model_uri"),
                "--evaluation", result(evaluate, "report_uri"),
                "--mlflow-run-tag", MLFLOW_RUN_TAG,
                "--lineage", "data_version=" + result(snapshot, "data_version", "tag"),
                "--lineage", "data_content_hash=" + result(snapshot, "data_version", "content_hash"),
                # captured prompts in that data version (snapshot.learn_from_traffic), 0 for none
                "--lineage", "traffic_records=" + result(snapshot, "traffic_records"),
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
                "--model-version", result(register, "version"),
                "--eval-set", "{{ params.eval_set_uri }}",
                "--output", run_output_uri("export"),
                "--mlflow-run-tag", MLFLOW_RUN_TAG,
            ],
            kind=params.serve.export_kind,  # a TensorRT plan is built on the GPU kind that serves it
        )
        # a failed canary is rolled back inside the step and exits 2: the task fails without retries
        deploy = step(
            "deploy",
            "tasks.deploy",
            [
                *set_arguments(settings_params, "canary", params),  # the parser's, before the sub-command
                "canary",
                "--model-version", result(register, "version"),
                "--export", result(export, "export_uri"),
                "--output", run_output_uri("deploy"),
                "--mlflow-run-tag", MLFLOW_RUN_TAG,
            ],
        )
        # skip_deploy: the export is kept, the canary is not run (deploy is skipped, the report says so)
        deploy_gate = ShortCircuitOperator(
            task_id="deploy_gate", python_callable=lambda params: not params["skip_deploy"],
            ignore_downstream_trigger_rules=False,
        )

        # approval: deploy left the rollout held (its traffic where it is) for a person's decision,
        # shown in Airflow's Required Actions; the task waits holding no worker slot. No answer
        # within the timeout: the default, Roll back. deploy_finish carries the answer out. Only the
        # approvers may answer, and with four_eyes not the user who triggered the run (plugins/approval.py)
        approval_gate = ShortCircuitOperator(
            task_id="approval_gate",
            python_callable=lambda ti: ti.xcom_pull(task_ids="deploy")[ROLLOUT_VERDICT] == RolloutVerdict.HELD,
            ignore_downstream_trigger_rules=False,
        )
        approve = RolloutApproval(
            task_id="approve_rollout",
            approvers=approval.approvers,
            four_eyes=approval.four_eyes,
            subject="Roll out version {{ ti.xcom_pull(task_ids='deploy')['canary'] }} of "
                    f"{pipeline.model_name}?",
            body=APPROVAL_BODY,
            options=list(DECISIONS),
            defaults=[ROLL_BACK],
            response_timeout=dt.timedelta(seconds=approval.timeout_s),
            **scheduling("approve_rollout"),  # its time limit before it waits; the wait: response_timeout
        )
        finish = step(
            "deploy_finish",
            "tasks.deploy",
            [
                *set_arguments(settings_params, "canary", params),
                "finish",
                "--model-version", result(register, "version"),
                "--export", result(export, "export_uri"),
                "--held", run_output_uri("deploy"),
                "--answer", answer(approve),
                "--output", run_output_uri("deploy_finish"),
                "--mlflow-run-tag", MLFLOW_RUN_TAG,
            ],
        )
        # a teardown (runs however the tasks before it ended, and leaves the run's state to them): a
        # rollout still held (the approval task failed or was marked failed, so deploy_finish never
        # ran) is rolled back, not left at its weight. No setup: a skipped deploy must not skip it.
        release = step("release_hold", "tasks.deploy", ["release", "--held", run_output_uri("deploy")])

        # a run the drift check started: that check again, on its window, with the version this run
        # promoted (did the loop close?); any other run, or none promoted: skipped (exit 99)
        recheck = step(
            "drift_recheck",
            "tasks.drift",
            ["recheck", "--trigger", DRIFT_TRIGGER, "--output", run_output_uri("drift_recheck"),
             # this run's registered version, as JSON (null: a rejected challenger registers none)
             "--registered", result(register, xcom_key="return_value")],
            trigger_rule=TriggerRule.ALL_DONE,  # after the rollout, however it ended
        )

        # the run report: a teardown runs whatever happened upstream and leaves the run's state to
        # the steps (a failed deploy still fails the run)
        reported = [dag.get_task(task_id) for task_id in REPORTED_STEPS]
        report = step(
            "report",
            "tasks.report",
            [
                "write",
                "--dag-id", "{{ dag.dag_id }}",
                "--run-id", "{{ run_id }}",
                "--states", "{{ ti.get_task_states(dag_id=dag.dag_id, run_ids=[run_id]) | tojson }}",
                *reported_xcoms("--result", "return_value", reported),
                # a failed step pushes no result, only its one-line error (tasks/contract.py)
                *reported_xcoms("--error", ERROR_XCOM_KEY, reported),
                "--deploy-output", run_output_uri("deploy"),
                "--finish-output", run_output_uri("deploy_finish"),
                "--output", run_output_uri("report"),
                "--mlflow-run-tag", MLFLOW_RUN_TAG,
                "--trigger", DRIFT_TRIGGER,
            ],
        )

        # The edges come from the data: each step is downstream of the steps whose results its
        # arguments read (launcher.result). What follows orders steps that read no result:
        validate >> tokenizer  # nothing is tokenized before the snapshot passed validation
        export >> deploy_gate >> deploy  # skip_deploy: the export is kept, the canary is not run
        deploy >> approval_gate >> approve  # (approve's body reads deploy's and evaluate's results)
        finish >> release.as_teardown() >> recheck >> report
        report.as_teardown()  # after everything it reads, whatever happened to it
    return dag


DAGS = dags_per_line(retrain_dag)
globals().update(DAGS)  # Airflow finds a DAG as a module global: one per line, named by its id
dag = DAGS[pipeline_params(DEMO).pipeline.dag_id]  # the demo line's (llm_retrain)
RUN_SETTINGS = run_settings(pipeline_params(DEMO))
