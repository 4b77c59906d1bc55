"""A version's memory in Triton, counted before it loads (tasks/serving/memory.py), and the deploy's
staging refusing one that would not fit ``serve.memory_budget_mb`` beside stable, nothing copied."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from tasks.config import ServeSettings
from tasks.lib import storage
from tasks.lib.errors import StepError
from tasks.lib.params import load_settings
from tasks.lib.triton import generate_model_config
from tasks.serving import memory
from tasks.serving.platforms import Staging, stage_version

MIB = 2**20
# cpu-small's cache: 4 layers, 8 heads of 64, context 256: 4 MiB a sequence
GENERATION = {"n_layers": 4, "n_heads": 8, "n_kv_heads": 8, "head_dim": 64, "seq_len": 256}


def serve_settings(**changes: Any) -> ServeSettings:
    serve: ServeSettings = load_settings("canary").serve
    return dataclasses.replace(serve, **changes)


def write_version(models: Path, serve: ServeSettings, version: int, megabytes: tuple[int, int]) -> None:
    """A version's two folders: a logits model.onnx and an engine decoder.onnx of those sizes."""
    logits, engine = models / serve.triton_model / str(version), models / serve.generate_model / str(version)
    for folder, name, size in ((logits, "model.onnx", megabytes[0]), (engine, "decoder.onnx", megabytes[1])):
        folder.mkdir(parents=True)
        (folder / name).write_bytes(b"\0" * (size * MIB))
    (engine / "generation.json").write_text(json.dumps(GENERATION))


def write_export(root: Path, serve: ServeSettings, version: int, megabytes: tuple[int, int]) -> Path:
    """An export folder as the export step writes it (the parts staging reads)."""
    write_version(root / "triton", serve, version, megabytes)
    (root / "configs").mkdir()
    for model in (serve.triton_model, serve.generate_model):
        (root / "triton" / model / "config.pbtxt").write_text("")
        (root / "configs" / f"{model}.json").write_text(json.dumps(generate_model_config(serve.generate_model, serve)))
    (root / "parity.json").write_text(json.dumps({"reference": {"inputs": []}}))
    (root / storage.SUCCESS_MARKER).write_text(json.dumps(storage.manifest_of(root)))  # committed, as a step does
    return root


def test_a_versions_footprint_is_its_files_and_the_cache_its_configuration_holds(tmp_path: Path) -> None:
    serve = serve_settings(max_slots=32, kv_cache_mb=64)
    export = write_export(tmp_path / "export", serve, 3, (5, 6))
    found = memory.footprint(export / "triton", serve, 3, export / "configs" / f"{serve.generate_model}.json")
    # 64 MiB holds 16 sequences of 4 MiB (fewer than max_slots' 32)
    assert (found.slots, found.cache_bytes) == (16, 64 * MIB)
    assert 11 * MIB < found.weights_bytes < 11 * MIB + 4096  # the two ONNX files, generation.json
    assert found.describe() == "version 3 75 MiB (11 MiB of weights, 16 KV cache slots 64 MiB)"


