"""Evaluation gate and registration against the real MLflow server (sqlite + artifacts on S3)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    error_lines,
    params_with_model_name,
    run_module,
    step_result,
    write_eval_text,
)

from tasks.config import EvaluateSettings, load
from tasks.lib import storage


def gate_bounds() -> EvaluateSettings:
    return dataclasses.replace(load().evaluate, max_eval_perplexity=2000.0, min_eval_accuracy=0.05, max_regression=0.05)


def test_gate_rejects_non_finite_figures() -> None:
    """NaN compares false with every bound: the gate must name it instead of passing it."""
    from tasks.evaluate import judge

    bounds = gate_bounds()
    good = {"eval_perplexity": 300.0, "eval_accuracy": 0.2}
    assert judge(good, None, bounds) == [] and judge(good, {"eval_perplexity": 310.0}, bounds) == []
    for broken in ({"eval_perplexity": float("nan")}, {"eval_perplexity": float("inf")}, {"eval_accuracy": float("nan")}):
        reasons = judge({**good, **broken}, {"eval_perplexity": 310.0}, bounds)
        assert reasons and "not a finite number" in reasons[0], reasons
    assert "no baseline" in judge(good, {"eval_perplexity": float("nan")}, bounds)[0]


def test_gate_compares_bits_per_byte_when_the_tokenizers_differ() -> None:
    """Perplexity per token of two vocabularies is not comparable: a bigger vocabulary has a
    higher per-token perplexity and can still model the text better."""
    from tasks.evaluate import judge

    bounds = gate_bounds()
    champion = {"eval_perplexity": 200.0, "eval_bits_per_byte": 2.0, "tokenizer_hash": "aaa"}
    bigger_vocab = {"eval_perplexity": 600.0, "eval_accuracy": 0.2, "eval_bits_per_byte": 1.9, "tokenizer_hash": "bbb"}
    assert judge(bigger_vocab, champion, bounds) == []
    worse = {**bigger_vocab, "eval_bits_per_byte": 2.3}
    assert "bits per byte (tokenizers differ) 2.3 regresses" in judge(worse, champion, bounds)[0]
    same_vocab = {**bigger_vocab, "tokenizer_hash": "aaa"}  # one vocabulary: perplexity decides
    assert "eval perplexity 600 regresses" in judge(same_vocab, champion, bounds)[0]


LINEAGE = {"data_version": "data-2026-11-22", "data_content_hash": "c0ffee", "data_end": "2026-11-22", "dag_id": "llm_retrain",
           "dag_run_id": "manual__2026-11-22T00:00:00+00:00", "logical_date": "2026-11-22"}


@pytest.fixture(scope="module")
def registry_env(stack_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """params.yaml with a model name of this module's own, so other tests' aliases stay apart."""
    return params_with_model_name("gate-test", tmp_path_factory.mktemp("params"))


@pytest.fixture(scope="module")
def eval_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Held-out text: installed docstrings the training snapshot (the first 600) never saw."""
    return write_eval_text(tmp_path_factory.mktemp("eval"), 600, 900)


