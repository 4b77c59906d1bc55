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
import functools
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


def _bmp_ranges(categories: str) -> str:
    """Character-class ranges (``\\uXXXX`` escapes) of the non-ASCII code points of the Basic
    Multilingual Plane whose Unicode category starts with a letter of ``categories``; a range also
    spans the unassigned code points between two of them (fewer ranges)."""
    ranges: list[list[int]] = []
    gap_unassigned = False
    for code in range(0x80, 0x10000):
        category = unicodedata.category(chr(code))
        if category[0] in categories:
            if ranges and gap_unassigned:
                ranges[-1][1] = code
            else:
                ranges.append([code, code])
            gap_unassigned = True
        elif category != "Cn":
            gap_unassigned = False
    return "".join(f"\\u{a:04x}" if a == b else f"\\u{a:04x}-\\u{b:04x}" for a, b in ranges)


# Personal data, the rules listed in docs/operations.md#drift-served-traffic-and-retraining: validation
# bounds the share of records holding an e-mail address (EMAIL_RE, which its SQL runs with Python's re),
# the capture (tasks/serving/capture.py) replaces e-mail addresses, payment card numbers and phone
# numbers in what it logs (scrub). Every pattern has bounded repeats, or one pass over a run of one
# character class: linear time on any text (open-ended repeats had backtracked quadratically on a
# long word).
# E-mail, internationalized (RFC 6531, IDNA): letters, digits and combining marks of any script, in
# RFC 5321's lengths. \w holds the letters and digits of every script but not the marks (a Devanagari
# vowel sign, a decomposed accent); the explicit ranges hold the letters and marks of the BMP: most
# characters are then found in one bitmap, not by the category lookup behind \w (3 times faster).
# In text without spaces (Chinese, Japanese), the letters before and after an address go with it.
_LETTERS = _bmp_ranges("LM")
# '@' a literal: a search then tries a local part's lengths only where '@' follows (a class, even
# with the fullwidth at sign alone added, made validation's search 5 times slower on a long word)
_AT = "@"
_DOT = "[.\\u3002\\uff0e\\uff61]"  # and IDNA's other label separators: ideographic, fullwidth, halfwidth
_LOCAL = rf"[\w.%+\-A-Za-z0-9{_LETTERS}]"
_LABEL = rf"[\w\-A-Za-z0-9{_LETTERS}]"
_DOMAIN = (rf"{_LABEL}{{1,63}}(?:{_DOT}{_LABEL}{{1,63}}){{0,8}}{_DOT}"
           rf"(?:[Xx][Nn]--[A-Za-z0-9\-]{{1,59}}|[A-Za-z{_LETTERS}]{{2,24}})")
EMAIL_RE = rf"{_LOCAL}{{1,64}}{_AT}{_DOMAIN}"
EMAIL_PLACEHOLDER = "<email>"
CARD_PLACEHOLDER = "<card>"
PHONE_PLACEHOLDER = "<phone>"
# scrub's default phone_region (the capture's: no setting yet): its national numbers are phone numbers
# too ("(415) 555-0132"); numbers in international format ("+44 20 7946 0958") are, whatever the
# region. None: international format only.
PHONE_REGION: str | None = "US"
# Candidates the phone library checks per text (0.1 to 1 ms each); beyond, a candidate is replaced
# on its digit count alone (more scrubbed, never less), so a text full of numbers stays fast.
PHONE_CHECKS = 6

