"""Served-traffic capture: a sample of what the OpenAI API answered, written to date partitions
(``{uri}/date=YYYY-MM-DD/part-<host>-<pid>-<time>-<n>.jsonl``) for the drift check.

Off the request path by construction: a request only appends a small dict to a bounded buffer
(bounded in records and in bytes: dropped, and counted, when full); each prompt, answer and
error is cut to ``max_field_chars`` (marked; scrubbed first, with a margin kept to the cut, so
that nothing personal survives in part), so what one record costs the writer is bounded too. A background task writes the buffer every ``flush_s`` in a worker thread, one S3
object per date (a single PUT: a reader sees a whole part or none); a record that cannot be
written (text that does not encode) is dropped alone and counted; a failed write drops its
batch (counted, logged once per failure), and the next flush starts afresh. The sample is
decided before a request's record is made, and personal data (:func:`tasks.lib.records.scrub`)
is replaced by the writer thread: a request pays for neither.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import os
import random
import socket
from collections import deque
from dataclasses import dataclass
from typing import Any

from tasks.config import Capture
from tasks.lib import storage
from tasks.lib.records import scrub

log = logging.getLogger("capture")
SCRUBBED = ("prompt", "completion", "error")  # what a user wrote or the model answered
SCRUB_MARGIN = 512  # characters kept past a field's bound until it is scrubbed: longer than any one match


class TrafficCapture:
    """The buffer, its writer and their counts (``stats``)."""

    def __init__(self, settings: Capture, rng: random.Random | None = None) -> None:
        self.settings = settings
        self.pending: deque[dict[str, Any]] = deque()
        self.rng = rng or random.Random()
        self.origin = f"{socket.gethostname()}-{os.getpid()}"
        self.parts = 0
        self.pending_bytes = 0  # of the pending records' text (what their size is made of)
        self.stats = {"sampled": 0, "written": 0, "dropped_full": 0, "dropped_write": 0, "dropped_bad": 0, "parts": 0}
        self.lock = asyncio.Lock()  # one flush at a time (the timer's and an explicit one)

    @property
    def enabled(self) -> bool:
        return self.settings.rate > 0

    def take(self) -> bool:
        """Whether the sample takes the next request and the buffer has room for it (decided
        before its record is made: a request the sample leaves costs nothing)."""
        if not self.enabled or self.rng.random() >= self.settings.rate:
            return False
        if len(self.pending) >= self.settings.max_pending or self.pending_bytes >= self.settings.max_pending_bytes:
            self.stats["dropped_full"] += 1
            return False
        return True

    def offer(self, record: dict[str, Any]) -> None:
        """Keep a record :meth:`take` made room for (scrubbed later by the writer, off the request
        path). A text longer than ``max_field_chars`` keeps that much and a margin: an address or a
        card number across the cut is scrubbed whole before the writer cuts it to its bound."""
        kept = self.settings.max_field_chars + SCRUB_MARGIN
        lengths = record["_lengths"] = {}
        for name in SCRUBBED:
            if isinstance(text := record.get(name), str) and len(text) > self.settings.max_field_chars:
                lengths[name] = len(text)
                record[name] = text[:kept]
        record["_bytes"] = sum(len(text.encode("utf-8", "surrogatepass")) for name in SCRUBBED
                               if isinstance(text := record.get(name), str))
        self.stats["sampled"] += 1
        self.pending_bytes += record["_bytes"]
        self.pending.append(record)

    async def run(self) -> None:
        """Flush every ``flush_s`` until cancelled (then once more)."""
        try:
            while True:
                await asyncio.sleep(self.settings.flush_s)
                await self.flush()
        finally:
            await asyncio.shield(self.flush())

    async def flush(self) -> dict[str, int]:
        """Write what is pending now (records arriving meanwhile wait for the next flush)."""
        async with self.lock:
            batch = [self.pending.popleft() for _ in range(len(self.pending))]
            self.pending_bytes -= sum(record.pop("_bytes", 0) for record in batch)
            if batch:
                # shielded: a flush whose caller is cancelled (a client gone, shutdown) still
                # writes and counts what it took from the buffer
                await asyncio.shield(self._write_and_count(batch))
        return dict(self.stats)

    async def _write_and_count(self, batch: list[dict[str, Any]]) -> None:
        try:
            written, bad = await asyncio.to_thread(self._write, batch)
            self.stats["written"] += len(batch) - bad
            self.stats["dropped_bad"] += bad
            self.stats["parts"] += written
        except Exception as exc:  # S3 down or refusing: the records are lost, requests are not
            self.stats["dropped_write"] += len(batch)
            log.warning("capture: %d records not written (%s: %s)", len(batch), type(exc).__name__, str(exc)[:200])

    def _write(self, batch: list[dict[str, Any]]) -> tuple[int, int]:
        """Write ``batch``: the parts written, and the records dropped because they cannot be."""
        by_date: dict[str, list[bytes]] = {}
        bad = 0
        for record in batch:
            try:
                lengths = record.pop("_lengths", {})
                scrubbed = {**record, **{k: bounded(scrub(record[k]), lengths.get(k), self.settings.max_field_chars)
                                         for k in SCRUBBED if isinstance(record.get(k), str)}}
                line = json.dumps(scrubbed, ensure_ascii=False, sort_keys=True).encode("utf-8") + b"\n"
            except (UnicodeError, TypeError, ValueError) as exc:  # e.g. a lone surrogate from a header byte
                bad += 1
                log.warning("capture: a record dropped, it cannot be written (%s)", str(exc)[:200])
                continue
            by_date.setdefault(record["time"][:10], []).append(line)
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S")
        for date, lines in sorted(by_date.items()):
            self.parts += 1
            name = f"part-{self.origin}-{stamp}-{self.parts:06d}.jsonl"
            storage.write_bytes(storage.join(self.settings.uri, f"date={date}", name), b"".join(lines))
        return len(by_date), bad


def bounded(text: str, length: int | None, limit: int) -> str:
    """A scrubbed text within ``limit`` characters; ``length``: the original's, where
    :meth:`TrafficCapture.offer` kept only its start: then cut, saying how many characters were."""
    if length is None and len(text) <= limit:
        return text
    marker = f" [...{(length or len(text)) - limit} characters cut]"
    return text[:max(limit - len(marker), 0)] + marker


@dataclass(frozen=True)
class CapturedRequest:
    """What a client asked: the endpoint (``completions`` or ``chat``), its prompt (``""`` for a
    refused request: it may be anything a client sent) and its tokens, whether it streamed, and
    the client's address, hashed (``""``: unknown)."""

    endpoint: str
    prompt: str
    prompt_tokens: int
    stream: bool
    client: str = ""


@dataclass(frozen=True)
class CapturedAnswer:
    """What it got: the version that answered, the completion and its tokens, the HTTP status,
    the latency and time to first token (milliseconds; None: no token came), the error."""

    version: str
    completion: str
    completion_tokens: int
    status: int
    latency_ms: float
    ttft_ms: float | None
    error: str


def served_record(request: CapturedRequest, answer: CapturedAnswer) -> dict[str, Any]:
    """One captured request and its answer, as the drift check reads it (scrubbed when written)."""
    return {
        "time": dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds"),
        "endpoint": request.endpoint,
        "version": answer.version,
        "prompt": request.prompt,
        "completion": answer.completion,
        "prompt_tokens": request.prompt_tokens,
        "completion_tokens": answer.completion_tokens,
        "status": answer.status,
        "latency_ms": round(answer.latency_ms, 3),
        "ttft_ms": None if answer.ttft_ms is None else round(answer.ttft_ms, 3),
        "stream": request.stream,
        "error": answer.error,
        "client": request.client,
    }
