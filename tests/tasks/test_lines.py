"""Model lines (tasks/config/lines.py): a line is params.yaml with its file merged over it, built
and checked the same way; a bad line file is refused with one line naming it and the key; no two
lines share what keeps their runs apart; a step process reads the line PIPELINE_LINE names."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import REPO_ROOT, RUNTIME_PY

from tasks.config import DEMO, SettingsError, every_line, lines, load

SUPPORT = {
    "pipeline": {"model_name": "support-bot", "raw_data_uri": "s3://raw/support", "tasks": {"train": {"timeout_min": 90}}},
    "train": {"preset": "cpu-small", "max_steps": 50,
              "presets": {"cpu-mini": {"seq_len": 64, "d_model": 64, "n_layers": 2, "n_heads": 2}}},
    "evaluate": {"suite": {"tasks": {"demo_next_word": None}}},  # null: the line does without the demo's task
}


@pytest.fixture
def lines_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "lines"
    folder.mkdir()
    (folder / "support.yaml").write_text(yaml.safe_dump(SUPPORT))
    (folder / "README.md").write_text("not a line")
    monkeypatch.setenv("PIPELINE_LINES_DIR", str(folder))
    monkeypatch.delenv("PIPELINE_LINE", raising=False)
    return folder


def test_a_line_is_params_yaml_with_its_file_merged_over_it(lines_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    demo, support = load(), load(line="support")
    assert lines() == ["support"] and load(line=DEMO) is demo
    # what the file says
    assert (support.pipeline.model_name, support.pipeline.raw_data_uri) == ("support-bot", "s3://raw/support")
    assert (support.train.preset, support.train.max_steps) == ("cpu-small", 50)
    assert support.train.model == demo.train.presets["cpu-small"]
    # a mapping of named entries merges entry by entry: a new preset beside the demo's, one
    # task's time limit changed and its pool kept, a suite task removed by null
    assert set(support.train.presets) == {*demo.train.presets, "cpu-mini"}
    assert support.pipeline.tasks["train"].timeout_min == 90
    assert support.pipeline.tasks["train"].pool == demo.pipeline.tasks["train"].pool == "training"
    assert support.pipeline.tasks["snapshot"] == demo.pipeline.tasks["snapshot"]
    assert list(support.evaluate.suite.tasks) == ["demo_continuation_choice"]
    # what it does not say: the demo line's, but for the names that keep it apart (derived)
    assert support.canary == demo.canary and support.train.lr == demo.train.lr
    assert support.pipeline.dag_id == "llm_retrain__support"
    assert support.pipeline.raw_data_asset == "raw_text__support"
    assert support.snapshot.tag_prefix == "data-support-" and support.train.experiment == "llm-retrain-support"
    # the demo line is params.yaml alone, whatever the line files say
    assert (demo.pipeline.model_name, demo.train.preset, demo.pipeline.dag_id) == ("llm-retrain", "cpu-tiny", "llm_retrain")
    # a process reads the line PIPELINE_LINE names; a step's --set applies over the line's
    monkeypatch.setenv("PIPELINE_LINE", "support")
    assert load() is support
    assert load(section="train", overrides=["max_steps=7"]).train.max_steps == 7
    assert load(section="train", overrides=["max_steps=7"]).train.preset == "cpu-small"
    assert set(every_line()) == {DEMO, "support"}


def test_a_line_file_naming_every_apart_setting_keeps_its_own(lines_dir: Path) -> None:
    (lines_dir / "legal.yaml").write_text(yaml.safe_dump({
        "pipeline": {"dag_id": "legal_retrain", "model_name": "legal", "raw_data_uri": "s3://legal/raw",
                     "raw_data_asset": "legal_text"},
        "snapshot": {"tag_prefix": "legal-"}, "train": {"experiment": "legal"}}))
    legal = load(line="legal")
    assert (legal.pipeline.dag_id, legal.pipeline.model_name, legal.pipeline.raw_data_uri, legal.pipeline.raw_data_asset,
            legal.snapshot.tag_prefix, legal.train.experiment) == (
        "legal_retrain", "legal", "s3://legal/raw", "legal_text", "legal-", "legal")
    assert list(every_line()) == [DEMO, "legal", "support"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("- train\n", "{file}: expected a mapping of sections (pipeline:, train: ...), got ['train']"),
        ("trian: {lr: 0.1}\n", "{file}: trian: unknown setting (known: pipeline, ingest,"),
        ("train: {learning_rate: 0.1}\n", "{file}: train.learning_rate: unknown setting (known: preset, engine,"),
        ("canary: {approval: {enable: true}}\n", "{file}: canary.approval.enable: unknown setting"),
        ("train: 3\n", "{file}: train: expected a section (a mapping), got 3"),
        ("train: {lr: fast}\n", "{file}: train.lr 'fast': expected number"),  # checked as params.yaml is
        ("train: {preset: gpu-7b}\n", "{file}: train.preset 'gpu-7b': expected one of cpu-tiny"),
        ("train: {presets: {cpu-mini: {seq_len: 64}}}\n", "{file}: train.presets.cpu-mini.d_model: missing"),
        ("pipeline: {tasks: {train: {pool: gpus}}}\n", "{file}: pipeline.tasks.train.pool 'gpus': expected one of pools"),
        ("train: {lr: [\n", "{file}: invalid YAML"),
    ],
)
def test_a_bad_line_file_is_refused_with_one_line_naming_it_and_the_key(lines_dir: Path, content: str,
                                                                        message: str) -> None:
    file = lines_dir / "support.yaml"
    file.write_text(content)
    with pytest.raises(SettingsError) as refused:
        load(line="support")
    assert str(refused.value).startswith(message.format(file=file)), str(refused.value)
    assert "\n" not in str(refused.value)


def test_an_unknown_line_or_a_badly_named_file_is_refused(lines_dir: Path) -> None:
    with pytest.raises(SettingsError, match=r"^PIPELINE_LINE='sales': no line file .*/lines/sales.yaml \(lines there: support\)$"):
        load(line="sales")
    (lines_dir / "Sales.yaml").write_text("{}\n")
    with pytest.raises(SettingsError, match=r"/lines/Sales.yaml: a line's name is lowercase letters"):
        lines()
    (lines_dir / "Sales.yaml").unlink()
    (lines_dir / "empty.yaml").write_text("")  # an empty file: the demo's settings, its own names
    assert load(line="empty").pipeline.model_name == "llm-retrain-empty"


@pytest.mark.parametrize(
    ("key", "value", "owner"),
    [
        ("pipeline.model_name", "llm-retrain", "the demo line (params.yaml)"),
        ("pipeline.dag_id", "llm_retrain", "the demo line (params.yaml)"),
        ("pipeline.raw_data_uri", "s3://raw/text", "the demo line (params.yaml)"),
        ("snapshot.tag_prefix", "data-", "the demo line (params.yaml)"),
        ("pipeline.model_name", "support-bot", "line 'support'"),
        ("pipeline.raw_data_asset", "raw_text__support", "line 'support'"),
    ],
)
def test_lines_that_share_what_keeps_them_apart_are_refused(lines_dir: Path, key: str, value: str, owner: str) -> None:
    section, name = key.split(".")
    (lines_dir / "zeta.yaml").write_text(yaml.safe_dump({section: {name: value}}))
    load(line="zeta")  # a line alone is fine: the collision is between lines
    with pytest.raises(SettingsError) as refused:
        every_line()
    assert str(refused.value) == (f"{lines_dir / 'zeta.yaml'}: {key} {value!r} is {owner}"
                                  f"{' (' + str(lines_dir / 'support.yaml') + ')' if owner.startswith('line') else ''}"
                                  "'s too: each line needs its own")


def test_a_pool_two_lines_name_is_defined_once(lines_dir: Path) -> None:
    (lines_dir / "zeta.yaml").write_text(yaml.safe_dump({"pipeline": {"pools": {"training": {"slots": 4}}}}))
    with pytest.raises(SettingsError, match=r"zeta.yaml: pipeline.pools.training differs from the demo line"):
        every_line()
    (lines_dir / "zeta.yaml").unlink()  # (a file is read once per process: another line)
    (lines_dir / "omega.yaml").write_text(yaml.safe_dump({"pipeline": {"pools": {"omega_gpus": {
        "slots": 2, "description": "omega's own"}}, "tasks": {"train": {"pool": "omega_gpus"}}}}))
    assert every_line()["omega"].pipeline.tasks["train"].pool == "omega_gpus"


def run_config(env: dict[str, str], *code: str) -> subprocess.CompletedProcess[str]:
    command = [str(RUNTIME_PY), "-c", code[0]] if code else [str(RUNTIME_PY), "-m", "tasks.config"]
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"], **env})


def test_a_step_process_reads_the_line_pipeline_line_names(lines_dir: Path) -> None:
    env = {"PIPELINE_LINES_DIR": str(lines_dir), "PIPELINE_LINE": "support"}
    checked = run_config(env)
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.splitlines()[:2] == [f"{REPO_ROOT / 'params.yaml'}: ok", f"{lines_dir / 'support.yaml'}: ok"]
    # what a step reads: its section's settings (with its --set) and the line's names
    read = run_config(env, "from tasks.lib.params import load_settings; s = load_settings('train', ['lr=0.01']); "
                           "print(s.pipeline.model_name, s.train.preset, s.train.lr, s.snapshot.tag_prefix)")
    assert read.stdout.split() == ["support-bot", "cpu-small", "0.01", "data-support-"], read.stderr
    demo = run_config({"PIPELINE_LINES_DIR": str(lines_dir), "PIPELINE_LINE": ""},
                      "from tasks.config import load; print(load().pipeline.model_name)")
    assert demo.stdout.split() == ["llm-retrain"], demo.stderr
    unknown = run_config({**env, "PIPELINE_LINE": "sales"})
    assert unknown.returncode == 2
    assert unknown.stderr.splitlines() == [
        f"ERROR PIPELINE_LINE='sales': no line file {lines_dir / 'sales.yaml'} (lines there: support)"]
    (lines_dir / "zeta.yaml").write_text("pipeline: {model_name: support-bot}\n")  # every line is checked
    shared = run_config(env)
    assert shared.returncode == 2 and shared.stderr.splitlines() == [
        f"ERROR {lines_dir / 'zeta.yaml'}: pipeline.model_name 'support-bot' is line 'support' "
        f"({lines_dir / 'support.yaml'})'s too: each line needs its own"]


def test_make_targets_read_a_lines_dag_id_and_raw_data(lines_dir: Path) -> None:
    """``make retrain/import/replay/report LINE=support``: their commands get PIPELINE_LINE=support
    (none: the demo line's, whatever the caller's environment holds), the line's settings read by
    ``python -m tasks.config --get`` (a section or unknown key: exit 2, one line); the demo-only
    targets refuse a LINE."""
    env = {"PATH": os.environ["PATH"], "PIPELINE_LINES_DIR": str(lines_dir), "PIPELINE_LINE": "support"}

    def get(key: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(RUNTIME_PY), "-m", "tasks.config", "--get", key], cwd=REPO_ROOT, capture_output=True,
                              text=True, env=env)

    got = [get(key) for key in ("pipeline.dag_id", "pipeline.raw_data_uri", "canary.steps")]
    assert [g.stdout for g in got] == ["llm_retrain__support\n", "s3://raw/support\n", "[10, 50, 100]\n"], got
    for key, problem in (("pipeline", "a section, not a setting"), ("pipeline.nope", "no such setting")):
        bad = get(key)
        assert bad.returncode == 2 and bad.stderr.splitlines() == [f"ERROR --get {key}: {problem}"]

    def dry_run(*target: str) -> subprocess.CompletedProcess[str]:  # what make would run (make -n), the caller's
        return subprocess.run(["make", "-n", *target], cwd=REPO_ROOT, text=True, capture_output=True,  # line set aside
                              env={**os.environ, "PIPELINE_LINE": "elsewhere"}, timeout=60)

    imported = dry_run("import", "SOURCE=corpus.jsonl", "LINE=support").stdout
    assert "PIPELINE_LINE=support .venvs/runtime/bin/python -m tasks.config --get pipeline.raw_data_uri" in imported
    assert "PIPELINE_LINE=support .venvs/runtime/bin/python -m tasks.ingest import" in imported, imported
    replayed = dry_run("replay", "VERSION=2", "LINE=support").stdout
    assert "PIPELINE_LINE=support .venvs/orchestrator/bin/airflow dags test llm_replay__support " in replayed, replayed
    reported = dry_run("report", "LINE=support").stdout
    assert "PIPELINE_LINE=support LOG_LEVEL=WARNING .venvs/runtime/bin/python -m tasks.report show" in reported
    assert "PIPELINE_LINE= LOG_LEVEL=WARNING" in dry_run("report").stdout  # no LINE: the demo line, not the caller's
    predicted = dry_run("predict", "LINE=support").stdout  # the request names the line's model
    assert "PIPELINE_LINE=support .venvs/runtime/bin/python -m stack predict" in predicted, predicted
    assert '-m stack predict "Return the number of" --model "support-bot"' in dry_run("predict", "MODEL=support-bot").stdout
    refused = subprocess.run(["make", "drift", "LINE=support"], cwd=REPO_ROOT, text=True, capture_output=True,
                             timeout=60)
    assert refused.returncode == 2 and refused.stderr.splitlines()[0] == (
        "make drift runs the demo line; LINE= is for retrain, import, replay, report and predict")


def test_the_repository_ships_no_line() -> None:
    """The demo line is params.yaml alone: lines/ holds the format's README, no line (users get no extra DAG)."""
    assert list((REPO_ROOT / "lines").glob("*.yaml")) == []
    assert (REPO_ROOT / "lines" / "README.md").is_file()


@pytest.mark.parametrize(
    ("serve", "message"),
    [
        ({"triton_model": "llm_generate"},
         "line 'zeta' ({file}): serve.triton_model 'llm_generate' is a Triton model of the demo line (params.yaml) too"),
        ({"triton_model": "one", "generate_model": "one"},
         "line 'zeta' ({file}): serve.triton_model and serve.generate_model are both 'one'"),
        ({"memory_budget_mb": 1},
         "line 'zeta' ({file}): serve.memory_budget_mb 1 differs from params.yaml's 16384: one Triton, one budget"),
    ],
)
def test_one_triton_serves_every_line(lines_dir: Path, serve: dict[str, Any], message: str) -> None:
    """Triton's model names are one namespace across lines (nginx routes a model to its line's
    split: a name in two lines would be two routes), and its memory has one budget."""
    (lines_dir / "zeta.yaml").write_text(yaml.safe_dump({"serve": serve}))
    with pytest.raises(SettingsError) as refused:
        every_line()
    assert str(refused.value).startswith(message.format(file=lines_dir / "zeta.yaml")), str(refused.value)