# the address's '@' and domain, then its local part read backwards from the '@' (see _email_spans)
_EMAIL_DOMAIN = re.compile(_AT + _DOMAIN)
_LOCAL_PART = re.compile(_LOCAL + "{1,64}")
# Card numbers: in a run of digits, spaces and dashes holding 13 digits parted by one space or dash at
# most (not the decimals of a number), 13 to 19 digits alone or in the groups cards are printed in:
# 4 digits first, then groups of 4 to 6 (4-4-4-4, 4-6-5, 4-6-4), then maybe a short one (4-4-4-4-3,
# 4-4-4-1), parted by one space or dash
_DIGIT_RUN = re.compile(r"(?<![\d.,])(?=\d(?:[ \-]?\d){12})\d[\d \-]*\d")
_CARD = re.compile(r"(?<!\d)(?:\d{13,19}|\d{4}(?:[ \-]\d{4,6}){1,3}(?:[ \-]\d{1,5})?)(?!\d)")
_LUHN_DOUBLED = bytes.maketrans(b"0123456789", bytes([0, 2, 4, 6, 8, 1, 3, 5, 7, 9]))  # 2d, its digits summed
# Phone numbers: what the phone library reads as phone punctuation (no line breaks), 1 to 7 groups
# of digits, 7 digits at least, not inside a word or a longer number
_PHONE_SEP = (r"[ \u00a0\u2000-\u200b\u202f\u205f\u3000\-\u2010-\u2015\u2212\u30fc\uff0d./\uff0f()\uff08\uff09"
              r"\[\]\uff3b\uff3d~\u2053\u223c\uff5e]")
_PHONE = re.compile(rf"(?<![\w+\uff0b])(?=[+\uff0b]?[(\uff08\[]?(?:\d{_PHONE_SEP}{{0,3}}){{6}}\d)"
                    rf"[+\uff0b]?[(\uff08\[]?\d{{1,15}}(?:{_PHONE_SEP}{{1,3}}\d{{1,15}}){{0,6}}(?!\w)")
_NOT_DIGIT = re.compile(r"\D")


def scrub(text: str, phone_region: str | None = PHONE_REGION) -> str:
    """``text`` with personal data replaced, in this order: e-mail addresses by ``<email>``
    (EMAIL_RE, validation's rule), payment card numbers by ``<card>`` (13 to 19 digits passing the
    Luhn check, see _CARD), phone numbers by ``<phone>`` (``phonenumbers``: international format of
    any country, national format of ``phone_region``; see _phone_spans).

    Linear time on any text: each rule is one pass of a bounded pattern; the phone library checks
    at most :data:`PHONE_CHECKS` candidates (a 16 kB field: a few milliseconds)."""
    text = _replace(text, _email_spans(text), EMAIL_PLACEHOLDER)
    text = _replace(text, _card_spans(text), CARD_PLACEHOLDER)
    return _replace(text, _phone_spans(text, phone_region), PHONE_PLACEHOLDER)


def _replace(text: str, spans: list[tuple[int, int]], placeholder: str) -> str:
    if not spans:
        return text
    parts, last = [], 0
    for start, end in spans:
        parts += [text[last:start], placeholder]
        last = end
    return "".join(parts) + text[last:]


def _email_spans(text: str) -> list[tuple[int, int]]:
    """Where ``re.finditer(EMAIL_RE, text)`` finds addresses, found from each '@' followed by a
    domain: a search for the whole pattern tries a local part at every character (up to 64 steps:
    16 kB of 64 letters and an '@' repeated took 47 ms, the GIL held throughout), the domain's
    search only at an '@'. The local part is then the (up to 64) local-part characters just before
    the '@', from the end of the last address on: the leftmost start the whole pattern would have
    taken."""
    spans: list[tuple[int, int]] = []
    backwards = ""
    for domain in _EMAIL_DOMAIN.finditer(text):
        backwards = backwards or text[::-1]
        at = domain.start()
        local = _LOCAL_PART.match(backwards, len(text) - at, len(text) - (spans[-1][1] if spans else 0))
        if local:
            spans.append((at - (local.end() - local.start()), domain.end()))
    return spans


def luhn_valid(digits: str) -> bool:
    """The Luhn check digit of payment card numbers (ISO/IEC 7812) holds for ``digits``."""
    if not digits.isascii():  # another script's digits, fullwidth ones
        digits = "".join(str(int(d)) for d in digits)
    plain, doubled = digits.encode()[-1::-2], digits.encode()[-2::-2]
    return (sum(plain) - len(plain) * ord("0") + sum(doubled.translate(_LUHN_DOUBLED))) % 10 == 0