def trained(root: Path, dataset: Path, steps: int) -> Path:
    proc = run_module("tasks.train", "--dataset", str(dataset), "--checkpoints", str(root / "ckpt"),
                      "--output", str(root / "model"), "--set", f"max_steps={steps}", "--set", "micro_batch=4",
                      "--set", "warmup_steps=2", "--set", "eval_every=1000", "--set", "checkpoint_every=1000",
                      env={"MLFLOW_TRACKING_URI": ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return root / "model"


@pytest.fixture(scope="module")
def good_model(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return trained(tmp_path_factory.mktemp("good"), dataset, 80)


@pytest.fixture(scope="module")
def poor_model(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return trained(tmp_path_factory.mktemp("poor"), dataset, 3)


def evaluate(model: Path, dataset: Path, eval_set: Path, out: Path, env: dict[str, str], *extra: str) -> Any:
    return run_module("tasks.evaluate", "--model", str(model), "--dataset", str(dataset), "--eval-set",
                      str(eval_set), "--output", str(out), "--set", "max_eval_tokens=8192", *extra, env=env)


def register(model: Path, report: Path, tag: str, env: dict[str, str], **overrides: str) -> Any:
    lineage = [a for k, v in {**LINEAGE, **overrides}.items() for a in ("--lineage", f"{k}={v}")]
    return run_module("tasks.register", "--model", str(model), "--evaluation", str(report),
                      "--mlflow-run-tag", tag, *lineage, env=env)


def test_git_commit_flags_a_dirty_tree_and_images_bake_theirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    from tasks.lib.provenance import git_commit

    monkeypatch.delenv("PIPELINE_GIT_COMMIT", raising=False)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "c"], cwd=tmp_path, check=True)
    clean = git_commit(tmp_path)
    assert len(clean) == 40
    (tmp_path / "a.py").write_text("x = 2\n")  # what runs is not what the commit says
    assert git_commit(tmp_path) == f"{clean}-dirty"
    monkeypatch.setenv("PIPELINE_GIT_COMMIT", "0123abc")  # an image's, set at build time
    assert git_commit(tmp_path) == "0123abc"


def test_registry_outage_is_an_error_not_a_missing_champion(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read as "no champion", an outage would judge a challenger as the first model ever and
    train a new vocabulary: it must fail the task (exit 1, retried) instead."""
    from tasks.lib.errors import RegistryError
    from tasks.lib.model_store import load_registered
    from tasks.lib.registry import alias_version
    from tasks.tokenize import champion

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # discard port: nothing listens
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    for read in (lambda: alias_version("llm-retrain", "champion"), lambda: load_registered("llm-retrain", "champion"),
                 lambda: champion("llm-retrain")):
        with pytest.raises(RegistryError, match="MLflow registry: reading models:/llm-retrain@champion failed"):
            read()


@pytest.mark.integration
def test_absent_model_and_alias_read_as_absent(registry_env: dict[str, str]) -> None:
    from mlflow import MlflowClient

    from tasks.lib.registry import alias_version

    name = f"absent-test-{time.time_ns()}"
    assert alias_version(name, "champion") is None  # no such registered model (RESOURCE_DOES_NOT_EXIST)
    MlflowClient().create_registered_model(name)
    assert alias_version(name, "champion") is None  # a model without that alias (INVALID_PARAMETER_VALUE)


@pytest.mark.integration
def test_first_model_passes_on_absolute_bounds_registers_once_and_loads_by_alias(
    registry_env: dict[str, str], good_model: Path, dataset: Path, eval_set: Path, tmp_path: Path
) -> None:
    import mlflow
    from mlflow import MlflowClient

    # the DAG run's MLflow run, as the train step opens it
    tag = f"llm_retrain/first-{time.time_ns()}"
    mlflow.set_experiment("llm-retrain")
    with mlflow.start_run(tags={"dag_run": tag}) as training:
        pass
    proc = evaluate(good_model, dataset, eval_set, tmp_path / "eval", registry_env, "--mlflow-run-tag", tag)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = {a.path for a in MlflowClient().list_artifacts(training.info.run_id, "evaluation")}
    assert logged == {"evaluation/report.json", "evaluation/samples.json"}
    report = step_result(proc)
    assert report["passed"] is True and report["champion"] is None
    assert report["challenger"]["eval_perplexity"] < 1000 and 0 < report["challenger"]["eval_accuracy"] < 1
    samples = json.loads((tmp_path / "eval" / "samples.json").read_text())
    assert len(samples["challenger"]) == 3 and samples["challenger"][0]["completion"].startswith("Return the number of")

    first = step_result(register(good_model, tmp_path / "eval" / "report.json", tag, registry_env))
    retry = step_result(register(good_model, tmp_path / "eval" / "report.json", tag, registry_env))
    assert first["new"] is True and retry["new"] is False and retry["version"] == first["version"]
    assert first["run_id"] == training.info.run_id  # registered from the DAG run's own MLflow run

    client, name = MlflowClient(), registry_env["MODEL_NAME"]
    assert len(client.search_model_versions(f"name = '{name}'")) == 1
    version = client.get_model_version_by_alias(name, "challenger")
    assert version.version == first["version"]
    tags = version.tags
    for key, value in LINEAGE.items():
        assert tags[key] == value
    assert tags["dag_run"] == tag and len(tags["git_commit"].removesuffix("-dirty")) == 40
    assert tags["tokenizer_hash"] == json.loads((good_model / "config.json").read_text())["tokenizer_hash"]
    assert float(tags["metric.eval_perplexity"]) == pytest.approx(report["challenger"]["eval_perplexity"], rel=1e-5)

    from safetensors.torch import load_file

    from tasks.lib.model_store import REGISTRY_FLAVOR, load_registered

    loaded = load_registered(name, "challenger")
    assert loaded is not None and loaded.description["registry_version"] == first["version"]
    reference = load_file(good_model / "model.safetensors")
    assert all(torch.equal(loaded.model.state_dict()[k], reference[k]) for k in reference)
    mv = client.get_model_version(name, first["version"])
    assert mv.source.startswith("models:/")  # a logged model, with signature and requirements
    info = mlflow.models.get_model_info(f"models:/{name}@challenger")
    assert info.signature.inputs.to_dict()[0]["tensor-spec"]["dtype"] == "int64"
    assert set(info.flavors) == {REGISTRY_FLAVOR, "python_function"}  # weights and config: no pickle
    artifacts = mlflow.artifacts.download_artifacts(f"models:/{name}@challenger", dst_path=str(tmp_path / "as-registered"))
    files = {p.name for p in Path(artifacts).iterdir()} - {"registered_model_meta"}  # MLflow's, on download
    assert files == {"MLmodel", "config.json", "model.safetensors"}
    # as a new user loads it: any batch and sequence length, not the (1, 16) example's
    import numpy as np

    predicted = mlflow.pyfunc.load_model(f"models:/{name}@challenger").predict(np.zeros((2, 32), dtype=np.int64))
    assert predicted.shape[:2] == (2, 32)


@pytest.mark.integration
def test_challenger_is_the_newest_data_not_the_last_registered(
    stack_env: dict[str, str], good_model: Path, dataset: Path, eval_set: Path, tmp_path: Path
) -> None:
    """A backfill on old data that registers after a newer run must not take ``challenger``."""
    from mlflow import MlflowClient

    env = params_with_model_name("challenger-test", tmp_path)
    evaluate(good_model, dataset, eval_set, tmp_path / "eval", env)
    report = tmp_path / "eval" / "report.json"
    backfill_tag = f"backfill-{time.time_ns()}"
    newer = step_result(register(good_model, report, f"newer-{time.time_ns()}", env, data_end="2026-11-22"))
    late_backfill = step_result(register(good_model, report, backfill_tag, env, data_end="2026-11-15"))
    assert int(late_backfill["version"]) > int(newer["version"])
    assert late_backfill["challenger"] == newer["version"]
    assert MlflowClient().get_model_version_by_alias(env["MODEL_NAME"], "challenger").version == newer["version"]
    # a newer window does take it, and a retry of the older run does not take it back
    newest = step_result(register(good_model, report, f"newest-{time.time_ns()}", env, data_end="2026-11-29"))
    assert newest["challenger"] == newest["version"]
    retried = step_result(register(good_model, report, backfill_tag, env, data_end="2026-11-15"))
    assert retried["new"] is False and retried["challenger"] == newest["version"]

    # deploy: the backfill's version does not replace a champion trained on newer data (a gate:
    # exit 99, one line, nothing staged); the trigger's deploy_older_data lets it through
    MlflowClient().set_registered_model_alias(env["MODEL_NAME"], "champion", newest["version"])
    missing_export = str(tmp_path / "no-export")

    def deploy(version: str, older_data: str) -> Any:
        return run_module("tasks.deploy", "--set", f"deploy_older_data={older_data}", "canary", "--model-version",
                          version, "--export", missing_export, "--output", str(tmp_path / f"deploy-{older_data}"),
                          "--no-promote", env={**stack_env, **env})

    skipped = deploy(late_backfill["version"], "false")
    assert skipped.returncode == 99, skipped.stderr[-2000:]
    assert (f"version {late_backfill['version']}'s data ends 2026-11-15, before champion v{newest['version']}'s "
            f"(2026-11-29): not deployed" in skipped.stderr), skipped.stderr[-2000:]
    assert step_result(skipped)["verdict"] == "not deployed"
    assert not (tmp_path / "deploy-false").exists()
    assert deploy(late_backfill["version"], "maybe").returncode == 2  # not a boolean: bad input
    forced = deploy(late_backfill["version"], "true")  # past the guard: on to the (missing) export
    assert forced.returncode == 2 and "no-export" in error_lines(forced)[0], forced.stderr[-2000:]


@pytest.mark.integration
def test_worse_challenger_is_rejected_and_champion_untouched(
    registry_env: dict[str, str], good_model: Path, poor_model: Path, dataset: Path, eval_set: Path, tmp_path: Path
) -> None:
    from mlflow import MlflowClient

    from tasks.lib.registry import promote_challenger

    # make the good model the champion (what a successful canary does)
    evaluate(good_model, dataset, eval_set, tmp_path / "e1", registry_env)
    assert step_result(register(good_model, tmp_path / "e1" / "report.json", f"champ-{time.time_ns()}", registry_env))
    promoted = promote_challenger(registry_env["MODEL_NAME"])
    client, name = MlflowClient(), registry_env["MODEL_NAME"]
    champion_version = promoted["champion"]

    proc = evaluate(poor_model, dataset, eval_set, tmp_path / "e2", registry_env)
    assert proc.returncode == 99, proc.stderr[-3000:]
    line = next(x for x in proc.stderr.splitlines() if x.startswith("REJECTED "))
    assert "regresses more than 5% on the champion" in line
    report = json.loads((tmp_path / "e2" / "report.json").read_text())
    assert report["passed"] is False and report["champion"]["registry_version"] == champion_version
    assert report["challenger"]["eval_perplexity"] > report["champion"]["eval_perplexity"]
    # both ran the task suite, their examples paired (the interval holds the mean difference)
    for task in report["tasks"].values():
        difference = task["difference"]
        assert task["champion"] is not None and difference["examples"] == task["examples"] == 100
        assert difference["low"] <= difference["mean"] <= difference["high"]
        assert abs(difference["mean"] - (task["challenger"] - task["champion"])) < 1e-9
    # the rejected model cannot be registered, and the champion alias did not move
    refused = register(poor_model, tmp_path / "e2" / "report.json", f"poor-{time.time_ns()}", registry_env)
    assert refused.returncode == 2 and "did not pass" in error_lines(refused)[0]
    assert client.get_model_version_by_alias(name, "champion").version == champion_version


@pytest.mark.integration
def test_absolute_bound_rejects_even_without_champion(
    registry_env: dict[str, str], poor_model: Path, dataset: Path, eval_set: Path, tmp_path: Path
) -> None:
    proc = evaluate(poor_model, dataset, eval_set, tmp_path / "e", registry_env, "--no-champion",
                    "--set", "max_eval_perplexity=50")
    assert proc.returncode == 99
    assert "> max 50" in next(x for x in proc.stderr.splitlines() if x.startswith("REJECTED "))


@pytest.mark.integration
def test_promotion_keeps_the_previous_champion_for_rollback(registry_env: dict[str, str]) -> None:
    from mlflow import MlflowClient

    from tasks.lib.registry import promote_challenger

    client, name = MlflowClient(), registry_env["MODEL_NAME"]
    champion = client.get_model_version_by_alias(name, "champion").version
    first = min(int(v.version) for v in client.search_model_versions(f"name = '{name}'"))
    assert str(first) != champion
    client.set_registered_model_alias(name, "challenger", str(first))
    moved = promote_challenger(name)
    again = promote_challenger(name)  # repeating it moves nothing
    assert moved == again == {"champion": str(first), "previous": champion}


class RunsCodeWhenUnpickled(torch.nn.Module):
    """What a registry writer could register: a module whose pickle names a function to call on
    loading (here, one that creates ``marker``), as an attacker's would name any other."""

    def __init__(self, marker: Path) -> None:
        super().__init__()
        self.marker = marker
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


@pytest.mark.integration
def test_a_pickled_registered_model_is_refused_without_running_it(
    stack_env: dict[str, str], good_model: Path, dataset: Path, eval_set: Path, tmp_path: Path
) -> None:
    """A version registered as a pickle whose loading calls a function, as champion: evaluate,
    and every reader of the registry, refuse it with one line, and the function never runs. A
    GPT pickled the way older code registered it still loads (weights only)."""
    import mlflow
    from mlflow import MlflowClient

    from tasks.lib.errors import StepError
    from tasks.lib.model_store import load_model_dir, load_registered, load_version

    env = params_with_model_name("pickle-test", tmp_path)
    name, marker = env["MODEL_NAME"], tmp_path / "the-pickle-ran"
    description = json.loads((good_model / "config.json").read_text())

    def register_pickled(module: torch.nn.Module) -> str:
        with mlflow.start_run(run_name="a pickled registered model"):
            info = mlflow.pytorch.log_model(module, name="model", serialization_format="pickle",
                                            pip_requirements=["torch==2.13.0"])
        tags = {"model_description": json.dumps(description)}
        return str(mlflow.register_model(info.model_uri, name, tags=tags).version)

    with storage.scratch() as folder:
        trained = load_model_dir(str(good_model), folder).model
    legacy = register_pickled(trained)
    assert all(torch.equal(a, b) for a, b in zip(load_version(name, legacy).model.state_dict().values(),
                                                  trained.state_dict().values(), strict=True))

    version = register_pickled(RunsCodeWhenUnpickled(marker))
    MlflowClient().set_registered_model_alias(name, "champion", version)
    proc = evaluate(good_model, dataset, eval_set, tmp_path / "eval", env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    # (cloudpickle reaches Path.touch through getattr: the first thing named beyond a model's classes)
    assert error_lines(proc) == [f"ERROR python -m tasks.evaluate: models:/{name}/{version}: its pickled module "
                                 "(model.pth) is refused: it names getattr, which no pickled model of this "
                                 "project does; nothing in it was run"]
    assert not (tmp_path / "eval" / "report.json").exists()
    for read in (lambda: load_version(name, version), lambda: load_registered(name, "champion")):
        with pytest.raises(StepError, match="nothing in it was run"):
            read()
    assert not marker.exists()
    # and it is a pickle that runs code: MLflow's own loader, which unpickles, runs it
    with contextlib.suppress(Exception):  # what it returns is no module; what matters is what it ran
        mlflow.pytorch.load_model(f"models:/{name}/{version}")
    assert marker.exists()
