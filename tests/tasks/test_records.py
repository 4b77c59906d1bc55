"""Raw record parsing and normalization (unit)."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from tasks.lib import records
from tasks.lib.errors import StepError


def line(**fields: object) -> bytes:
    record = {"id": "1", "text": "hello world", "source": "t", "created_at": "2026-11-01T00:00:00+00:00"}
    record.update(fields)
    return json.dumps(record).encode()


def parse(data: bytes, max_bytes: int = 1_000_000) -> list[dict[str, object]]:
    return list(records.parse_lines("raw/part.jsonl", data, max_bytes))


def test_parses_records_and_skips_blank_lines() -> None:
    out = parse(line(id="a") + b"\n\n" + line(id="b") + b"\n")
    assert [r["id"] for r in out] == ["a", "b"]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (line() + b"\n" + b'{"id": "2", "text": "caf\xe9"}', "raw/part.jsonl:2: invalid UTF-8"),
        (line() + b"\n{not json\n", "raw/part.jsonl:2: invalid JSON"),
        (b'{"id": "1", "source": "s", "created_at": "x"}', "raw/part.jsonl:1: record missing 'text'"),
        (b"[1, 2]", "expected a JSON object"),
        (line(text=7), "'text' is int"),
    ],
)
def test_bad_lines_name_file_line_and_problem(data: bytes, message: str) -> None:
    with pytest.raises(StepError, match=message.replace("(", r"\(")):
        parse(data)


def test_oversized_record_is_rejected_before_decoding() -> None:
    huge = line(text="x" * 2_000_000)
    with pytest.raises(StepError, match=r"record of 2\.0 MB exceeds the 1\.0 MB limit"):
        parse(huge)


def test_normalize_strips_controls_unifies_newlines_and_nfc() -> None:
    assert records.normalize_text("  cafe\u0301\r\nline\x00two\x07  \r\n") == "café\nlinetwo"
    assert records.normalize_text("tab\tkept\nnewline kept") == "tab\tkept\nnewline kept"


def test_dedup_keeps_first_and_counts_copies() -> None:
    raw = [
        {"id": "1", "text": "same text", "source": "a", "created_at": "t1"},
        {"id": "2", "text": "same text\r\n", "source": "b", "created_at": "t2"},
        {"id": "3", "text": "other", "source": "c", "created_at": "t3"},
    ]
    result = records.normalize_and_dedup(iter(raw))
    assert result.records_in == 3
    assert [(r["id"], r["copies"]) for r in result.records] == [("1", 2), ("3", 1)]
    assert result.records[0]["content_hash"] == records.content_hash("same text")


def test_interval_days_end_exclusive() -> None:
    days = records.interval_days(dt.date(2026, 11, 22), 3)
    assert days == [dt.date(2026, 11, 19), dt.date(2026, 11, 20), dt.date(2026, 11, 21)]
