"""The drift check's figures and bounds, in this process (the loop on the real stack:
tests/dags/test_llm_drift.py; the capture it reads: tests/tasks/serving/test_capture.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from tasks.lib.params import load_settings


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
