"""The drift check's figures and bounds, and the capture's buffer, in this process (the loop on
the real stack: tests/dags/test_llm_drift.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest

from tasks.config import Capture
from tasks.lib.params import load_settings
from tasks.serving.capture import TrafficCapture, served_record


def test_js_divergence_is_zero_for_the_same_and_one_bit_for_disjoint_distributions() -> None:
    from tasks.drift import js_bits

    same = np.array([5.0, 3.0, 0.0, 2.0])
    assert js_bits(same, same * 7) == pytest.approx(0.0)
    assert js_bits(np.array([1.0, 1.0, 0.0, 0.0]), np.array([0.0, 0.0, 4.0, 1.0])) == pytest.approx(1.0)
    assert 0 < js_bits(np.array([3.0, 1.0, 0.0]), np.array([1.0, 3.0, 0.0])) < 1


def test_byte_fallback_tokens_are_the_unmerged_non_ascii_bytes() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from tasks.drift import byte_fallback_ids

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(["Return the number of items in the list."] * 50, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fallback = set(byte_fallback_ids(tokenizer.get_vocab()).tolist())
    assert len(fallback) == 128  # bytes 0x80..0xff, each a token of the initial alphabet
    english = tokenizer.encode("Return the number").ids
    cyrillic = tokenizer.encode("Ретурн тхе нумбер").ids
    assert not fallback & set(english) and set(cyrillic) <= fallback | {tokenizer.token_to_id("Ġ")}


def test_a_bound_passed_is_named_and_none_passed_is_no_drift() -> None:
    from tasks.drift import judge

    settings = load_settings().drift
    calm = {"js_bits": 0.34, "js_excess_bits": 0.05, "byte_fallback_share": 0.0, "byte_fallback_share_reference": 0.0,
            "byte_fallback_excess": 0.0, "perplexity": 270.0, "perplexity_ratio": 1.5}
    assert judge(calm, settings) == []
    drifted = {**calm, "byte_fallback_share": 0.64, "byte_fallback_excess": 0.64, "perplexity": 4100.0,
               "perplexity_ratio": 24.0}
    assert [r.split(":")[0] for r in judge(drifted, settings)] == ["byte fallback", "surprise"]


def capture(tmp_path: Path, **changes: object) -> TrafficCapture:
    settings = dataclasses.replace(Capture(rate=1.0, uri=str(tmp_path / "served"), flush_s=60, max_pending=3,
                                                         max_pending_bytes=1 << 20, max_field_chars=4096), **changes)
    return TrafficCapture(settings, random.Random(0))  # type: ignore[arg-type]


def record(prompt: str = "Write to ann@example.org today") -> dict[str, object]:
    return served_record(endpoint="completions", version="5", prompt=prompt, completion="Mail bob@x.io", prompt_tokens=7,
                         completion_tokens=3, status=200, latency_ms=41.25, ttft_ms=6.5, stream=True, error="")


def test_the_capture_writes_scrubbed_records_by_date_and_drops_beyond_its_bound(tmp_path: Path) -> None:
    kept = capture(tmp_path)
    for _ in range(5):
        if kept.take():
            kept.offer(record())
    assert kept.stats["sampled"] == 3 and kept.stats["dropped_full"] == 2  # never waits for room
    assert kept.pending[0]["prompt"] == "Write to ann@example.org today"  # raw until the writer scrubs it
    stats = asyncio.run(kept.flush())
    assert stats["written"] == 3 and stats["parts"] == 1 and not kept.pending
    parts = list((tmp_path / "served").glob("date=*/part-*.jsonl"))
    lines = [json.loads(line) for line in parts[0].read_text().splitlines()]
    assert parts[0].parent.name == f"date={lines[0]['time'][:10]}" and len(lines) == 3
    assert lines[0]["prompt"] == "Write to <email> today" and lines[0]["completion"] == "Mail <email>"
    assert lines[0]["version"] == "5" and lines[0]["ttft_ms"] == 6.5


def test_a_sample_takes_its_share_and_a_failed_write_only_drops_records(tmp_path: Path) -> None:
    sampled = capture(tmp_path, rate=0.25, max_pending=10_000)
    assert 850 < sum(sampled.take() for _ in range(4000)) < 1150
    assert not capture(tmp_path, rate=0.0).take()
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    broken = capture(tmp_path, uri=str(blocked / "served"))  # a file where the folder would be
    broken.offer(record())
    assert asyncio.run(broken.flush())["dropped_write"] == 1  # counted, not raised


def test_scrubbing_a_megabyte_word_takes_linear_time() -> None:
    """The writer scrubs every captured prompt: an e-mail pattern with open-ended repeats
    backtracked quadratically on one long word (8 kB: 62 ms; 1 MB: minutes)."""
    import time

    from tasks.lib.records import scrub

    started = time.perf_counter()
    assert scrub("a" * 1_000_000 + " x@y.io") == "a" * 1_000_000 + " <email>"
    assert time.perf_counter() - started < 5  # minutes with the old pattern


def test_the_drift_state_holds_other_checks_but_not_a_retry_of_its_own(tmp_path: Path) -> None:
    import datetime as dt

    from tasks.drift import retrain_wanted

    settings = dataclasses.replace(load_settings().drift, state_uri=str(tmp_path / "state.json"))
    now = dt.datetime(2026, 11, 26, 8, tzinfo=dt.UTC)
    assert retrain_wanted(settings, "5", now, "s3://runs/a/drift/report.html") == (True, None)
    state = {"champion": "5", "requested_at": now.isoformat(), "report_uri": "s3://runs/a/drift/report.html"}
    (tmp_path / "state.json").write_text(json.dumps(state))
    assert retrain_wanted(settings, "5", now, "s3://runs/a/drift/report.html")[0] is True  # its retry
    assert retrain_wanted(settings, "5", now + dt.timedelta(hours=1), "s3://runs/b/drift/report.html")[0] is False
    assert retrain_wanted(settings, "6", now, "s3://runs/b/drift/report.html")[0] is True  # a new champion
    assert retrain_wanted(settings, "5", now + dt.timedelta(hours=25), "s3://runs/c/drift/report.html")[0] is True


def test_the_chance_samples_come_from_the_other_half_of_the_documents() -> None:
    from tasks.drift import Reference

    tokens = np.arange(20)
    halves = Reference(tokens, np.array([0, 5, 9, 14])).halves()
    assert halves[0].tolist() == [*range(0, 5), *range(9, 14)] and halves[1].doc_starts.tolist() == [5, 14]
