"""The retrain DAG: integrity, parse-time hygiene, wiring, and one end-to-end run."""

from __future__ import annotations

import contextlib
import datetime as dt
import http.server
import itertools
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import REPO_ROOT, RUNTIME_PY, SHARED_RUN_MODULES, mlflow_rest, prometheus_query, ti_states, xcom

HEAVY = ("torch", "mlflow", "great_expectations", "pandas", "deepspeed", "dvc", "tokenizers")
ORDER = ["snapshot", "validate", "tokenizer", "shard_plan", "tokenize_shard", "tokenize_merge", "train", "evaluate",
         "register", "export", "deploy_gate", "deploy", "approval_gate", "approve_rollout", "deploy_finish", "release_hold", "drift_recheck",
         "report"]


@pytest.fixture(scope="module")
def dag() -> Any:
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO_ROOT / "dags"))
    assert bag.import_errors == {}
    return bag.dags["llm_retrain"]


def test_the_modules_sharing_the_retrain_run_are_scheduled_together() -> None:
    """make test's xdist scheduling keeps these modules in one process (tests/conftest.py): a module
    that asks for the run and is not listed would make the whole run again in another process."""
    asking = {str(path.relative_to(REPO_ROOT)) for path in (REPO_ROOT / "tests" / "dags").glob("test_*.py")
              if re.search(r"\bretrain_run\b", path.read_text())}
    assert asking == set(SHARED_RUN_MODULES)


