"""The gate's task suites: lm-eval task YAML over local files run by lm-evaluation-harness on a
model's Hugging Face form, in the evaluate step, and the paired bootstrap that compares a
challenger with its champion example by example."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import error_lines, run_module, step_result, tokenize

from examples.tiny_base import make_base
from tasks.lib import tokens
from tasks.lib.harness import chunks, paired_difference

REPO_ROOT = Path(__file__).resolve().parents[2]
NO_MLFLOW = {"MLFLOW_TRACKING_URI": ""}


def test_equal_models_never_differ_and_a_clearly_worse_one_does() -> None:
    scores = {i: float(i % 3 == 0) for i in range(100)}
    same = paired_difference(scores, dict(scores), 2000, 0.95)
    assert same is not None and same.mean == same.low == same.high == 0.0 and same.examples == 100
    worse = paired_difference({i: 0.0 for i in range(100)}, {i: float(i % 2) for i in range(100)}, 2000, 0.95)
    assert worse is not None and -0.7 < worse.low < worse.mean == -0.5 < worse.high < -0.3  # within ~0.1
    assert worse == paired_difference({i: 0.0 for i in range(100)}, {i: float(i % 2) for i in range(100)}, 2000, 0.95)


def test_only_examples_both_models_answered_are_paired() -> None:
    difference = paired_difference({1: 1.0, 2: 1.0, 3: 0.0}, {2: 0.0, 3: 0.0, 4: 1.0}, 500, 0.9)
    assert difference is not None and difference.examples == 2 and difference.mean == 0.5
    assert paired_difference({1: 1.0}, {2: 1.0}, 500, 0.9) is None
    assert chunks(10, 4) == [4, 4, 2] and sum(chunks(2000, 7)) == 2000


@pytest.fixture(scope="module")
def trained(snapshot: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama base imported and tokenized (the evaluate step's model and dataset), and a
    held-out text."""
    root = tmp_path_factory.mktemp("suite")
    texts = [r["text"] for r in tokens.read_jsonl(snapshot)]
    base = make_base("llama", texts, root / "base")
    proc = run_module("tasks.tokenize", "prepare", "--snapshot", str(snapshot), "--base", str(base), "--preset",
                      "cpu-tiny", "--output", str(root / "prepare"), "--set", f"tokenizer_store={root / 'tok'}",
                      "--set", f"base_store={root / 'bases'}", env=NO_MLFLOW)
    prepared = step_result(proc)
    tokenize(snapshot, str(prepared["tokenizer_uri"]), root / "data", 1)
    (root / "eval.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:40]))
    # an untrained model: the perplexity gate's accuracy bound would reject it before its tasks matter
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["evaluate"]["min_eval_accuracy"] = params["evaluate"]["limits"]["min_eval_accuracy"] = 0.0
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    return {"model": Path(str(prepared["init_model_uri"])), "dataset": root / "data" / "dataset",
            "eval": root / "eval.jsonl", "params": root / "params.yaml"}


def evaluate(trained: dict[str, Path], out: Path, *overrides: str) -> Any:
    sets = [arg for item in overrides for arg in ("--set", item)]
    return run_module("tasks.evaluate", "--model", str(trained["model"]), "--dataset", str(trained["dataset"]),
                      "--eval-set", str(trained["eval"]), "--output", str(out), "--no-champion",
                      *sets, env={**NO_MLFLOW, "PIPELINE_PARAMS": str(trained["params"])})


@pytest.mark.torchrun  # lm-eval runs the model twice: slower than the fast suite allows
def test_the_demo_suite_scores_every_example_and_its_bounds_gate(trained: dict[str, Path], tmp_path: Path) -> None:
    passed = evaluate(trained, tmp_path / "passed")
    assert passed.returncode == 0, passed.stderr[-3000:]
    tasks = step_result(passed)["tasks"]
    choice = tasks["demo_continuation_choice"]  # type: ignore[index]
    assert choice["metric"] == "acc" and choice["examples"] == 100 and 0 <= choice["challenger"] <= 1
    assert tasks["demo_next_word"]["examples"] == 100  # type: ignore[index]
    # the same model scores the same (greedy, seeded): a bound just above its score rejects it
    above = min(1.0, choice["challenger"] + 0.01)
    rejected = evaluate(trained, tmp_path / "rejected",
                        f"suite.tasks={{demo_continuation_choice: {{metric: acc, min: {above}}}}}")
    assert rejected.returncode == 99
    report = json.loads((tmp_path / "rejected" / "report.json").read_text())
    assert report["tasks"]["demo_continuation_choice"]["challenger"] == choice["challenger"]
    assert report["reasons"] == [f"task demo_continuation_choice: acc {choice['challenger']:.3f} < min {above:g}"]


@pytest.mark.torchrun
def test_a_suite_that_cannot_run_is_one_line_and_nothing_written(trained: dict[str, Path], tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    shutil.copytree(REPO_ROOT / "evaluation" / "tasks", suite)
    (suite / "demo" / "next_word.jsonl").unlink()
    cases = {
        "a task YAML naming a missing file": ([f"suite.tasks_dir={suite}"], "task demo_next_word cannot be loaded"),
        "a task the folder does not have": (
            ["suite.tasks={no_such_task: {metric: acc}}"], "'no_such_task' is not a task of"),
        "a metric the task does not report": (
            ["suite.tasks={demo_continuation_choice: {metric: f1}}"], "metric 'f1': the task reports acc,none"),
        "no suite folder": ([f"suite.tasks_dir={tmp_path / 'nowhere'}"], "no such folder"),
    }
    for name, (overrides, reason) in cases.items():
        proc = evaluate(trained, tmp_path / "out", *overrides)
        lines = error_lines(proc)
        assert proc.returncode == 2 and len(lines) == 1 and reason in lines[0], (name, lines, proc.stderr[-2000:])
        assert not (tmp_path / "out").exists(), name
