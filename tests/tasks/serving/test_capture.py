"""The served-traffic capture (tasks/serving/capture.py) in this process: its sample, its bounds,
its writer; against the real front: tests/tasks/serving/test_front.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
from pathlib import Path

from tasks.config import Capture
from tasks.serving.capture import CapturedAnswer, CapturedRequest, TrafficCapture, served_record


def capture(tmp_path: Path, **changes: object) -> TrafficCapture:
    settings = dataclasses.replace(Capture(rate=1.0, uri=str(tmp_path / "served"), flush_s=60, max_pending=3,
                                                         max_pending_bytes=1 << 20, max_field_chars=4096), **changes)
    return TrafficCapture(settings, random.Random(0))  # type: ignore[arg-type]


def record(prompt: str = "Write to ann@example.org today") -> dict[str, object]:
    return served_record(CapturedRequest(endpoint="completions", prompt=prompt, prompt_tokens=7, stream=True),
                         CapturedAnswer(version="5", completion="Mail bob@x.io", completion_tokens=3, status=200,
                                        latency_ms=41.25, ttft_ms=6.5, error=""))


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


def test_a_record_is_cut_to_its_bound_and_the_buffer_is_bounded_in_bytes(tmp_path: Path) -> None:
    """A megabyte prompt costs the writer what 4,096 characters and a margin do, and is written
    as 4,096 characters saying how many were cut, scrubbed before the cut (an address across it
    leaves no part behind); past max_pending_bytes of pending text new records are dropped,
    however few they are."""
    from tasks.serving.capture import SCRUB_MARGIN

    bounded = capture(tmp_path, max_pending=100, max_pending_bytes=10_000)
    huge = "x" * 4050 + " jane.doe@example.org " + "a@b.io " * 150_000  # the address across the cut
    for _ in range(4):
        if bounded.take():
            bounded.offer(record(prompt=huge))
    kept = list(bounded.pending)
    assert len(kept) == 3 and bounded.stats["dropped_full"] == 1  # 3 x 4,608 bytes passed 10,000
    assert all(len(r["prompt"]) == 4096 + SCRUB_MARGIN for r in kept)
    assert bounded.pending_bytes == sum(len(r["prompt"].encode()) + len(r["completion"].encode()) for r in kept)
    stats = asyncio.run(bounded.flush())
    assert stats["written"] == 3 and bounded.pending_bytes == 0 and bounded.take()
    lines = [json.loads(line) for part in (tmp_path / "served").glob("date=*/*.jsonl")
             for line in part.read_text().splitlines()]
    assert all(len(line["prompt"]) == 4096 and line["prompt"].endswith(f"[...{len(huge) - 4096} characters cut]")
               for line in lines)
    assert all("jane" not in line["prompt"] and "<email>" in line["prompt"] and "_lengths" not in line
               for line in lines)


def test_a_cancelled_flush_still_writes_and_counts_what_it_took(tmp_path: Path) -> None:
    """A flush whose caller goes away (a client of /capture/flush, the front shutting down)
    finishes its write: the records it took from the buffer are counted, none lost unseen."""
    shielded = capture(tmp_path, max_pending=10)
    for _ in range(3):
        assert shielded.take()
        shielded.offer(record())

    async def cancel_midway() -> None:
        flush = asyncio.ensure_future(shielded.flush())
        await asyncio.sleep(0)  # it took the batch and started writing
        flush.cancel()
        await asyncio.sleep(0.5)

    asyncio.run(cancel_midway())
    assert shielded.stats["written"] == 3 and not shielded.pending, shielded.stats


def test_a_record_that_cannot_be_written_is_dropped_alone(tmp_path: Path) -> None:
    """A lone surrogate (a header byte that was not UTF-8) fails its own record, not the batch."""
    mixed = capture(tmp_path, max_pending=10)
    for version in ("5", "\udcff", "6"):
        assert mixed.take()
        mixed.offer({**record(), "version": version})
    stats = asyncio.run(mixed.flush())
    assert stats["written"] == 2 and stats["dropped_bad"] == 1 and stats["dropped_write"] == 0, stats
    lines = [json.loads(line) for part in (tmp_path / "served").glob("date=*/*.jsonl")
             for line in part.read_text().splitlines()]
    assert sorted(line["version"] for line in lines) == ["5", "6"]
