"""The steps' results: one frozen dataclass per step (and sub-command), written as the JSON the
steps always wrote (the same keys, a None left out where it always was), read back as they were;
the paths the DAGs read are checked against them."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any

import pytest

from tasks.contract import RESULT_PATH_ENV, from_json, to_json
from tasks.results import (
    STEP_RESULTS,
    DataVersionResult,
    DriftCheck,
    DriftClients,
    DriftWindow,
    EvaluateResult,
    ExportResult,
    GateBounds,
    ModelFigures,
    PairedDifferenceFigures,
    ReleaseResult,
    SnapshotResult,
    TaskFigures,
    TopClient,
    TrainResult,
    check_path,
    step_result_type,
)
from tasks.serving.canary import RolloutSummary


def round_trip(value: Any) -> dict[str, Any]:
    """``value`` as the step writes it (through JSON text), checked to read back equal."""
    written: dict[str, Any] = json.loads(json.dumps(to_json(value), sort_keys=True))
    assert from_json(type(value), written) == value
    return written


def test_a_snapshot_nests_its_data_version() -> None:
    result = SnapshotResult("s3://b/snap/snapshot.jsonl", "s3://b/snap/stats.json",
                            DataVersionResult("data-2026-11-22-7d-abc", "abc" * 8, 120, 4096, "f00d", True), 3, 7)
    assert round_trip(result) == {
        "snapshot_uri": "s3://b/snap/snapshot.jsonl", "stats_uri": "s3://b/snap/stats.json", "duplicates_removed": 3,
        "traffic_records": 7,
        "data_version": {"tag": "data-2026-11-22-7d-abc", "content_hash": "abc" * 8, "records": 120, "bytes": 4096,
                         "commit": "f00d", "new": True}}


def figures(**extra: Any) -> ModelFigures:
    return ModelFigures(eval_loss=2.0, eval_perplexity=7.39, eval_accuracy=0.4, eval_tokens=512.0,
                        eval_bits_per_byte=1.1, tokenizer_hash="h", **extra)


def test_an_evaluation_leaves_out_what_a_model_was_not_measured_on() -> None:
    result = EvaluateResult(
        passed=False, reasons=("eval perplexity 7.4 > max 5",), model_uri="m", eval_set_uri="e", eval_set_sha256="x",
        challenger=figures(val_loss=2.1, val_perplexity=8.2, val_accuracy=0.39, val_tokens=256.0),
        champion=figures(registry_version="3"),  # another vocabulary: no val_ figures
        tasks={"arc": TaskFigures("acc", 0.2, 0.31, 50, 0.3, PairedDifferenceFigures(0.01, -0.02, 0.04, 50)),
               "boolq": TaskFigures("acc", 0.5, 0.6, 20, None, None)},
        gate=GateBounds(5.0, 0.1, 0.05), report_uri="r/report.json", samples_uri="r/samples.json")
    written = round_trip(result)
    assert set(written["challenger"]) == {"eval_loss", "eval_perplexity", "eval_accuracy", "eval_tokens",
                                          "eval_bits_per_byte", "tokenizer_hash", "val_loss", "val_perplexity",
                                          "val_accuracy", "val_tokens"}
    assert written["champion"]["registry_version"] == "3" and "val_loss" not in written["champion"]
    assert written["tasks"]["arc"]["difference"] == {"mean": 0.01, "low": -0.02, "high": 0.04, "examples": 50}
    assert written["tasks"]["boolq"]["champion"] is None and written["tasks"]["boolq"]["difference"] is None
    assert written["reasons"] == ["eval perplexity 7.4 > max 5"]
    # report.json is the result less its URIs: unset, they are left out
    report = to_json(dataclasses.replace(result, report_uri=None, samples_uri=None))
    assert set(written) - set(report) == {"report_uri", "samples_uri"}


def test_a_drift_check_without_a_verdict_writes_no_clients() -> None:
    window = DriftWindow("2026-11-21T00:00:00+00:00", "2026-11-22T00:00:00+00:00", 24.0)
    quiet = DriftCheck(verdict="no verdict", heading="h", outcome="o", request_retrain=False, window=window, reasons=(),
                       clients=None, champion=None, report_uri="r", figures={"prompts": 3, "requests": 4})
    assert round_trip(quiet)["clients"] == {}
    counted = dataclasses.replace(quiet, verdict="no drift", clients=DriftClients(distinct=5, min_clients=3))
    assert round_trip(counted)["clients"] == {"distinct": 5, "min_clients": 3}
    driven = dataclasses.replace(quiet, verdict="drift", clients=DriftClients(
        distinct=5, min_clients=3, seen_from_enough=True, driven_by=None, top=(TopClient("a", 4, 0.5, 0.7),)))
    assert round_trip(driven)["clients"] == {  # driven_by: written, null, once it was judged
        "distinct": 5, "min_clients": 3, "seen_from_enough": True, "driven_by": None,
        "top": [{"client": "a", "prompts": 4, "share_of_prompts": 0.5, "share_of_drift": 0.7}]}


def test_training_writes_rank_zeros_model_file_and_run() -> None:
    train = TrainResult(
        model_uri="m", final_loss=2.5, val_loss=None, steps=10, tokens_seen=2560, tokens_per_s=100.0, mfu=0.01,
        peak_flops=1e12, peak_source="probe", data_loading_share=0.1, eval_share=0.1, checkpoint_share=0.05,
        checkpoint_stall_s=0.01, checkpoint_stalls_s=(0.01, 0.02), checkpoint_save_s=0.2, checkpoints=("c/1",),
        resumed_from=None, initialized_from=None, world_size=1, engine="ddp", precision="fp32", malloc="glibc")
    other_rank = round_trip(train)
    assert "model_file" not in other_rank and "mlflow_run_id" not in other_rank
    assert other_rank["val_loss"] is None and other_rank["checkpoint_stalls_s"] == [0.01, 0.02]
    rank_zero = round_trip(dataclasses.replace(train, model_file="m/model.safetensors"))
    assert rank_zero["model_file"] == "m/model.safetensors" and rank_zero["mlflow_run_id"] is None


def test_an_export_reads_back_from_its_export_json() -> None:
    written = {"model_name": "llm", "version": "4", "export_uri": "e", "opset": 18, "onnx_sha256": "s",
               "onnx_bytes": 10, "backend": "onnxruntime", "tensorrt": "skipped: no GPU",
               "parity": {"max_abs_logit_diff": 1e-5, "tolerance": 1e-3, "inputs": 8, "sequences": 20,
                          "decoder": {"max_abs_logit_diff": 2e-5, "windows": 4, "greedy_tokens_compared": 64},
                          "hf_checkpoint": {"skipped": "gpt-v1 has no Llama form"}}}
    kept = from_json(ExportResult, written)
    assert kept.parity.hf_checkpoint.skipped == "gpt-v1 has no Llama form"
    assert json.dumps(to_json(kept)) == json.dumps(written)  # export.json: key for key, in order


def test_a_release_with_nothing_held_writes_only_that() -> None:
    assert round_trip(ReleaseResult(released=None)) == {"released": None}
    assert round_trip(ReleaseResult(released=5, stable=None)) == {"released": 5, "stable": None}


def test_every_result_is_a_frozen_dataclass_and_every_sub_command_has_one() -> None:
    for kind in STEP_RESULTS.values():
        assert dataclasses.is_dataclass(kind) and kind.__dataclass_params__.frozen, kind  # type: ignore[attr-defined]
    for module in sorted({key.split(" ")[0] for key in STEP_RESULTS}):
        found = importlib.import_module("tasks.train.__main__" if module == "tasks.train" else module)
        subparsers = [a for a in found.parser()._actions if isinstance(a, argparse._SubParsersAction)]
        commands = sorted(subparsers[0].choices) if subparsers else []
        assert sorted(key for key in STEP_RESULTS if key.split(" ")[0] == module) == \
            ([f"{module} {c}" for c in commands] or [module])


def test_a_path_is_checked_field_by_field() -> None:
    check_path(SnapshotResult, ("data_version", "content_hash"))
    check_path(step_result_type("tasks.tokenize", ["merge", "--snapshot", "s"]), ("tokens", "train"))  # a dict: any key
    check_path(step_result_type("tasks.deploy", ["--set", "approval_timeout_s=60", "canary"]), ("verdict",))
    assert step_result_type("tasks.deploy", ["finish"]) is RolloutSummary
    with pytest.raises(ValueError, match=r"\['data_version'\] \(DataVersionResult\) has no field 'tags'; its fields: "
                                         r"tag, content_hash, records, bytes, commit, new"):
        check_path(SnapshotResult, ("data_version", "tags"))
    with pytest.raises(ValueError, match=r"\['snapshot_uri'\] is a str: it has no field 'x'"):
        check_path(SnapshotResult, ("snapshot_uri", "x"))
    with pytest.raises(ValueError, match=r"tasks.replay: its sub-command, the first argument after --set options, is "
                                         r"'--model-version' here, not one of compare, plan, show"):
        step_result_type("tasks.replay", ["--model-version", "3"])
    with pytest.raises(ValueError, match=r"tasks\.nothing is not a step with a result"):
        step_result_type("tasks.nothing", [])


def test_run_step_writes_the_dataclass_as_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tasks.lib.step import write_result

    monkeypatch.setenv(RESULT_PATH_ENV, str(tmp_path / "return.json"))
    write_result(ReleaseResult(released=7, stable=6))
    assert (tmp_path / "return.json").read_text() == '{"released": 7, "stable": 6}'
