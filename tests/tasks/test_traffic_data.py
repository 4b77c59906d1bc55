"""Captured traffic as training data (snapshot.learn_from_traffic), in this process on local
folders: which prompts of a drift check's window a retrain may learn from, how the snapshot takes
them, and that the gate judges on the others."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from pathlib import Path

import pytest

from tasks.config import load
from tasks.drift import held_out
from tasks.evaluate import drifted_prompts
from tasks.lib import records
from tasks.seed import documents, transliterate
from tasks.snapshot import collect, traffic_sample

START = dt.datetime(2026, 11, 23, 10, tzinfo=dt.UTC)
DAY = dt.date(2026, 11, 22)


def capture(folder: Path, prompts: list[str]) -> str:
    """A drift check's report.json over a capture holding ``prompts`` (each asked twice)."""
    served = folder / "served"
    part = served / f"date={START.date().isoformat()}" / "part-0.jsonl"
    part.parent.mkdir(parents=True)
    lines = [json.dumps({"time": (START + dt.timedelta(minutes=i % 600)).isoformat(), "prompt": p, "client": f"c{i % 5}"})
             for i, p in enumerate(prompts * 2)]
    part.write_text("\n".join(lines) + "\n")
    (folder / "drift").mkdir()
    window = {"start": START.isoformat(), "end": (START + dt.timedelta(hours=12)).isoformat(), "hours": 12}
    (folder / "drift" / "report.json").write_text(json.dumps({"verdict": "drift", "window": window,
                                                              "served_uri": str(served)}))
    return str(folder / "drift" / "report.html")


def raw_partition(folder: Path, texts: list[str]) -> str:
    source = folder / "raw"
    part = source / f"date={DAY.isoformat()}" / "part-0.jsonl"
    part.parent.mkdir(parents=True)
    part.write_text("".join(json.dumps({"id": f"d{i}", "text": t, "source": "docs", "created_at": "2026-11-22"}) + "\n"
                            for i, t in enumerate(texts)))
    (part.parent / "_SUCCESS").write_text("")
    return str(source)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [text for _, text in documents(400)]


def test_the_sample_is_scrubbed_filtered_and_never_the_held_out_slice(tmp_path: Path, texts: list[str]) -> None:
    drifted = [transliterate(t) for t in texts[:200]]
    odd = ["write to jane.doe@example.com about " + drifted[0], "hi", "1234 5678 9012 3456 7890 1234",
           "broken \ufffd text " + drifted[1]]
    report = capture(tmp_path, drifted + odd)
    params = load(section="snapshot").snapshot
    sample = traffic_sample(report, params, 0.5)
    learnt = {r["text"] for r in sample.records}
    assert sample.prompts == len(drifted) + len(odd)
    assert sample.held_out == sum(held_out(p, 0.5) for p in drifted + odd)
    assert 0 < len(learnt) == sample.prompts - sample.held_out - sample.dropped_length - sample.dropped_text
    assert not learnt & {records.normalize_text(p) for p in drifted + odd if held_out(p, 0.5)}
    assert all(params.traffic_min_chars <= len(t) <= params.traffic_max_chars for t in learnt)
    assert not any("@example.com" in t or "\ufffd" in t or t.startswith("1234") for t in learnt)
    if not held_out(odd[0], 0.5):  # scrubbed again: the address replaced, the prompt kept
        assert "write to <email> about " + records.normalize_text(drifted[0]) in learnt
    assert all(r["source"] == f"traffic:{report}" and r["id"].startswith("traffic-") for r in sample.records)
    # the gate's prompts are the held-out slice: no retrain learnt them
    judged = drifted_prompts(report, 5000, 0.5)
    assert judged and all(held_out(p, 0.5) for p in judged) and not set(judged) & learnt
    assert traffic_sample(report, params, 0.5) == sample  # the same window, the same sample


def test_the_snapshot_takes_traffic_after_the_documents_within_its_share(tmp_path: Path, texts: list[str]) -> None:
    source = raw_partition(tmp_path, texts[:300])
    sample = traffic_sample(capture(tmp_path, [transliterate(t) for t in texts[300:]] + texts[:20]),
                            load(section="snapshot").snapshot, 0.5)
    documents_bytes = sum(len(records.normalize_text(t).encode()) for t in texts[:300])
    for share in (0.01, 0.5):
        result, partitions, taken = collect(source, [DAY], 1 << 20, tmp_path / f"dedup-{share}",
                                            (sample.records, share))
        kept = list(result)
        traffic = [r for r in kept if r["source"].startswith("traffic:")]
        assert partitions[DAY.isoformat()]["records"] == 300  # the day's own counts
        assert len(traffic) == taken["records"] - taken["repeated"]
        assert taken["records"] + taken["capped"] == len(sample.records)
        # a prompt that repeats a document is not a second copy of it
        assert not {r["text"] for r in traffic} & {records.normalize_text(t) for t in texts[:300]}
        assert taken["bytes"] == sum(len(r["text"].encode()) for r in traffic)  # what was kept, not what was offered
        assert taken["bytes"] <= share / (1 - share) * documents_bytes
        is_traffic = [r["source"].startswith("traffic:") for r in kept]
        assert is_traffic == sorted(is_traffic)  # after every document
    assert taken["capped"] == 0 and taken["repeated"] > 0  # at half, every prompt fits: the repeated ones dropped


def test_settings_bound_the_share_and_the_held_out_slice() -> None:
    from tasks.config import SettingsError

    for section, override, message in (("snapshot", "traffic_max_share=1", "traffic_max_share"),
                                       ("snapshot", "traffic_min_chars=50000", "traffic_min_chars"),
                                       ("drift", "heldout_fraction=0", "heldout_fraction")):
        with pytest.raises(SettingsError, match=message):
            load(section=section, overrides=[override])
    assert not load().snapshot.learn_from_traffic  # opt-in
    assert dataclasses.replace(load().drift, heldout_fraction=1.0).heldout_fraction == 1.0
