"""Raw text records: the partition layout, parsing with clear errors, and normalization.

A record is one JSON object per line: ``id``, ``text``, ``source``, ``created_at``. Raw data
sits under ``{source}/date=YYYY-MM-DD/*.jsonl`` and is never rewritten.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from tasks.lib import storage
from tasks.lib.errors import StepError

REQUIRED_FIELDS = ("id", "text", "source", "created_at")
PARTITION_RE = re.compile(r"/date=(\d{4}-\d{2}-\d{2})/[^/]+\.jsonl$")
# C0/C1 control characters except tab and newline; also lone surrogates cannot occur after decoding
CONTROL_CHARS_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def partition_uri(source: str, day: dt.date) -> str:
    return storage.join(source, f"date={day.isoformat()}")


def interval_days(end_date: dt.date, lookback_days: int) -> list[dt.date]:
    """The ``lookback_days`` dates before ``end_date`` (exclusive), oldest first."""
    return [end_date - dt.timedelta(days=back) for back in range(lookback_days, 0, -1)]


def partition_files(source: str, days: list[dt.date]) -> list[tuple[dt.date, str]]:
    """The ``*.jsonl`` files of the given date partitions, in date then name order."""
    found: list[tuple[dt.date, str]] = []
    for day in days:
        for uri in storage.list_files(partition_uri(source, day)):
            if uri.endswith(".jsonl"):
                found.append((day, uri))
    return found


def parse_lines(uri: str, data: bytes, max_record_bytes: int) -> Iterator[dict[str, Any]]:
    """Records of one JSON Lines file; the first bad line stops everything with its location."""
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        if len(raw) > max_record_bytes:
            raise StepError(
                f"{uri}:{lineno}: record of {len(raw) / 1e6:.1f} MB exceeds the "
                f"{max_record_bytes / 1e6:.1f} MB limit (snapshot.max_record_bytes)"
            )
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise StepError(f"{uri}:{lineno}: invalid UTF-8 at byte {exc.start}") from None
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise StepError(f"{uri}:{lineno}: invalid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise StepError(f"{uri}:{lineno}: expected a JSON object, got {type(record).__name__}")
        missing = [name for name in REQUIRED_FIELDS if name not in record]
        if missing:
            raise StepError(f"{uri}:{lineno}: record missing {', '.join(repr(m) for m in missing)}")
        if not isinstance(record["text"], str):
            raise StepError(f"{uri}:{lineno}: 'text' is {type(record['text']).__name__}, expected a string")
        yield record


def normalize_text(text: str) -> str:
    """NFC, ``\\n`` line ends, no control characters, no trailing spaces at line ends."""
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    text = CONTROL_CHARS_RE.sub("", text)
    return "\n".join(line.rstrip() for line in text.split("\n")).strip()


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass
class DedupResult:
    records: list[dict[str, Any]]
    records_in: int


def normalize_and_dedup(records: Iterator[dict[str, Any]],
                        on_record: Callable[[bool], None] | None = None) -> DedupResult:
    """Normalize texts and keep the first record of each distinct text.

    Each kept record gets ``content_hash`` and ``copies`` (how many raw records had that text),
    so validation can still judge the raw duplicate ratio after de-duplication. ``on_record`` is
    told, record by record, whether its text was seen before.
    """
    kept: dict[str, dict[str, Any]] = {}
    count = 0
    for record in records:
        count += 1
        text = normalize_text(record["text"])
        digest = content_hash(text)
        if on_record is not None:
            on_record(digest in kept)
        if digest in kept:
            kept[digest]["copies"] += 1
            continue
        kept[digest] = {
            "id": str(record["id"]),
            "text": text,
            "source": str(record["source"]),
            "created_at": str(record["created_at"]),
            "content_hash": digest,
            "copies": 1,
        }
    return DedupResult(records=list(kept.values()), records_in=count)
