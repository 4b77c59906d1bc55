"""Model lines on the Airflow side: a line file adds its retrain, rollback and replay DAGs, built
by the same builders from the line's settings, their steps told their line (PIPELINE_LINE); the
demo line's DAGs stay what they were; lines that collide are refused when the DAG files load."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import REPO_ROOT, RUNTIME_PY

SUPPORT = {"pipeline": {"model_name": "support-bot", "raw_data_uri": "s3://raw/support"},
           "train": {"preset": "cpu-small", "presets": {"cpu-mini": {"seq_len": 64, "d_model": 64, "n_layers": 2,
                                                                     "n_heads": 2}}}}
PER_LINE = ("llm_retrain", "llm_rollback", "llm_replay")


def dag_bag(lines_dir: Path) -> Any:
    from airflow.dag_processing.dagbag import DagBag

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PIPELINE_LINES_DIR", str(lines_dir))
        return DagBag(dag_folder=str(REPO_ROOT / "dags"))


@pytest.fixture(scope="module")
def lines_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("lines")
    (folder / "support.yaml").write_text(yaml.safe_dump(SUPPORT))
    return folder


@pytest.fixture(scope="module")
def dags(lines_dir: Path) -> Iterator[dict[str, Any]]:
    bag = dag_bag(lines_dir)
    assert bag.import_errors == {}
    yield dict(bag.dags)


def test_a_line_file_adds_its_own_retrain_rollback_and_replay_dags(dags: dict[str, Any]) -> None:
    assert set(dags) == {*PER_LINE, *(f"{dag_id}__support" for dag_id in PER_LINE), "llm_drift", "llm_ingest"}
    for dag_id in PER_LINE:
        demo, support = dags[dag_id], dags[f"{dag_id}__support"]
        # the same builder: the same tasks, wired the same way
        assert {t.task_id: t.upstream_task_ids for t in demo.tasks} == {t.task_id: t.upstream_task_ids for t in support.tasks}
        assert "line:support" in support.tags and not any(tag.startswith("line:") for tag in demo.tags)
        # every step knows its line: a local process or a pod reads that line's settings
        for dag, line in ((demo, ""), (support, "support")):
            envs = [getattr(t, "env_vars", None) or t.partial_kwargs["env_vars"] for t in dag.tasks
                    if getattr(t, "module", None) or "env_vars" in getattr(t, "partial_kwargs", {})]
            assert envs and all(env["PIPELINE_LINE"] == line for env in envs), (dag.dag_id, envs)


def test_the_lines_dag_reads_its_settings(dags: dict[str, Any]) -> None:
    from airflow.sdk.definitions._internal.templater import SandboxedEnvironment

    demo, support = dags["llm_retrain"], dags["llm_retrain__support"]
    # the trigger form's defaults and choices are the line's
    assert (demo.params["raw_data_uri"], demo.params["train_preset"]) == ("s3://raw/text", "cpu-tiny")
    assert (support.params["raw_data_uri"], support.params["train_preset"]) == ("s3://raw/support", "cpu-small")
    assert "cpu-mini" in support.params.get_param("train_preset").schema["enum"]
    assert "cpu-mini" not in demo.params.get_param("train_preset").schema["enum"]
    # one API serves every line: a line's run deploys its model as the demo line's does
    assert (demo.params["skip_deploy"], support.params["skip_deploy"]) == (False, False)
    # its raw data Asset schedules it, not the demo line's
    assets = {dag.dag_id: {(a.name, a.uri) for a in dag.timetable.asset_condition.objects} for dag in (demo, support)}
    assert assets == {"llm_retrain": {("raw_text", "s3://raw/text")},
                      "llm_retrain__support": {("raw_text__support", "s3://raw/support")}}
    # its registered model, named to the person approving a rollout and on the rollback form
    assert "support-bot" in support.get_task("approve_rollout").subject
    assert "support-bot" in dags["llm_rollback__support"].params.get_param("target").description
    assert "support-bot" in dags["llm_replay__support"].params.get_param("version").description
    # its run folders: below its own DAG id
    for dag in (demo, support):
        arguments = dag.get_task("snapshot").arguments
        output = arguments[arguments.index("--output") + 1]
        rendered = SandboxedEnvironment().from_string(output).render(dag=dag, run_id="manual__1")
        assert rendered == f"s3://pipeline/runs/{dag.dag_id}/manual__1/snapshot"


def test_every_step_of_a_lines_dags_parses_with_its_module(dags: dict[str, Any]) -> None:
    """As tests/dags/test_llm_retrain.py checks the demo line's: each argv through its step's parser."""
    calls = [(task.module, [re.sub(r"\{\{.*?\}\}", "1", str(arg)) for arg in task.arguments])
             for dag_id, dag in dags.items() if dag_id.endswith("__support")
             for task in dag.tasks if getattr(task, "module", None) and isinstance(task.arguments, list)]
    assert {module for module, _ in calls} >= {"tasks.snapshot", "tasks.train", "tasks.deploy", "tasks.report",
                                               "tasks.replay"}
    code = ("import importlib, json, sys\n"
            "for module, argv in json.loads(sys.argv[1]):\n"
            "    step = importlib.import_module(module)\n"
            "    if hasattr(step, '__path__'):\n"
            "        step = importlib.import_module(module + '.__main__')\n"
            "    step.parser().parse_args(argv)")
    proc = subprocess.run([str(RUNTIME_PY), "-c", code, json.dumps(calls)], cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_step_of_the_lines_dag_reads_the_lines_settings(dags: dict[str, Any], lines_dir: Path) -> None:
    """The environment the launcher gives a local step process, with a worker whose own
    environment names another line: the step reads the line of its DAG."""
    code = "from tasks.config import load; s = load(); print(s.pipeline.model_name, s.train.preset)"
    for dag_id, expected in (("llm_retrain", "llm-retrain cpu-tiny"), ("llm_retrain__support", "support-bot cpu-small")):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("PIPELINE_LINES_DIR", str(lines_dir))
            patch.setenv("PIPELINE_LINE", "elsewhere")  # the worker's: no such line
            env = dags[dag_id].get_task("snapshot").process_env()
        proc = subprocess.run([str(RUNTIME_PY), "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, env=env)
        assert proc.stdout.strip() == expected, proc.stderr[-2000:]


def test_lines_that_collide_are_refused_when_the_dags_load(tmp_path: Path) -> None:
    (tmp_path / "support.yaml").write_text(yaml.safe_dump({"pipeline": {"model_name": "llm-retrain"}}))
    errors = dag_bag(tmp_path).import_errors
    assert {Path(file).name for file in errors} == {"llm_retrain.py", "llm_rollback.py", "llm_replay.py"}
    for error in errors.values():
        assert (f"SettingsError: {tmp_path / 'support.yaml'}: pipeline.model_name 'llm-retrain' is the demo line "
                "(params.yaml)'s too: each line needs its own") in error
