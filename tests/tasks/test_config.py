"""The typed settings (tasks/config/): params.yaml is read and checked once; a setting that
cannot be used is refused naming it; the configuration reference is what the dataclasses say."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers import REPO_ROOT, RUNTIME_PY

from tasks.config import (
    CanarySettings,
    Settings,
    SettingsError,
    TrainSettings,
    build,
    choices,
    load,
    read_yaml,
    with_reference,
)


def test_params_yaml_builds_typed_settings() -> None:
    settings = load()
    assert isinstance(settings, Settings)
    assert settings.train.model == settings.train.presets[settings.train.preset]
    assert isinstance(settings.train.lr, float) and isinstance(settings.train.betas, tuple)
    assert isinstance(settings.serve.queue.max_size, int)
    assert load() is settings  # read once per process


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["engine=tpu"], "train.engine 'tpu': expected one of fsdp2, ddp, deepspeed, single"),
        (["lr=fast"], "train.lr 'fast': expected number"),
        (["lr=3e-4x"], "train.lr '3e-4x': expected number"),
        (["lr=-1"], "train.lr -1.0: expected >= 0"),
        (["max_steps=1.5"], "train.max_steps 1.5: expected integer"),
        (["async_checkpoint=1"], "train.async_checkpoint 1: expected true | false"),  # a bool is only a bool
        (["compile=sometimes"], "train.compile 'sometimes': expected true | false | auto"),
        (["deepspeed_stage=1"], "train.deepspeed_stage 1: expected one of 2, 3"),
        (["betas=[0.9]"], "train.betas [0.9]: expected [number, number]"),
        (["preset=huge"], "train.preset 'huge': expected one of cpu-tiny"),
        (["presets.cpu-tiny.n_heads=3"], "train.presets.cpu-tiny.d_model 128: not divisible by n_heads 3"),
        (["learning_rate=1"], "--set 'learning_rate=1': unknown setting train.learning_rate"),
        (["lr"], "--set 'lr': expected KEY=VALUE"),
    ],
)
def test_a_setting_that_cannot_be_used_is_refused_naming_it(overrides: list[str], message: str) -> None:
    with pytest.raises(SettingsError) as refused:
        load(section="train", overrides=overrides)
    assert message in str(refused.value)


def test_overrides_apply_to_the_step_section_only_and_parse_as_yaml() -> None:
    settings = load(section="train", overrides=["micro_batch=2", "presets.cpu-tiny.n_layers=2", "compile=true",
                                                "lr=3e-4"])  # YAML 1.1 reads 3e-4 as a string: still a number
    assert settings.train.micro_batch == 2 and settings.train.model.n_layers == 2 and settings.train.compile is True
    assert settings.train.lr == 0.0003
    assert load().train.micro_batch != 2 or load().train.model.n_layers != 2  # the file itself is untouched


def test_unknown_and_missing_keys_are_refused_in_the_file(tmp_path: Path) -> None:
    raw = read_yaml(REPO_ROOT / "params.yaml")
    raw["canary"]["step_duration"] = 8  # a misspelt key
    with pytest.raises(SettingsError, match=r"canary.step_duration: unknown setting"):
        build(Settings, raw)
    del raw["canary"]["step_duration"]
    del raw["train"]["seed"]
    with pytest.raises(SettingsError, match=r"^train.seed: missing$"):
        build(Settings, raw)


@pytest.mark.parametrize(
    ("section", "change", "message"),
    [
        ("canary", {"steps": [50, 10, 100]}, "canary.steps (50, 10, 100): expected rising percentages ending at 100"),
        ("canary", {"steps": [10, 50]}, "expected rising percentages ending at 100"),
        ("tokenize", {"num_shards": 3}, "repro.shards ('00000', '00001'): expected one per tokenize.num_shards (3)"),
        ("validate", {"min_records": 10, "max_records": 5}, "validate.min_records 10: expected 0 <= min <= max_records"),
        ("pipeline", {"start_date": "November"}, "pipeline.start_date 'November': expected a date, YYYY-MM-DD"),
    ],
)
def test_checks_across_settings(section: str, change: dict[str, object], message: str) -> None:
    raw = read_yaml(REPO_ROOT / "params.yaml")
    raw[section].update(change)
    with pytest.raises(SettingsError) as refused:
        build(Settings, raw)
    assert message in str(refused.value)


def test_the_namespaces_of_airflow_and_the_steps_must_differ() -> None:
    raw = read_yaml(REPO_ROOT / "params.yaml")
    raw["launcher"]["kubernetes"]["airflow_namespace"] = raw["launcher"]["kubernetes"]["namespace"]
    with pytest.raises(SettingsError, match=r"launcher.kubernetes.airflow_namespace .*must not be the steps' namespace"):
        build(Settings, raw)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("max_regression=0.06", "evaluate.max_regression 0.06: looser than limits.max_regression (0.05): a run may "
                                "tighten the gate, never loosen it"),
        ("max_eval_perplexity=1e9", "evaluate.max_eval_perplexity 1000000000.0: looser than limits.max_eval_perplexity "
                                    "(2000)"),
        ("min_eval_accuracy=0", "evaluate.min_eval_accuracy 0.0: looser than limits.min_eval_accuracy (0.05)"),
    ],
)
def test_a_gate_looser_than_its_limit_is_refused_in_the_step(override: str, message: str) -> None:
    """What the evaluate step reads from the DAG's Params (``--set``): tighter passes, looser is
    refused with one line naming the setting (the Param of the same name) and its limit."""
    with pytest.raises(SettingsError) as refused:
        load(section="evaluate", overrides=[override])
    assert message in str(refused.value) and "\n" not in str(refused.value)
    tighter = load(section="evaluate", overrides=["max_regression=0", "max_eval_perplexity=10", "min_eval_accuracy=0.5"])
    assert (tighter.evaluate.max_regression, tighter.evaluate.max_eval_perplexity) == (0.0, 10.0)


def test_a_required_approval_holds_whatever_the_run_says() -> None:
    """deploy's ``--set approval.enabled=false`` (a run's Param) cannot switch off what the
    deployment requires; nor can a run's canary steps skip the stage the rollout holds before."""
    assert load(section="canary", overrides=["approval.enabled=false"]).canary.approval.active is False
    required = ["approval.required=true", "approval.enabled=false"]
    assert load(section="canary", overrides=required).canary.approval.active is True
    with pytest.raises(SettingsError, match=r"canary.approval.hold_before 50: expected one of steps \[10, 100\]"):
        load(section="canary", overrides=[*required, "approval.hold_before=50", "steps=[10, 100]"])