def test_a_version_that_would_not_fit_beside_stable_is_refused_before_anything_is_copied(tmp_path: Path) -> None:
    serve = serve_settings(max_slots=8, kv_cache_mb=1024, memory_budget_mb=100)
    repository = tmp_path / "models"
    write_version(repository, serve, 1, (20, 20))  # stable: 40 MiB + 8 x 4 MiB
    # the repository's engine configuration is the last staged one (a rolled-back canary's, one
    # slot); the incoming one's, which staging writes, loads both versions: stable is counted by it
    stale = serve_settings(max_slots=1)
    (repository / serve.generate_model / "config.json").write_text(
        json.dumps(generate_model_config(serve.generate_model, stale)))
    export = write_export(tmp_path / "export", serve, 2, (20, 20))
    with pytest.raises(StepError) as refused:
        stage_version(str(export), 2, repository, serve, tmp_path / "scratch", Staging(beside=(1,)))
    assert str(refused.value) == (
        "version 2 72 MiB (40 MiB of weights, 8 KV cache slots 32 MiB) beside version 1 72 MiB (40 MiB of weights, "
        "8 KV cache slots 32 MiB): 144 MiB, over serve.memory_budget_mb 100 (lower serve.kv_cache_mb or "
        "serve.max_slots, or raise the budget)")
    assert not (repository / serve.triton_model / "2").exists() and not (repository / serve.generate_model / "2").exists()
    # alone (the first model), or within a budget that holds both, it is staged
    stage_version(str(export), 2, tmp_path / "first", serve, tmp_path / "scratch2")
    assert (tmp_path / "first" / serve.generate_model / "2" / "decoder.onnx").exists()
    roomy = serve_settings(max_slots=8, kv_cache_mb=1024, memory_budget_mb=150)
    stage_version(str(export), 2, repository, roomy, tmp_path / "scratch3", Staging(beside=(1,)))
    assert (repository / serve.generate_model / "2" / "decoder.onnx").exists()


def test_a_cache_budget_that_holds_no_sequence_is_refused_with_one_line(tmp_path: Path) -> None:
    serve = serve_settings(kv_cache_mb=3)
    export = write_export(tmp_path / "export", serve, 4, (1, 1))
    with pytest.raises(StepError, match=r"^version 4: serve.kv_cache_mb 3: one sequence's cache takes 4.00 MiB"):
        memory.footprint(export / "triton", serve, 4, export / "configs" / f"{serve.generate_model}.json")


def test_no_budget_checks_nothing_and_a_rollback_is_warned_not_refused(caplog: pytest.LogCaptureFixture) -> None:
    big = memory.Footprint(1, 10**12, 8, 10**12)
    memory.check_budget(big, [big], serve_settings(memory_budget_mb=0))
    memory.check_budget(big, [], serve_settings(memory_budget_mb=100), enforce=False)
    assert "over serve.memory_budget_mb 100 (" in caplog.text and "loading it anyway (a rollback)" in caplog.text


def test_the_logits_model_counts_once_per_instance(tmp_path: Path) -> None:
    serve = serve_settings(instances=3, max_slots=1)
    export = write_export(tmp_path / "export", serve, 5, (10, 2))
    found = memory.footprint(export / "triton", serve, 5, export / "configs" / f"{serve.generate_model}.json")
    assert 32 * MIB < found.weights_bytes < 32 * MIB + 4096


def test_another_lines_served_version_counts_against_the_one_budget(tmp_path: Path) -> None:
    """One Triton holds every model line's versions: a deploy counts what the other lines' routes
    serve (their own models, sized by their own engine configuration) beside its own."""
    serve = serve_settings(max_slots=8, kv_cache_mb=1024, memory_budget_mb=100)
    other = serve_settings(triton_model="llm__support", generate_model="llm_generate__support", max_slots=2)
    repository = tmp_path / "models"
    write_version(repository, other, 7, (20, 20))  # the support line's stable: 40 MiB + 2 x 4 MiB
    (repository / other.generate_model / "config.json").write_text(
        json.dumps(generate_model_config(other.generate_model, other)))
    export = write_export(tmp_path / "export", serve, 2, (20, 20))
    with pytest.raises(StepError) as refused:
        stage_version(str(export), 2, repository, serve, tmp_path / "scratch", Staging(others=((other, "support", 7),)))
    assert str(refused.value).startswith(
        "version 2 72 MiB (40 MiB of weights, 8 KV cache slots 32 MiB) beside line support's version 7 48 MiB "
        "(40 MiB of weights, 2 KV cache slots 8 MiB): 120 MiB, over serve.memory_budget_mb 100"), refused.value
    assert not (repository / serve.generate_model / "2").exists()
    stage_version(str(export), 2, repository, dataclasses.replace(serve, memory_budget_mb=150), tmp_path / "scratch2",
                  Staging(others=((other, "support", 7),)))
    assert (repository / serve.generate_model / "2" / "decoder.onnx").exists()
