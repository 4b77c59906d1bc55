"""The drift check's figures and bounds, in this process (the loop on the real stack:
tests/dags/test_llm_drift.py; the capture it reads: tests/tasks/serving/test_capture.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

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


def test_a_bound_crossed_is_named_and_none_crossed_is_no_drift() -> None:
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


# -- who drives a verdict: each prompt weighs the same, drift from enough clients -----------------
# A world of its own: the training data draws tokens 0..499 (Zipf); another script is tokens
# 600..727, each a byte-fallback token; the champion a unigram model of the training data.

ENGLISH, FOREIGN = 500, np.arange(600, 728)
VOCAB = 1000


def english(rng: np.random.Generator, count: int, fewest: int, most: int) -> list[np.ndarray]:
    probs = 1 / np.arange(1, ENGLISH + 1) ** 1.1
    return [rng.choice(ENGLISH, size=int(rng.integers(fewest, most + 1)), p=probs / probs.sum()) for _ in range(count)]


def foreign(rng: np.random.Generator, count: int, fewest: int = 6, most: int = 16) -> list[np.ndarray]:
    return [rng.choice(FOREIGN, size=int(rng.integers(fewest, most + 1))) for _ in range(count)]


@pytest.fixture(scope="module")
def world() -> dict[str, Any]:
    import torch

    from tasks.drift import Reference

    rng = np.random.default_rng(0)
    documents = english(rng, 800, 30, 300)
    tokens = np.concatenate(documents)
    reference = Reference(tokens, np.concatenate([[0], np.cumsum([len(d) for d in documents])[:-1]]))
    counts = np.bincount(tokens, minlength=VOCAB) + 0.01

    class Unigram(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.logits = torch.log(torch.as_tensor(counts / counts.sum(), dtype=torch.float32))

        def forward(self, ids: Any) -> Any:
            return self.logits.repeat(*ids.shape, 1)

    # held-out text as users ask it: the openings of other documents, 150 from 30 clients
    normal = [d[:n] for d, n in zip(english(rng, 150, 30, 300), rng.integers(4, 21, 150), strict=True)]
    return {"reference": reference, "model": Unigram(), "normal": normal, "rng": rng,
            "normal_clients": [frozenset({f"{i % 30:016x}"}) for i in range(150)]}


def assess(world: dict[str, Any], prompts: list[np.ndarray], clients: list[frozenset[str]], **settings: Any) -> dict[str, Any]:
    import random

    from tasks.drift import AskedPrompts, Champion, Vocabulary, assess

    drift = dataclasses.replace(load_settings().drift, **settings)
    return assess(AskedPrompts(world["normal"] + prompts, world["normal_clients"] + clients), world["reference"],
                  Vocabulary(VOCAB, FOREIGN), Champion(world["model"], 128), drift, random.Random(1))


def test_each_prompt_weighs_the_same_so_a_few_huge_prompts_do_not_make_the_figures(world: dict[str, Any]) -> None:
    from tasks.drift import NO_DRIFT, share_of

    calm = assess(world, [], [])
    huge = foreign(world["rng"], 6, 5000, 5000)  # one client's 6 prompts: 30,000 tokens, the others' ~1,800
    assert share_of(world["normal"] + huge, FOREIGN) > 0.9  # counted by tokens, they would be the window
    found = assess(world, huge, [frozenset({"f" * 16})])
    assert calm["verdict"] == found["verdict"] == NO_DRIFT, found["reasons"]
    before, after = calm["figures"], found["figures"]
    assert after["prompts_capped"] == 6 and after["tokens"] < before["tokens"] + 6 * 256 + 1
    # 6 prompts of 156: each figure moves by about what 6 drifted prompts of normal size would move it
    assert after["js_excess_bits"] - before["js_excess_bits"] < 0.05
    assert after["byte_fallback_excess"] == pytest.approx(6 / 156, abs=0.005)
    assert after["perplexity_ratio"] < 2.0 and before["perplexity_ratio"] < 1.3
    assert found["bounds"] and not any(b["crossed"] for b in found["bounds"])


def test_fifty_drifted_prompts_from_one_client_are_drift_from_too_few_clients(world: dict[str, Any]) -> None:
    from tasks.drift import FEW_CLIENTS

    one = "a" * 16
    found = assess(world, foreign(world["rng"], 50), [frozenset({one})] * 50)
    assert [r.split(":")[0] for r in found["reasons"]][-3:] == ["byte fallback", "surprise", "clients"]
    assert found["verdict"] == FEW_CLIENTS, found["reasons"]
    clients = found["clients"]
    assert clients["driven_by"] == 1 and clients["removed"] == [one] and clients["distinct"] == 31
    assert clients["without_removed"]["crossed"] == []  # without its prompts every bound holds
    top = clients["top"][0]
    assert top["client"] == one and top["prompts"] == 50 and top["share_of_drift"] > 0.95
    assert len(clients["top"]) == 1  # no other client moves the figures
    assert found["reasons"][-1].startswith("clients: drift from too few (drift.min_clients 3; 31 distinct in the window): "
                                           "without the prompts of 1 client every bound holds; top by share of the "
                                           f"drift: {one} ")

    # records captured without a client (or before clients were recorded): one unknown client
    found = assess(world, foreign(world["rng"], 50), [frozenset({""})] * 50)
    assert found["verdict"] == FEW_CLIENTS and found["clients"]["top"][0]["client"] == ""
    assert "(unknown) " in found["reasons"][-1]

    # two clients, or the same prompts from two addresses: still too few
    drifted = foreign(world["rng"], 50)
    found = assess(world, drifted, [frozenset({"b" * 16}), frozenset({"c" * 16})] * 25)
    assert found["verdict"] == FEW_CLIENTS and found["clients"]["driven_by"] == 2
    found = assess(world, drifted, [frozenset({"b" * 16, "c" * 16})] * 50)
    assert found["verdict"] == FEW_CLIENTS and found["clients"]["driven_by"] == 2
    # ... beside a client with more prompts than either, all ordinary: the two are still the ones removed
    busy = [d[:12] for d in english(world["rng"], 80, 30, 300)]
    found = assess(world, drifted + busy, [frozenset({"b" * 16, "c" * 16})] * 50 + [frozenset({"e" * 16})] * 80)
    assert found["verdict"] == FEW_CLIENTS and set(found["clients"]["removed"]) == {"b" * 16, "c" * 16}


def test_drift_from_min_clients_clients_is_drift_and_names_them(world: dict[str, Any]) -> None:
    from tasks.drift import DRIFT, FEW_CLIENTS

    senders = [f"{i:016x}" for i in range(100, 103)]
    found = assess(world, foreign(world["rng"], 50), [frozenset({senders[i % 3]}) for i in range(50)])
    assert found["verdict"] == DRIFT, found["reasons"]
    clients = found["clients"]
    assert clients["seen_from_enough"] and clients["driven_by"] is None and len(clients["removed"]) == 2
    assert set(clients["removed"]) < set(senders) and clients["without_removed"]["crossed"]  # still crossed
    assert {t["client"] for t in clients["top"][:3]} == set(senders)
    assert found["reasons"][-1].startswith("clients: seen from at least 3 (drift.min_clients 3; 33 distinct in the "
                                           "window): still crossed without the prompts of the 2 driving it most")
    # each prompt asked by all three: drift seen from three clients
    assert assess(world, foreign(world["rng"], 50), [frozenset(senders)] * 50)["verdict"] == DRIFT
    # the same prompts, a stricter deployment: 4 clients needed
    assert assess(world, foreign(world["rng"], 50), [frozenset({senders[i % 3]}) for i in range(50)],
                  min_clients=4)["verdict"] == FEW_CLIENTS


def test_the_report_heading_says_what_happened() -> None:
    from tasks.drift import DRIFT, FEW_CLIENTS, NO_DRIFT, NO_VERDICT, heading, render_html

    bounds = [{"bound": n, "figure": "f", "value": 1.0, "limit": 0.5, "crossed": c}
              for n, c in (("token distribution", False), ("byte fallback", True), ("surprise", True))]
    report = {"verdict": DRIFT, "outcome": "drift: a retrain is requested", "bounds": bounds, "reasons": [],
              "clients": {"min_clients": 3, "driven_by": None}, "figures": {}, "served_uri": "s3://raw/served",
              "window": {"start": "2026-11-25T00:00:00+00:00", "end": "2026-11-26T00:00:00+00:00"}}
    assert heading(report) == "Drift: 2 of 3 bounds crossed, seen from at least 3 clients"
    few = {**report, "verdict": FEW_CLIENTS, "clients": {"min_clients": 3, "driven_by": 1}}
    assert heading(few) == ("Drift seen from too few clients: 2 of 3 bounds crossed, by the prompts of 1 client "
                            "(at least 3 needed): no retrain")
    calm = {**report, "verdict": NO_DRIFT, "bounds": [{**b, "crossed": False} for b in bounds]}
    assert heading(calm) == "No drift: all 3 bounds held"
    assert heading({**report, "verdict": NO_VERDICT, "outcome": "too little traffic"}) == "No verdict: too little traffic"
    page = render_html(few, None)
    assert "<h1>Drift seen from too few clients: 2 of 3" in page and "Bounds passed" not in page
    assert page.count("<b>crossed</b>") == 2 and page.count("<b>held</b>") == 1


def test_each_distinct_prompt_once_with_every_client_that_asked_it() -> None:
    from tasks.drift import distinct_prompts

    records = [{"prompt": "a", "client": "1" * 16}, {"prompt": "b"}, {"prompt": "a", "client": "2" * 16},
               {"prompt": "a", "client": "1" * 16}, {"prompt": "c", "client": None}]
    assert distinct_prompts(records) == (["a", "b", "c"], [frozenset({"1" * 16, "2" * 16}), frozenset({""}),
                                                          frozenset({""})])


DRIFTED = {"js_excess_bits": 0.31, "byte_fallback_excess": 0.55, "perplexity_ratio": 24.0}


def test_a_retrain_is_started_by_a_drift_checks_report_completed_from_it_and_refused_for_no_drift(tmp_path: Path) -> None:
    from tasks.drift import DRIFT, NO_DRIFT, started_by
    from tasks.lib.errors import StepError

    checked = tmp_path / "drift"
    checked.mkdir()
    report = {"verdict": DRIFT, "champion": "3", "reasons": ["byte fallback: 55%"], "clients": {"distinct": 6,
              "min_clients": 3, "seen_from_enough": True, "driven_by": None, "removed": [], "top": []}}
    (checked / "report.json").write_text(json.dumps(report))
    trigger = json.dumps({"drift_report": str(checked / "report.html")})
    found = started_by(trigger)
    assert found["champion"] == "3" and found["drift_reasons"] == ["byte fallback: 55%"]
    assert found["drift_clients"]["seen_from_enough"] is True and found["drift_report"].endswith("report.html")
    assert started_by("{}") == {} and started_by("") == {}  # a run something else started
    (checked / "report.json").write_text(json.dumps({**report, "verdict": NO_DRIFT}))
    with pytest.raises(StepError, match="found 'no drift', not drift: there is nothing for a retrain to answer"):
        started_by(trigger)
    with pytest.raises(StepError, match=r"no drift check.s report\.json beside it"):
        started_by(json.dumps({"drift_report": str(tmp_path / "elsewhere" / "report.html")}))
    with pytest.raises(StepError, match="--trigger: invalid JSON"):
        started_by("{not json")


def test_the_loop_closes_when_every_bound_holds_and_a_bound_still_crossed_says_why() -> None:
    from tasks.drift import loop_bounds, loop_heading, moved

    settings = load_settings().drift
    before = {"figures": DRIFTED, "tokenizer_uri": "s3://tok/a.json"}
    learnt = {"figures": {"js_excess_bits": 0.09, "byte_fallback_excess": 0.31, "perplexity_ratio": 1.6},
              "tokenizer_uri": "s3://tok/a.json"}
    bounds = loop_bounds(before, learnt, settings)
    assert [(b.bound, b.crossed_before, b.crossed_after) for b in bounds] == [
        ("token distribution", True, False), ("byte fallback", True, True), ("surprise", True, False)]
    assert "vocabulary did not grow" in bounds[1].why and not bounds[0].why and not bounds[2].why
    assert loop_heading(bounds, "3", "4") == ("Drift loop not closed: byte fallback still crossed with v4 on the "
                                              "same traffic (v3: 3 crossed)")
    assert moved(bounds[1]) == "byte fallback +55.0 points -> +31.0 points (crossed, bound +5.0 points)"
    assert moved(bounds[2]) == "surprise 24.0x -> 1.6x (held, bound 3.0x)"
    grown = loop_bounds(before, {**learnt, "tokenizer_uri": "s3://tok/b.json"}, settings)
    assert "grown vocabulary still lacks" in grown[1].why
    calm = {"figures": {"js_excess_bits": 0.0, "byte_fallback_excess": 0.01, "perplexity_ratio": 1.2}}
    closed = loop_bounds(before, calm, settings)
    assert not any(b.crossed_after for b in closed)
    assert loop_heading(closed, "3", "4") == "Drift loop closed: all 3 bounds held on the same traffic with v4 (v3: 3 crossed)"


def test_the_run_report_and_the_recheck_page_show_each_bound_before_and_after() -> None:
    import dataclasses as dc

    from tasks.contract import to_json
    from tasks.drift import DRIFT, loop_bounds, loop_heading, render_html
    from tasks.report import drift_loop_lines
    from tasks.results import DriftRecheck

    settings = load_settings().drift
    bounds = loop_bounds({"figures": DRIFTED}, {"figures": {**DRIFTED, "perplexity_ratio": 1.6}}, settings)
    title = loop_heading(bounds, "3", "4")
    recheck = DriftRecheck(closed=False, heading=title, started_by="s3://runs/d/drift/report.html", champion_before="3",
                           champion_after="4", bounds=tuple(bounds), report_uri="s3://runs/r/drift_recheck/report.html")
    lines = drift_loop_lines(to_json(recheck))
    assert lines[0] == f"  drift loop  {title} (report s3://runs/r/drift_recheck/report.html)"
    assert lines[3].strip() == "surprise 24.0x -> 1.6x (held, bound 3.0x)" and "did not grow" not in lines[3]
    assert drift_loop_lines({}) == []  # a run the drift check did not start
    rejected = dc.replace(recheck, closed=None, heading="the champion is still v3 ...", bounds=(), report_uri=None)
    assert drift_loop_lines(to_json(rejected)) == ["  drift loop  open: the champion is still v3 ..."]
    report = {"verdict": DRIFT, "outcome": "...", "reasons": [], "figures": {}, "served_uri": "s3://raw/served",
              "window": {"start": "2026-11-25T00:00:00+00:00", "end": "2026-11-26T00:00:00+00:00"}, "champion": "4",
              "loop": {"heading": title, "closed": False, "started_by": recheck.started_by, "champion_before": "3",
                       "verdict_before": DRIFT, "bounds": [dc.asdict(b) for b in bounds]}}
    page = render_html(report, None)
    assert f"<h1>{title}</h1>" in page and "<h2>Before and after the retrain</h2>" in page
    assert page.count("<b>crossed</b>") == 2 and page.count("<b>held</b>") == 1


def test_the_demo_generator_lands_a_share_of_its_documents_in_the_drifted_domain() -> None:
    import hashlib

    from tasks.seed import DRIFTED_SOURCE, drifted, transliterate

    rows = [{"id": hashlib.sha1(str(i).encode()).hexdigest()[:20], "text": "Return the number of items.",
             "source": "python-docstring:x"} for i in range(400)]
    assert drifted(rows, 0.0) == rows
    half = drifted(rows, 0.5)
    moved_rows = [r for r in half if r["source"].startswith(DRIFTED_SOURCE)]
    assert 150 < len(moved_rows) < 250 and all(r["text"] == transliterate("Return the number of items.")
                                                   for r in moved_rows)
    assert transliterate("Return") == "Ретурн" and drifted(rows, 1.0) == [
        {**r, "text": transliterate(r["text"]), "source": DRIFTED_SOURCE + r["source"]} for r in rows]


def test_a_drift_started_challenger_must_be_less_surprised_by_the_drifted_prompts_than_the_champion() -> None:
    from tasks.evaluate import judge_drifted
    from tasks.results import DriftedFigures

    learnt = DriftedFigures(drift_report="s3://runs/d/drift/report.html", prompts=189, challenger_bits_per_byte=0.4,
                            champion_bits_per_byte=3.1)
    assert judge_drifted(learnt) == []
    assert judge_drifted(DriftedFigures("s3://r", 189, 3.2, None)) == []  # the first model: nothing to beat
    same = judge_drifted(DriftedFigures("s3://runs/d/drift/report.html", 189, 3.1, 3.1))
    assert same == ["the drifted traffic (189 prompts of s3://runs/d/drift/report.html): 3.100 bits per byte, no "
                    "better than the champion's 3.100: the retrain did not learn what the drift check found"]
    assert judge_drifted(DriftedFigures("s3://r", 189, float("nan"), 3.1))  # not finite: no pass


def test_the_drifted_prompts_surprise_is_bits_per_byte_after_the_first_token_in_the_models_context(tmp_path: Path) -> None:
    import math

    import torch

    from tasks.evaluate import prompt_bits_per_byte
    from tasks.lib import tokens
    from tasks.lib.model import GPT, GPTConfig
    from tasks.lib.model_store import LoadedModel

    texts = ["Return the number of items in the list.", "Цомпуте тхе 1-Д дисцрете Фоуриер Трансформ", "x"]
    tokenizer = tokens.train_tokenizer([texts[0]] * 20, 300)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tokenizer.get_vocab_size(), seq_len=16, d_model=32, n_layers=2, n_heads=4)).eval()
    loaded = LoadedModel(model, {"tokenizer_uri": str(tmp_path / "tokenizer.json"), "tokenizer_hash": "0" * 64})

    def by_hand(text: str) -> float:
        encoding = tokenizer.encode(text, add_special_tokens=False)
        ids = encoding.ids[-16:]  # the model's context: the last seq_len tokens
        first = len(encoding.ids) - len(ids) + 1
        with torch.no_grad():
            logits = model(torch.tensor([ids[:-1]]))
            nats = float(torch.nn.functional.cross_entropy(logits[0], torch.tensor(ids[1:]), reduction="sum"))
        predicted = text[encoding.offsets[first][0]:encoding.offsets[-1][1]]
        return nats / math.log(2) / len(predicted.encode())

    assert len(tokenizer.encode(texts[1], add_special_tokens=False).ids) > 16  # read in its last 16 tokens
    found = prompt_bits_per_byte(loaded, texts, 256, tmp_path)  # "x": one token, nothing predicted, left out
    assert math.isclose(found, (by_hand(texts[0]) + by_hand(texts[1])) / 2, rel_tol=1e-5)


def test_the_recheck_waits_for_this_runs_own_version_as_champion() -> None:
    from tasks.drift import registered_version
    from tasks.lib.errors import StepError

    assert registered_version('{"model_name": "m", "version": "4", "challenger": "4", "new": true}') == "4"
    assert registered_version("null") == "" and registered_version("") == ""  # a rejected challenger registers none
    with pytest.raises(StepError, match="--registered: invalid JSON"):
        registered_version("{")