def _card_spans(text: str) -> list[tuple[int, int]]:
    """Card numbers (see _CARD) passing the Luhn check. In a run of digit groups, numbers are tried
    until five fail in a row (an amount or a count may come first): a long run costs no more than
    a short one."""
    spans: list[tuple[int, int]] = []
    for run in _DIGIT_RUN.finditer(text):
        if run.group().isdigit():  # one number
            if len(run.group()) <= 19 and luhn_valid(run.group()):
                spans.append(run.span())
            continue
        position, failed = run.start(), 0
        while failed < 5 and (found := _CARD.search(text, position, run.end())):
            length = _card_length(found.group())
            if length:
                spans.append((found.start(), found.start() + length))
                position, failed = spans[-1][1], 0
            else:
                position, failed = found.start() + 1, failed + 1
    return spans


def _card_length(candidate: str) -> int:
    """The length of the card number ``candidate`` begins with, 0 if none: all of it, or of groups
    that fail, the same without their last group or two (an expiry date, a CVV after the number)."""
    if candidate.isdigit():
        return len(candidate) if luhn_valid(candidate) else 0
    while True:
        digits = candidate.replace(" ", "").replace("-", "")
        if len(digits) <= 19 and luhn_valid(digits):
            return len(candidate)
        cut = max(candidate.rfind(" "), candidate.rfind("-"))
        if len(digits) - (len(candidate) - cut - 1) < 13:
            return 0
        candidate = candidate[:cut]


def _phone_spans(text: str, region: str | None) -> list[tuple[int, int]]:
    """Phone numbers: a candidate (see _PHONE), given with the character before and after it (what
    the matcher reads around a number: a letter, a currency sign; or a time's ":00" after) to
    ``phonenumbers.PhoneNumberMatcher`` at leniency STRICT_GROUPING (a number valid in its region's
    numbering plan and grouped as that region writes it: "2026 42 3.11.7" is not "202-642-3117"; not a
    date, a timestamp or part of a longer number). Beyond the first PHONE_CHECKS candidates, one
    with the digit count of a phone number (see _phone_length) is replaced unchecked."""
    spans: list[tuple[int, int]] = []
    for checked, found in enumerate(_PHONE.finditer(text)):
        start, end = found.span()
        if checked >= PHONE_CHECKS:
            if _phone_length(found.group(), region):
                spans.append((start, end))
            continue
        import phonenumbers  # only the capture scrubs: the pipeline's steps do not load it

        lo = max(0, start - 1)
        after = 3 if text.startswith(":", end) else 1
        for match in phonenumbers.PhoneNumberMatcher(text[lo:end + after], region,
                                                     leniency=phonenumbers.Leniency.STRICT_GROUPING):
            if max(start, lo + match.start) < min(end, lo + match.end):
                spans.append((max(start, lo + match.start), min(end, lo + match.end)))
    return spans


def _phone_length(candidate: str, region: str | None) -> bool:
    """``candidate`` has as many digits as a phone number: 7 to 15 after a '+' (E.164's most), or a
    length of ``region``'s national numbers, with or without its national prefix."""
    digits = len(_NOT_DIGIT.sub("", candidate))
    if candidate[0] in "+\uff0b":
        return 7 <= digits <= 15
    return digits in _national_lengths(region)


@functools.cache
def _national_lengths(region: str | None) -> frozenset[int]:
    import phonenumbers

    metadata = phonenumbers.PhoneMetadata.metadata_for_region(region) if region else None
    if metadata is None or metadata.general_desc is None:
        return frozenset()
    lengths = set(metadata.general_desc.possible_length or ())
    prefix = len(metadata.national_prefix or "")
    return frozenset(lengths | {n + prefix for n in lengths} if prefix else lengths)


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