@pytest.mark.parametrize("approvers", ['["alice", "alice"]', '["alice", ""]', '[" alice"]'])
def test_approvers_are_distinct_user_ids(approvers: str) -> None:
    with pytest.raises(SettingsError, match=r"canary.approval.approvers .*: expected distinct Airflow user ids"):
        load(section="canary", overrides=[f"approval.approvers={approvers}"])


def test_canary_steps_may_be_fractions_of_a_percent() -> None:
    assert load(section="canary", overrides=["steps=[0.5, 10, 100]"]).canary.steps == (0.5, 10, 100)


def test_choices_are_the_literal_values() -> None:
    assert choices(TrainSettings, "engine") == ["fsdp2", "ddp", "deepspeed", "single"]
    assert choices(TrainSettings, "init_from") == ["champion", "scratch"]
    with pytest.raises(TypeError):
        choices(CanarySettings, "steps")


def test_settings_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        load().train.lr = 1.0  # type: ignore[misc]


def test_every_setting_is_documented() -> None:
    """Each field has a docstring: the reference has no empty meaning."""
    reference_rows = [row for row in with_reference(
        (REPO_ROOT / "docs" / "configuration.md").read_text(), load()).splitlines() if row.startswith("| `")]
    assert reference_rows and all(not row.endswith("|  |") for row in reference_rows), \
        [row for row in reference_rows if row.endswith("|  |")]


def test_the_configuration_reference_is_up_to_date() -> None:
    page = (REPO_ROOT / "docs" / "configuration.md").read_text()
    assert with_reference(page, load()) == page, "docs/configuration.md: run `make config-docs`"


def test_the_command_checks_a_file_and_exits_2_with_one_line(tmp_path: Path) -> None:
    raw = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    raw["serve"]["backend"] = "tensorflow"
    broken = tmp_path / "params.yaml"
    broken.write_text(yaml.safe_dump(raw))
    proc = subprocess.run([str(RUNTIME_PY), "-m", "tasks.config"], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={"PIPELINE_PARAMS": str(broken), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"ERROR {broken}: serve.backend 'tensorflow': expected one of python, onnxruntime_onnx, tensorrt_plan"]
    ok = subprocess.run([str(RUNTIME_PY), "-m", "tasks.config"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.strip().endswith("params.yaml: ok")
