"""Served-traffic capture: a sample of what the OpenAI API answered, written to date partitions
(``{uri}/date=YYYY-MM-DD/part-<host>-<pid>-<time>-<n>.jsonl``) for the drift check.

Off the request path by construction: a request only appends a small dict to a bounded buffer
(dropped, and counted, when the buffer is full); a background task writes the buffer every
``flush_s`` in a worker thread, one S3 object per date (a single PUT: a reader sees a whole part
or none); a failed write drops its records (counted, logged once per failure), and the next
flush starts afresh. The sample is decided before a request's record is made, and prompts,
answers and errors are scrubbed of e-mail addresses (validation's rule) by the writer thread: a
request pays for neither.
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
from typing import Any

from tasks.config import Capture
from tasks.lib import storage
from tasks.lib.records import scrub

log = logging.getLogger("capture")
SCRUBBED = ("prompt", "completion", "error")  # what a user wrote or the model answered


class TrafficCapture:
    """The buffer, its writer and their counts (``stats``)."""

    def __init__(self, settings: Capture, rng: random.Random | None = None) -> None:
        self.settings = settings
        self.pending: deque[dict[str, Any]] = deque()
        self.rng = rng or random.Random()
        self.origin = f"{socket.gethostname()}-{os.getpid()}"
        self.parts = 0
        self.stats = {"sampled": 0, "written": 0, "dropped_full": 0, "dropped_write": 0, "parts": 0}
        self.lock = asyncio.Lock()  # one flush at a time (the timer's and an explicit one)

    @property
    def enabled(self) -> bool:
        return self.settings.rate > 0

    def take(self) -> bool:
        """Whether the sample takes the next request and the buffer has room for it (decided
        before its record is made: a request the sample leaves costs nothing)."""
        if not self.enabled or self.rng.random() >= self.settings.rate:
            return False
        if len(self.pending) >= self.settings.max_pending:
            self.stats["dropped_full"] += 1
            return False
        return True

    def offer(self, record: dict[str, Any]) -> None:
        """Keep a record :meth:`take` made room for (raw: scrubbed by the writer, off the request path)."""
        self.stats["sampled"] += 1
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
            if batch:
                try:
                    written = await asyncio.to_thread(self._write, batch)
                    self.stats["written"] += len(batch)
                    self.stats["parts"] += written
                except Exception as exc:  # S3 down or refusing: the records are lost, requests are not
                    self.stats["dropped_write"] += len(batch)
                    log.warning("capture: %d records not written (%s: %s)", len(batch), type(exc).__name__,
                                str(exc)[:200])
        return dict(self.stats)

    def _write(self, batch: list[dict[str, Any]]) -> int:
        by_date: dict[str, list[bytes]] = {}
        for record in batch:
            scrubbed = {**record, **{k: scrub(record[k]) for k in SCRUBBED if isinstance(record.get(k), str)}}
            line = json.dumps(scrubbed, ensure_ascii=False, sort_keys=True).encode("utf-8") + b"\n"
            by_date.setdefault(record["time"][:10], []).append(line)
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S")
        for date, lines in sorted(by_date.items()):
            self.parts += 1
            name = f"part-{self.origin}-{stamp}-{self.parts:06d}.jsonl"
            storage.write_bytes(storage.join(self.settings.uri, f"date={date}", name), b"".join(lines))
        return len(by_date)


def served_record(*, endpoint: str, version: str, prompt: str, completion: str, prompt_tokens: int,
                  completion_tokens: int, status: int, latency_ms: float, ttft_ms: float | None,
                  stream: bool, error: str) -> dict[str, Any]:
    """One captured request and its answer, as the drift check reads it (scrubbed when written)."""
    return {
        "time": dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds"),
        "endpoint": endpoint,
        "version": version,
        "prompt": prompt,
        "completion": completion,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "status": status,
        "latency_ms": round(latency_ms, 3),
        "ttft_ms": None if ttft_ms is None else round(ttft_ms, 3),
        "stream": stream,
        "error": error,
    }
