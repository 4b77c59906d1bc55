"""Raw text records: the partition layout, parsing with clear errors, and normalization.

A record is one JSON object per line: ``id``, ``text``, ``source``, ``created_at``. Raw data
sits under ``{source}/date=YYYY-MM-DD/*.jsonl`` and is never rewritten. A partition is complete
once its ``_SUCCESS`` marker exists (written last, as Hadoop, Spark and our ingestion do; its
content is not read): only complete partitions are read, and one of the window holding data
files without the marker (still being written, or its ingestion failed) stops the snapshot, not
to version half a day as if it were whole.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import sqlite3
import tempfile
import unicodedata
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tasks.lib import storage
from tasks.lib.errors import StepError

REQUIRED_FIELDS = ("id", "text", "source", "created_at")
PARTITION_RE = re.compile(r"/date=(\d{4}-\d{2}-\d{2})/[^/]+\.jsonl$")
# C0/C1 control characters except tab and newline; also lone surrogates cannot occur after decoding
CONTROL_CHARS_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# personal data: validation bounds the share of records holding it, capture (tasks/serving/capture.py)
# replaces it in what it logs
# (bounded repeats, as RFC 5321's lengths: linear time on any text, where open-ended runs backtracked
# quadratically on a long word)
EMAIL_RE = r"[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(?:\.[A-Za-z0-9-]{1,63}){0,8}\.[A-Za-z]{2,24}"
EMAIL_PLACEHOLDER = "<email>"


def scrub(text: str) -> str:
    """``text`` with every e-mail address (validation's rule) replaced by a placeholder."""
    return re.sub(EMAIL_RE, EMAIL_PLACEHOLDER, text)


def partition_uri(source: str, day: dt.date) -> str:
    return storage.join(source, f"date={day.isoformat()}")


def interval_days(end_date: dt.date, lookback_days: int) -> list[dt.date]:
    """The ``lookback_days`` dates before ``end_date`` (exclusive), oldest first."""
    return [end_date - dt.timedelta(days=back) for back in range(lookback_days, 0, -1)]


def partition_files(source: str, days: list[dt.date]) -> list[tuple[dt.date, str]]:
    """The ``*.jsonl`` files of the given date partitions, in date then name order; a partition
    with data files but no ``_SUCCESS`` marker is refused (see the module docstring)."""
    found: list[tuple[dt.date, str]] = []
    for day in days:
        listed = storage.list_files(partition_uri(source, day))
        data = [uri for uri in listed if uri.endswith(".jsonl")]
        if data and not any(uri.rsplit("/", 1)[-1] == storage.SUCCESS_MARKER for uri in listed):
            raise StepError(f"{partition_uri(source, day)}: {len(data)} data file(s) but no "
                            f"{storage.SUCCESS_MARKER} marker: a partition still being written, or whose "
                            "ingestion failed, is not read (land it again, or remove it)")
        found.extend((day, uri) for uri in data)
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


class DedupResult:
    """The kept records (the first of each distinct text), spilled to a JSON Lines file as they
    arrive. Memory holds one copy counter per kept record (4 bytes); the hash -> record index
    table is an SQLite file beside the spill, so a window of any size de-duplicates within a
    pod's memory limit. Iterating reads the records back, each with its final ``copies``."""

    def __init__(self, workdir: Path | None = None) -> None:
        self._tmp = None if workdir is not None else tempfile.TemporaryDirectory(prefix="dedup-")
        folder = workdir if workdir is not None else Path(self._tmp.name)  # type: ignore[union-attr]
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "kept.jsonl"
        self._spill = self.path.open("w", encoding="utf-8")
        self._index = sqlite3.connect(folder / "seen.sqlite")
        self._index.execute("PRAGMA journal_mode=OFF")
        self._index.execute("PRAGMA synchronous=OFF")
        self._index.execute("CREATE TABLE seen (digest BLOB PRIMARY KEY, idx INTEGER) WITHOUT ROWID")
        self.copies = array("I")
        self.records_in = 0

    def add(self, record: dict[str, Any]) -> bool:
        """Keep ``record`` unless its text was seen before; True when it was a repeat."""
        self.records_in += 1
        digest = record["content_hash"]
        cursor = self._index.execute("INSERT OR IGNORE INTO seen VALUES (?, ?)", (bytes.fromhex(digest), len(self.copies)))
        if cursor.rowcount == 0:
            (idx,) = self._index.execute("SELECT idx FROM seen WHERE digest = ?", (bytes.fromhex(digest),)).fetchone()
            self.copies[idx] += 1
            return True
        self.copies.append(1)
        self._spill.write(json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n")
        return False

    def close(self) -> None:
        self._spill.close()
        self._index.close()

    @property
    def count(self) -> int:
        return len(self.copies)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        with self.path.open(encoding="utf-8") as fh:
            for idx, line in enumerate(fh):
                record: dict[str, Any] = json.loads(line)
                record["copies"] = self.copies[idx]
                yield record

    @property
    def records(self) -> list[dict[str, Any]]:
        """All kept records in memory (small inputs: tests, benchmarks)."""
        return list(self)


def normalize_and_dedup(records: Iterator[dict[str, Any]], on_record: Callable[[bool], None] | None = None,
                        workdir: Path | None = None) -> DedupResult:
    """Normalize texts and keep the first record of each distinct text (spilled under
    ``workdir``, a temporary folder if None).

    Each kept record gets ``content_hash`` and ``copies`` (how many raw records had that text),
    so validation can still judge the raw duplicate ratio after de-duplication. ``on_record`` is
    told, record by record, whether its text was seen before.
    """
    result = DedupResult(workdir)
    try:
        for record in records:
            text = normalize_text(record["text"])
            repeated = result.add({
                "id": str(record["id"]),
                "text": text,
                "source": str(record["source"]),
                "created_at": str(record["created_at"]),
                "content_hash": content_hash(text),
            })
            if on_record is not None:
                on_record(repeated)
    finally:
        result.close()
    return result