def test_parsing_imports_no_heavy_module() -> None:
    """Run in a fresh interpreter: what parsing the DAG file pulls into sys.modules."""
    code = (
        "import sys; sys.path[:0] = ['plugins', 'dags']; import llm_retrain; "
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# The edges no argument draws: a step that must wait for another without reading its result
ORDERING_EDGES = {("validate", "tokenizer"), ("tokenize_shard", "tokenize_merge"), ("export", "deploy_gate"),
                  ("deploy_gate", "deploy"), ("deploy", "approval_gate"), ("approval_gate", "approve_rollout"),
                  ("deploy_finish", "release_hold"), ("release_hold", "drift_recheck")}


def results_read(task: Any) -> set[str]:
    """The tasks whose XComs ``task`` reads: in its argument templates, or as XComArgs (mapped)."""
    templates = " ".join(map(str, getattr(task, "arguments", None) or []))
    read = set(re.findall(r"xcom_pull\(task_ids='(\w+)'", templates))
    expanded = getattr(task, "expand_input", None)
    if expanded is not None:
        read |= {op.task_id for op, _ in expanded.iter_references()}
    for value in getattr(task, "op_args", None) or []:  # the @task shard plan's inputs
        read |= set(re.findall(r"xcom_pull\(task_ids='(\w+)'", str(value)))
    return read


def test_the_graph_is_what_the_data_implies(dag: Any) -> None:
    """Each task is downstream of exactly the tasks whose results it reads, plus the few ordering
    edges no argument draws; the steps then run in the pipeline's order."""
    assert {task.task_id for task in dag.tasks} == set(ORDER)
    for task in dag.tasks:
        ordered_after = {up for up, down in ORDERING_EDGES if down == task.task_id}
        assert task.upstream_task_ids == results_read(task) | ordered_after, task.task_id
    assert results_read(dag.get_task("report")) >= {"snapshot", "evaluate", "deploy"}
    assert dag.get_task("report").downstream_task_ids == set() and dag.get_task("report").is_teardown
    # a topological order of the graph is the pipeline's, and no two steps may run in another
    for earlier, later in itertools.pairwise(ORDER):
        assert earlier in dag.get_task(later).get_flat_relative_ids(upstream=True), (earlier, later)


def test_a_result_read_draws_its_edge() -> None:
    """The launcher makes a step downstream of the steps whose results its arguments read, joined
    strings included, and hands the operator plain strings."""
    from airflow.sdk import DAG

    from launcher import result, step

    with DAG(dag_id="edges", schedule=None):
        first = step("first", "tasks.validate", [])
        second = step("second", "tasks.snapshot", [])
        reader = step("reader", "tasks.validate", ["--x", result(first, "report_uri"),
                                                   "--y", "k=" + result(second, "data_version", "tag")])
    assert reader.upstream_task_ids == {"first", "second"}
    assert [type(a) for a in reader.arguments] == [str] * 4
    assert reader.arguments[3] == "k={{ ti.xcom_pull(task_ids='second')['data_version']['tag'] }}"
    # formatted into a plain string the result would lose its edge: refused when the DAG is built
    with DAG(dag_id="lost", schedule=None):
        first = step("first", "tasks.validate", [])
        with pytest.raises(ValueError, match="reads first's result without its edge"):
            step("reader", "tasks.validate", ["--x", f"k={result(first, 'report_uri')}"])


def test_every_steps_arguments_parse_with_its_module() -> None:
    """The argv each task of every DAG renders, templates stood in for, through the step's own
    parser (in the runtime env): an argument the step does not know, or one after the wrong
    sub-command, fails here instead of at the end of a run."""
    from airflow.dag_processing.dagbag import DagBag

    calls = [(task.module, [re.sub(r"\{\{.*?\}\}", "1", str(arg)) for arg in task.arguments])
             for dag in DagBag(dag_folder=str(REPO_ROOT / "dags")).dags.values()
             for task in dag.tasks if getattr(task, "module", None) and isinstance(task.arguments, list)]
    assert {module for module, _ in calls} >= {"tasks.snapshot", "tasks.train", "tasks.deploy", "tasks.report",
                                               "tasks.replay", "tasks.seed"}
    code = ("import importlib, json, sys\n"
            "for module, argv in json.loads(sys.argv[1]):\n"
            "    step = importlib.import_module(module)\n"
            "    if hasattr(step, '__path__'):  # a package (tasks.train): python -m runs its __main__\n"
            "        step = importlib.import_module(module + '.__main__')\n"
            "    step.parser().parse_args(argv)")
    proc = subprocess.run([str(RUNTIME_PY), "-c", code, json.dumps(calls)], cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_approval_waits_for_a_person_and_its_answer_reaches_deploy_finish(dag: Any) -> None:
    """The human-in-the-loop task's result (a person's answer, or the default its timeout took:
    nobody, Roll back) as deploy_finish's ``--answer`` receives it: JSON, its time as text."""
    from airflow.sdk.definitions._internal.templater import SandboxedEnvironment

    pipeline = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    approve = dag.get_task("approve_rollout")
    assert approve.defaults == ["Roll back"] and set(approve.options) == {"Roll back", "Promote", "Extend"}
    assert approve.response_timeout == dt.timedelta(seconds=pipeline["canary"]["approval"]["timeout_s"])
    arguments = dag.get_task("deploy_finish").arguments
    template = arguments[arguments.index("--answer") + 1]
    answered_at = dt.datetime(2026, 11, 26, 4, 0, tzinfo=dt.UTC)
    for user, chosen in (({"id": "admin", "name": "admin"}, "Promote"), (None, "Roll back")):
        payload = {"chosen_options": [chosen], "params_input": {}, "responded_at": answered_at,
                   "responded_by_user": user}

        class TaskInstance:
            @staticmethod
            def xcom_pull(task_ids: str, payload: dict[str, Any] = payload) -> dict[str, Any]:
                assert task_ids == "approve_rollout"
                return payload

        rendered = json.loads(SandboxedEnvironment().from_string(template).render(ti=TaskInstance()))
        assert rendered == {"chosen_options": [chosen], "responded_by": user and user["name"],
                            "responded_at": "2026-11-26 04:00:00+00:00"}


def dag_with(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **approval: Any) -> Any:
    """The retrain DAG as a deployment's params.yaml (``canary.approval`` changed) makes it."""
    from airflow.dag_processing.dagbag import DagBag

    raw = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    raw["canary"]["approval"].update(approval)
    tmp_path.mkdir(parents=True)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.setenv("PIPELINE_PARAMS", str(tmp_path / "params.yaml"))
    bag = DagBag(dag_folder=str(REPO_ROOT / "dags" / "llm_retrain.py"))
    assert bag.import_errors == {}
    return bag.dags["llm_retrain"]


def run_conf_refusal(dag: Any, conf: dict[str, Any]) -> str | None:
    """The first line of what Airflow says when it creates a run of ``dag`` with ``conf`` (the
    trigger form, the REST API, the CLI, a backfill: ``create_dagrun`` validates the Params of the
    serialized DAG so); None when the run is created."""
    from airflow.sdk.exceptions import ParamValidationError
    from airflow.serialization.serialized_objects import DagSerialization

    try:
        DagSerialization.from_dict(DagSerialization.to_dict(dag)).params.deep_merge(conf).validate()
    except ParamValidationError as exc:
        return str(exc).splitlines()[0]
    return None


def test_a_run_may_tighten_the_gate_but_never_loosen_it_past_the_limits(dag: Any) -> None:
    """The gate's Params are bounded by params.yaml's evaluate.limits (the evaluate step checks them
    again: tests/tasks/test_config.py)."""
    from pipeline_params import pipeline_params

    limits = pipeline_params().evaluate.limits
    looser = {"max_regression": (limits.max_regression + 0.01, "greater than the maximum"),
              "max_eval_perplexity": (limits.max_eval_perplexity + 1, "greater than the maximum"),
              "min_eval_accuracy": (limits.min_eval_accuracy / 2, "less than the minimum")}
    for name, (value, how) in looser.items():
        assert run_conf_refusal(dag, {name: value}) == \
            f"Invalid input for param {name}: {value} is {how} of {getattr(limits, name)}"
    tighter = {"max_regression": 0.0, "max_eval_perplexity": 10, "min_eval_accuracy": 0.5}
    assert run_conf_refusal(dag, tighter) is None


def test_a_required_approval_cannot_be_switched_off_by_a_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    optional = dag_with(monkeypatch, tmp_path / "optional", required=False)
    assert optional.params["approval"] is False
    assert run_conf_refusal(optional, {"approval": False}) is None and run_conf_refusal(optional, {"approval": True}) is None
    required = dag_with(monkeypatch, tmp_path / "required", required=True)
    assert required.params["approval"] is True  # scheduled runs hold too
    assert run_conf_refusal(required, {"approval": False}) == "Invalid input for param approval: True was expected"
    assert run_conf_refusal(required, {"approval": True}) is None and run_conf_refusal(required, {}) is None
    assert "canary.approval.required" in required.params.get_param("approval").description
    # what deploy reads: the Param's value, which params.yaml's required overrides there too
    # (tests/tasks/test_config.py::test_a_required_approval_holds_whatever_the_run_says)
    arguments = required.get_task("deploy").arguments
    assert "approval.enabled={{ params.approval | tojson }}" in arguments


def approval_event(user: dict[str, str] | None, chosen: str = "Promote") -> dict[str, Any]:
    """What Airflow resumes the approval task with: a person's answer, or (None) the timeout's default."""
    return {"chosen_options": [chosen], "params_input": {}, "responded_by_user": user,
            "responded_at": dt.datetime(2026, 11, 26, 4, 0, tzinfo=dt.UTC)}


def run_context(triggered_by: str | None) -> dict[str, Any]:
    return {"dag_run": type("DagRun", (), {"triggering_user_name": triggered_by})()}


def test_only_the_approvers_and_never_the_triggering_user_may_approve(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    """The approval task assigns params.yaml's approvers (Airflow refuses anyone else); with
    four_eyes, less the user who triggered the run, and an answer of theirs that Airflow let
    through (no approvers listed, an auth manager that lets everyone answer) fails the task:
    deploy_finish never promotes on it."""
    from airflow.sdk.exceptions import AirflowFailException
    from approval import respondents

    admin, reviewer = {"id": "admin", "name": "admin"}, {"id": "reviewer", "name": "reviewer"}
    approve = dag_with(monkeypatch, tmp_path / "four-eyes", required=True, approvers=["admin", "reviewer"],
                       four_eyes=True).get_task("approve_rollout")
    assert approve.assigned_users == [admin, reviewer] and approve.four_eyes
    # who is asked, by who triggered the run (a scheduled run: nobody did)
    assert respondents(approve.assigned_users, "admin", four_eyes=True) == [reviewer]
    assert respondents(approve.assigned_users, None, four_eyes=True) == [admin, reviewer]
    assert respondents(approve.assigned_users, "admin", four_eyes=False) == [admin, reviewer]
    with pytest.raises(AirflowFailException, match=r"^canary.approval.approvers \['admin'\]: admin triggered this run"):
        respondents([admin], "admin", four_eyes=True)  # nobody left to answer: failed at once, not after the timeout
    # the answer, as Airflow hands it back: the triggering user's is refused, whatever the option
    for chosen in ("Promote", "Extend", "Roll back"):
        with pytest.raises(AirflowFailException, match=r"^the answer of admin is refused: they triggered this run"):
            approve.execute_complete(run_context("admin"), approval_event(admin, chosen))
    assert approve.execute_complete(run_context("admin"), approval_event(reviewer))["chosen_options"] == ["Promote"]
    assert approve.execute_complete(run_context("admin"), approval_event(None, "Roll back"))["responded_by_user"] is None
    assert approve.execute_complete(run_context(None), approval_event(admin))["chosen_options"] == ["Promote"]
    # anyone may answer where no approvers are listed; four_eyes still refuses the triggering user
    anyone = dag_with(monkeypatch, tmp_path / "anyone", approvers=[], four_eyes=True).get_task("approve_rollout")
    assert anyone.assigned_users is None and respondents([], "admin", four_eyes=True) == []
    with pytest.raises(AirflowFailException, match="the answer of admin is refused"):
        anyone.execute_complete(run_context("admin"), approval_event(admin))
    # without four_eyes the triggering user's answer counts (params.yaml's default: `make pipeline APPROVAL=true`)
    default = dag_with(monkeypatch, tmp_path / "default").get_task("approve_rollout")
    assert default.assigned_users is None and not default.four_eyes
    assert default.execute_complete(run_context("admin"), approval_event(admin))["chosen_options"] == ["Promote"]


def test_retries_with_backoff_from_params(dag: Any) -> None:
    import yaml

    pipeline = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())["pipeline"]
    for task in dag.tasks:
        assert task.retries == pipeline["retries"]
        assert task.retry_exponential_backoff
        assert task.retry_delay == dt.timedelta(seconds=pipeline["retry_delay_s"])
    # the schedule (asset or weekly time) is checked in test_llm_ingest.py


def test_params_are_typed_and_documented(dag: Any) -> None:
    for name in dag.params:
        param = dag.params.get_param(name)
        assert param.description and param.schema.get("title"), name
        assert "type" in param.schema, name
    assert dag.params["num_shards"] == 2 and dag.params["train_preset"] == "cpu-tiny"


def test_each_task_has_a_time_limit_and_scarce_steps_queue_in_pools(dag: Any) -> None:
    pipeline = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())["pipeline"]
    steps = [t for t in dag.tasks if t.task_id not in ("shard_plan", "deploy_gate", "approval_gate")]
    assert all(t.execution_timeout is not None for t in steps), [t.task_id for t in steps if not t.execution_timeout]
    pools = {t.task_id: t.pool for t in dag.tasks if t.pool != "default_pool"}
    assert pools == {"snapshot": "dvc_registry", "train": "training", "deploy": "serving_rollout",
                     "deploy_finish": "serving_rollout", "release_hold": "serving_rollout"}
    # the clean-up of a held rollout and the report: teardowns, whatever happened, the run's state left to the steps
    assert dag.get_task("release_hold").is_teardown and dag.get_task("report").is_teardown
    assert not dag.get_task("deploy").is_setup  # (a setup's skip would skip them)
    assert set(pools.values()) <= set(pipeline["pools"])  # created before the scheduler starts
    assert dag.get_task("train").priority_weight == dag.get_task("deploy").priority_weight == 10
    assert dag.get_task("snapshot").on_failure_callback and dag.on_failure_callback
    assert dag.dagrun_timeout == dt.timedelta(minutes=pipeline["deadline_min"])


def test_a_setting_param_is_the_settings_default_and_reaches_its_steps_as_set(dag: Any) -> None:
    """The Params that stand for settings (RUN_SETTINGS) default to params.yaml's values, and
    the `--set` each carries to the steps of its section, rendered with that default, is read
    back by the settings as the same value: a Param whose key or type drifts from its setting
    fails here, not at the end of a run."""
    from airflow.sdk.definitions._internal.templater import SandboxedEnvironment

    from tasks.config import load

    sys.path.insert(0, str(REPO_ROOT / "dags"))
    from llm_retrain import RUN_SETTINGS

    settings = load()
    steps = {"tokenize": ["tokenizer"], "train": ["train"], "evaluate": ["evaluate"], "canary": ["deploy", "deploy_finish"]}
    defaults = {name: dag.params[name] for name in dag.params}
    for name, setting in RUN_SETTINGS.items():
        value: Any = settings
        for part in setting.setting.split("."):
            value = getattr(value, part)
        expected = list(value) if isinstance(value, tuple) else (value or None if setting.nullable else value)
        if name != "approval":  # its default: enabled or required (canary.approval.active)
            assert defaults[name] == expected, name
        if setting.set_key is None:
            continue
        for task_id in steps[setting.section]:
            arguments = dag.get_task(task_id).arguments
            rendered = [SandboxedEnvironment().from_string(str(arg)).render(params=defaults)
                        for arg in arguments if f"params.{name} " in str(arg)]
            assert len(rendered) == 1 and rendered[0].startswith(f"{setting.set_key}="), (task_id, name, rendered)
            read = load(section=setting.section, overrides=rendered)
            got: Any = read
            for part in setting.setting.split("."):
                got = getattr(got, part)
            assert (list(got) if isinstance(got, tuple) else got) == defaults[name], (task_id, name, rendered)


@pytest.mark.parametrize(
    ("name", "value"),
    [("num_shards", 0), ("train_preset", "gpu-7b"), ("train_engine", "horovod"), ("train_precision", "fp16"), ("train_nodes", 0),
     ("max_regression", 1.5), ("min_eval_accuracy", -0.1), ("canary_steps", [0, 100]), ("canary_steps", []),
     ("skip_deploy", "yes"), ("end_date", "2026-13-01"), ("raw_data_uri", "ftp://x")],
)
def test_the_trigger_form_refuses_a_bad_value(dag: Any, name: str, value: Any) -> None:
    """Airflow checks a run's conf against these schemas before any task starts."""
    from airflow.sdk.exceptions import ParamValidationError

    with pytest.raises(ParamValidationError):
        dag.params.get_param(name).resolve(value)


@contextlib.contextmanager
def webhook_receiver() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A local HTTP server that records the JSON bodies POSTed to it (an alert webhook)."""
    received: list[dict[str, Any]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hooks/alerts", received
    finally:
        server.shutdown()


def test_a_run_past_its_time_limit_posts_one_alert_line() -> None:
    from alerts import on_run_failure

    run = type("Run", (), {"dag_id": "llm_retrain", "run_id": "scheduled__2026-11-22"})()
    with webhook_receiver() as (url, received), pytest.MonkeyPatch.context() as patch:
        patch.setenv("PIPELINE_ALERT_WEBHOOK_URL", url)
        on_run_failure({"dag_run": run, "reason": "timed_out"})
        on_run_failure({"dag_run": run, "reason": "task_failure"})  # its failed task alerted already
    assert received == [{"text": "ALERT llm_retrain run scheduled__2026-11-22: not finished within its time limit "
                                 "(timed_out): failed by the scheduler",
                         "event": "run_timed_out", "dag_id": "llm_retrain", "run_id": "scheduled__2026-11-22"}]


def test_an_unreachable_webhook_does_not_fail_the_callback(monkeypatch: pytest.MonkeyPatch) -> None:
    from alerts import post

    monkeypatch.setenv("PIPELINE_ALERT_WEBHOOK_URL", "http://127.0.0.1:9/nothing-listens")
    assert post({"text": "x"}, timeout_s=2) is False




@pytest.mark.integration
def test_pipeline_runs_end_to_end(retrain_run: Any) -> None:
    run = retrain_run  # tests/dags/conftest.py: the run the DAG modules share
    states = ti_states(run)
    assert run.state == "success", states
    # approval off (the default): deploy promotes, the approval's tasks are skipped, its teardown finds no hold
    assert states == {**{t: "success" for t in ORDER if t != "tokenize_shard"},
                      "tokenize_shard[0]": "success", "tokenize_shard[1]": "success",
                      "approve_rollout": "skipped", "deploy_finish": "skipped",
                      "drift_recheck": "skipped"}  # not started by the drift check: nothing to check again
    assert xcom(run, "release_hold") == {"released": None}  # nothing held
    merged = xcom(run, "tokenize_merge")
    assert merged["tokens"]["train"] > 100_000 and merged["dtype"] == "uint16"
    run_key = run.run_id.replace(":", "-").replace("+", "_")
    assert merged["dataset_uri"] == f"s3://pipeline/runs/llm_retrain/{run_key}/tokenize/dataset"
    trained = xcom(run, "train")
    assert trained["world_size"] == 2 and trained["steps"] == 60  # 2 local nodes, FSDP2
    assert trained["model_uri"] == f"s3://pipeline/runs/llm_retrain/{run_key}/train/model"
    assert trained["final_loss"] < 8.0 and trained["mlflow_run_id"]
    registered = xcom(run, "register")
    assert registered["challenger"] == registered["version"] and registered["new"] is True
    # the registry as the MLflow REST API reports it (no mlflow client in this environment)
    # (by number: a later test's run may have registered a newer challenger since)
    version = mlflow_rest(f"/api/2.0/mlflow/model-versions/get?name=llm-retrain&version={registered['version']}"
                          )["model_version"]
    tags = {t["key"]: t["value"] for t in version["tags"]}
    assert tags["dag_run"] == f"llm_retrain/{run.run_id}"
    assert tags["data_version"].startswith("data-2026-11-22-7d-") and tags["dag_id"] == "llm_retrain"
    # exported (parity checked), canaried and promoted: the model serves through the router
    exported = xcom(run, "export")
    assert exported["version"] == registered["version"] and exported["parity"]["max_abs_logit_diff"] < 1e-3
    deployed = xcom(run, "deploy")
    assert deployed["verdict"] == "promoted" and deployed["aliases"]["champion"] == registered["version"]
    with urllib.request.urlopen(f"{os.environ['ROUTER_URL']}/router/state", timeout=60) as resp:
        assert json.loads(resp.read())["demo"]["stable"] == int(registered["version"])
    # the run report: the summary `make pipeline` ends with, a JSON report and an HTML page
    report = xcom(run, "report")
    assert report["verdict"] == "success" and report["report_uri"].endswith(f"{run_key}/report/report.html")
    # (`show` prints the newest run's: this run's folder, as a later test's run may be newer)
    shown = subprocess.run([str(RUNTIME_PY), "-m", "tasks.report", "show", "--root", report["report_uri"].rsplit(
        "/report/", 1)[0]], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
    assert f"SUCCESS: version {registered['version']} serves as champion" in shown, shown
    for label in ("data ", "validation ", "tokens ", "training ", "evaluation ", "registered ", "canary ", "try it"):
        assert f"  {label}" in shown, (label, shown)
    assert "make predict" in shown and report["report_uri"] in shown and report["mlflow_run"] in shown
    # Prometheus: the run's figures (pushed by the report) and Triton's latency quantiles per version
    assert prometheus_value(f'llm_pipeline_run_success{{line="demo", dag_id="llm_retrain", run_id="{run.run_id}"}}') == 1.0
    assert prometheus_value(f'llm_pipeline_registered_version{{run_id="{run.run_id}"}}') == float(registered["version"])
    p99 = f'nv_inference_request_summary_us{{model="llm", version="{registered["version"]}", quantile="0.99"}}'
    assert prometheus_value(f"count({p99})") >= 1.0


def prometheus_value(expr: str, timeout_s: float = 60) -> float:
    """The value of a one-series query, waiting for the next scrape (every 5 s locally)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = prometheus_query(expr)["data"]["result"]
        if result:
            return float(result[0]["value"][1])
        assert time.monotonic() < deadline, f"Prometheus has no {expr}"
        time.sleep(1)


def test_rollback_dag_takes_a_target_param() -> None:
    from airflow.dag_processing.dagbag import DagBag

    rollback = DagBag(dag_folder=str(REPO_ROOT / "dags")).dags["llm_rollback"]
    assert [t.task_id for t in rollback.tasks] == ["rollback"] and rollback.schedule is None
    assert rollback.params["target"] == "previous"
    assert rollback.get_task("rollback").arguments == ["rollback", "--target", "{{ params.target }}"]
    # in the canary's pool: a rollback never moves traffic while a canary is being analysed
    assert rollback.get_task("rollback").pool == "serving_rollout"
    assert rollback.get_task("rollback").execution_timeout is not None


@pytest.mark.integration
def test_bad_data_stops_the_run_before_tokenization(dag: Any, airflow_db: None, stack_env: dict[str, str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    with webhook_receiver() as (url, received):
        monkeypatch.setenv("PIPELINE_ALERT_WEBHOOK_URL", url)
        run = dag.test(
            logical_date=dt.datetime(2026, 11, 8, 6, tzinfo=dt.UTC),
            run_conf={"raw_data_uri": "s3://raw/no-such-source"},
        )
    # the failed task's alert reached the webhook: one line naming the task and the error
    assert [a["task_id"] for a in received] == ["snapshot"], received
    assert received[0]["text"].startswith(f"ALERT llm_retrain run {run.run_id}: task snapshot failed")
    assert "s3://raw/no-such-source" in received[0]["text"]
    states = ti_states(run)
    assert run.state == "failed"
    assert states["snapshot"] == "failed"
    assert {states[t] for t in ORDER[1:-3] if t in states} <= {"upstream_failed", None}
    assert states["drift_recheck"] == "skipped"  # after the rollout, however it ended: no drift to check
    assert states["release_hold"] == "success" and xcom(run, "release_hold") == {"released": None}  # a teardown
    # the report still runs (a teardown) and says where the run stopped; the run stays failed
    assert states["report"] == "success" and xcom(run, "report")["verdict"] == "failed"
    # ... and why, in the step's own words
    outcome = xcom(run, "report")["outcome"]
    assert outcome.startswith("failed at snapshot: ERROR python -m tasks.snapshot: ") and "s3://raw/no-such-source" in outcome
