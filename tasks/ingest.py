"""Import a team's corpus as raw partitions: ``python -m tasks.ingest import SOURCE --to URI``.

``SOURCE`` is a JSON Lines file (``.jsonl``, ``.ndjson``, ``.json`` with one object a line), a
Parquet file, a CSV file (a header row), a folder of ``.txt``/``.md`` files (one record each: its
text, its path as id), or a Hugging Face ``datasets`` folder written by ``save_to_disk`` (a
dataset, or a dataset dict: every split, or ``--split``). Each row becomes one record of the raw
layout (:mod:`tasks.lib.records`: ``id``, ``text``, ``source``, ``created_at``, under
``{URI}/date=YYYY-MM-DD/``): ``--text-field`` (default ``text``), and optionally ``--id-field``
(else the text's content hash), ``--source-field`` (else ``--source-name``, default the file's
name) and ``--timestamp-field`` (ISO 8601 or seconds since the epoch; else the import's date),
whose day picks the partition.

Rows stream through in bounded memory (a line, a Parquet or Arrow batch, a CSV row at a time;
each day's records go to a local file). A bad row (no text, not a string, empty, a timestamp
that does not parse, undecodable bytes, not a JSON object, larger than
``snapshot.max_record_bytes``) is counted by reason and written with its reason to
``{URI}/_quarantine/import-<key>/``; a larger share of bad rows than ``ingest.max_bad_share``
fails the import (exit 2, one line) before anything is written, and so does a source whose rows
have no text field at all.

Each day's records are added to its partition as ``part-import-<key>.jsonl`` (``<key>``: a hash of
the source's bytes and the field mapping): a new partition is committed whole, an existing one
gets the file and a new ``_SUCCESS`` manifest, and no existing file is ever changed. Importing
the same source again adds nothing; an import that died midway adds, when run again, what it had
not yet added.

``--heldout-output URI`` splits off the corpus's held-out text: one text in
``ingest.heldout_every``, picked by the hash of its normalized text (the hash the snapshot step
de-duplicates on), so every copy of a held-out text, in this import or a later one, is held out
too and none is ever trained on. They are written to ``{URI}/eval-import-<key>.jsonl`` (before
the partitions), the evaluation set to pass as ``evaluate.eval_set_uri`` (``make retrain
EVAL_SET=...``).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import hashlib
import io
import json
import re
import resource
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from tasks.lib import records, storage
from tasks.lib.errors import StepError
from tasks.lib.params import load_settings
from tasks.lib.step import log, run_step, step_parser
from tasks.results import IngestResult

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
BATCH_ROWS = 1024  # Parquet and Arrow rows decoded at a time
RAW_CHARS = 500  # of a bad row kept in the quarantine
OPEN_DAYS = 64  # day files open at once while rows are sorted into days
EPOCH_RE = re.compile(r"-?\d{1,12}(\.\d+)?")  # seconds since the epoch, as text


@dataclass(frozen=True)
class FieldMap:
    """Which of a row's fields holds each part of a record."""

    text: str = "text"
    id: str | None = None
    source: str | None = None
    timestamp: str | None = None


@dataclass
class Row:
    """One row of the source: its fields, or why it could not be read."""

    where: str  # file and line or row number, for the quarantine
    fields: dict[str, Any] | None
    problem: str = ""
    raw: str = ""


class BadRow(ValueError):
    """A row that makes no record: its reason (one line, no row content)."""


# -- reading the source, a row at a time ------------------------------------------------------


def source_format(source: Path) -> str:
    try:
        return _source_format(source)
    except OSError as exc:
        raise StepError(f"{source}: not readable ({type(exc).__name__}: {exc.strerror or exc})") from None


def _source_format(source: Path) -> str:
    if source.is_dir():
        if (source / "state.json").exists() or (source / "dataset_dict.json").exists():
            return "hf"
        return "text"
    if not source.exists():
        raise StepError(f"{source}: no such file or folder")
    suffix = source.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    if suffix == ".csv":
        return "csv"
    raise StepError(f"{source}: a {suffix or 'suffix-less'} file is not a corpus this importer reads (expected "
                    f"{', '.join(JSONL_SUFFIXES)}, .parquet, .csv, a folder of {'/'.join(TEXT_SUFFIXES)} files, "
                    "or a datasets save_to_disk folder)")


def source_files(source: Path, kind: str, split: str | None) -> list[Path]:
    """The files read, in order (hashed for the import's key)."""
    if kind == "text":
        files = sorted(p for p in source.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise StepError(f"{source}: no {'/'.join(TEXT_SUFFIXES)} files in this folder")
        return files
    if kind == "hf":
        files = []
        for folder in dataset_folders(source, split):
            state = read_json_file(folder / "state.json")
            entries = state.get("_data_files") if isinstance(state, dict) else None
            if not isinstance(entries, list) or not all(isinstance(e, dict) and "filename" in e for e in entries):
                raise StepError(f"{folder / 'state.json'}: no list of _data_files (not a datasets save_to_disk folder)")
            missing = [e["filename"] for e in entries if not (folder / e["filename"]).is_file()]
            if missing:
                raise StepError(f"{folder}: {missing[0]} is missing (its state.json lists it)")
            files += [folder / e["filename"] for e in entries]
        return files
    return [source]


def read_json_file(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StepError(f"{path}: not readable JSON ({type(exc).__name__})") from None


def dataset_folders(source: Path, split: str | None) -> list[Path]:
    """A datasets folder's splits (a ``DatasetDict``: each split's folder, or ``split``'s alone)."""
    if not (source / "dataset_dict.json").exists():
        return [source]
    splits = read_json_file(source / "dataset_dict.json").get("splits", [])
    if split is not None:
        if split not in splits:
            raise StepError(f"{source}: no split {split!r} (it has {', '.join(splits)})")
        splits = [split]
    return [source / name for name in splits]


def rows_of(source: Path, kind: str, split: str | None, max_bytes: int) -> Iterator[Row]:
    try:
        yield from _rows_of(source, kind, split, max_bytes)
    except OSError as exc:
        raise StepError(f"{getattr(exc, 'filename', None) or source}: not readable ({type(exc).__name__}: "
                        f"{exc.strerror or exc})") from None


def _rows_of(source: Path, kind: str, split: str | None, max_bytes: int) -> Iterator[Row]:
    if kind == "jsonl":
        yield from jsonl_rows(source, max_bytes)
    elif kind == "parquet":
        yield from parquet_rows(source)
    elif kind == "csv":
        yield from csv_rows(source, max_bytes)
    elif kind == "text":
        yield from text_rows(source, max_bytes)
    else:
        for path in source_files(source, kind, split):
            yield from arrow_rows(path, source)


def bounded_lines(fh: IO[bytes], limit: int) -> Iterator[tuple[bytes, bool]]:
    """Each line (``(line, False)``), or the head of one longer than ``limit`` bytes
    (``(head, True)``, the rest skipped a chunk at a time): a line is never held whole past it."""
    while line := fh.readline(limit + 1):
        if len(line) <= limit or line.endswith(b"\n"):
            yield line, False
            continue
        while (rest := fh.readline(1 << 20)) and not rest.endswith(b"\n"):
            pass
        yield line[:RAW_CHARS], True


def jsonl_rows(path: Path, max_bytes: int) -> Iterator[Row]:
    with path.open("rb") as fh:
        for number, (line, too_long) in enumerate(bounded_lines(fh, max_bytes), start=1):
            where, raw = f"{path.name}:{number}", line[:RAW_CHARS].decode("utf-8", "replace")
            if too_long:
                yield Row(where, None, f"a line above snapshot.max_record_bytes {max_bytes}", raw)
                continue
            if not line.strip():
                continue
            try:
                value = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError:
                yield Row(where, None, "not UTF-8", raw)
                continue
            except json.JSONDecodeError as exc:
                yield Row(where, None, f"not JSON ({exc.msg})", raw)
                continue
            except RecursionError:
                yield Row(where, None, "not JSON (nested too deeply)", raw)
                continue
            if not isinstance(value, dict):
                yield Row(where, None, f"a JSON {type(value).__name__}, not an object", raw)
                continue
            yield Row(where, value)


def parquet_rows(path: Path) -> Iterator[Row]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(str(path))
        number = 0
        for batch in table.iter_batches(batch_size=BATCH_ROWS):
            for value in batch.to_pylist():
                number += 1
                yield Row(f"{path.name}:row {number}", value)
    except (pa.ArrowException, OSError, OverflowError, ValueError) as exc:  # (a date past year 9999: Overflow)
        raise StepError(f"{path}: not a readable Parquet file ({' '.join(str(exc).split())[:200]})") from None


def arrow_rows(path: Path, source: Path) -> Iterator[Row]:
    """The rows of one Arrow stream file of a datasets folder, a batch at a time."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as mapped:
            reader = pa.ipc.open_stream(mapped)
            number = 0
            for batch in reader:
                for start in range(0, batch.num_rows, BATCH_ROWS):
                    for value in batch.slice(start, BATCH_ROWS).to_pylist():
                        number += 1
                        yield Row(f"{path.relative_to(source)}:row {number}", value)
    except (pa.ArrowException, OSError, OverflowError, ValueError) as exc:
        raise StepError(f"{path}: not a readable Arrow file ({' '.join(str(exc).split())[:200]})") from None


def csv_rows(path: Path, max_bytes: int) -> Iterator[Row]:
    csv.field_size_limit(max_bytes)  # an unclosed quote cannot swallow the rest of the file
    with path.open("rb") as raw:
        text = io.TextIOWrapper(raw, encoding="utf-8-sig", errors="surrogateescape", newline="")
        reader = csv.DictReader(text)
        try:
            for value in reader:
                where = f"{path.name}:{reader.line_num}"
                if None in value:  # more cells than the header names
                    yield Row(where, None, f"{len(reader.fieldnames or [])} columns in the header, more in this row",
                              repr(value)[:RAW_CHARS])
                elif any(has_surrogates(v) for v in value.values() if isinstance(v, str)):
                    yield Row(where, None, "not UTF-8", repr(value)[:RAW_CHARS])
                else:
                    yield Row(where, dict(value))
        except csv.Error as exc:
            raise StepError(f"{path}:{reader.line_num}: not CSV ({exc})") from None


def has_surrogates(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def text_rows(folder: Path, max_bytes: int) -> Iterator[Row]:
    """One row a file; its id the path and the content's hash (an edited file imported again is
    another record, not a second one of the same id)."""
    for path in source_files(folder, "text", None):
        name = path.relative_to(folder).as_posix()
        if path.stat().st_size > max_bytes:
            yield Row(name, None, f"a file above snapshot.max_record_bytes {max_bytes}")
            continue
        data = path.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            yield Row(name, None, "not UTF-8", data[:RAW_CHARS].decode("utf-8", "replace"))
            continue
        yield Row(name, {"text": text, "id": f"{name}@{hashlib.sha256(data).hexdigest()[:12]}"})


# -- rows into records ------------------------------------------------------------------------


@dataclass(frozen=True)
class RecordRules:
    """How a row becomes a record: which fields hold its parts, the source named by a record
    whose row names none, the day of a row without a timestamp, the largest record (bytes:
    ``snapshot.max_record_bytes``)."""

    mapping: FieldMap
    source_name: str
    today: dt.date
    max_bytes: int


def record_of(fields: dict[str, Any], rules: RecordRules) -> dict[str, Any]:
    """The raw record of one row (:data:`tasks.lib.records.REQUIRED_FIELDS`); raises BadRow."""
    mapping, max_bytes = rules.mapping, rules.max_bytes
    if mapping.text not in fields:
        raise BadRow(f"no field {mapping.text!r}")
    text = fields[mapping.text]
    if not isinstance(text, str):
        raise BadRow(f"{mapping.text!r} is {type(text).__name__}, not a string")
    if has_surrogates(text):
        raise BadRow(f"{mapping.text!r} is not valid UTF-8 (a lone surrogate)")
    if not records.normalize_text(text):
        raise BadRow(f"{mapping.text!r} is empty (or only spaces and control characters)")
    record = {"id": row_id(fields, mapping, text), "text": text,
              "source": named(fields, mapping.source, "source") if mapping.source else rules.source_name,
              "created_at": created_at(fields, mapping.timestamp, rules.today).isoformat()}
    size = len(json.dumps(record, ensure_ascii=False).encode())
    if size > max_bytes:
        raise BadRow(f"a record of {size} bytes, above snapshot.max_record_bytes {max_bytes}")
    return record


def row_id(fields: dict[str, Any], mapping: FieldMap, text: str) -> str:
    if mapping.id is None:
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:32]
    return named(fields, mapping.id, "id")


def named(fields: dict[str, Any], name: str, what: str) -> str:
    value = fields.get(name)
    if isinstance(value, bool) or not isinstance(value, str | int) or value == "" or (
            isinstance(value, str) and has_surrogates(value)):
        raise BadRow(f"{what} field {name!r} is {'missing' if value is None else repr(value)[:40]}")
    return str(value)


def created_at(fields: dict[str, Any], name: str | None, today: dt.date) -> dt.datetime:
    """The row's time (UTC), from its timestamp field, or the import's day."""
    if name is None:
        return dt.datetime.combine(today, dt.time(), dt.UTC)
    value = fields.get(name)
    if isinstance(value, str) and EPOCH_RE.fullmatch(value.strip()):  # CSV cells are strings
        value = float(value)
    try:
        if isinstance(value, dt.datetime):
            moment = value
        elif isinstance(value, dt.date):
            moment = dt.datetime.combine(value, dt.time())
        elif isinstance(value, int | float) and not isinstance(value, bool):
            moment = dt.datetime.fromtimestamp(value, dt.UTC)
        elif isinstance(value, str):
            moment = dt.datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        else:
            raise BadRow(f"timestamp field {name!r} is {'missing' if value is None else type(value).__name__}")
        return moment.replace(tzinfo=dt.UTC) if moment.tzinfo is None else moment.astimezone(dt.UTC)
    except (ValueError, OverflowError, OSError):
        raise BadRow(f"timestamp field {name!r}: {str(value)[:40]!r} is not ISO 8601 or epoch seconds") from None


# -- the import -------------------------------------------------------------------------------


class DayFiles:
    """Each day's records in a local JSON Lines file, at most ``OPEN_DAYS`` open at once."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.open: dict[dt.date, IO[str]] = {}
        self.counts: Counter[dt.date] = Counter()

    def path(self, day: dt.date) -> Path:
        return self.folder / day.isoformat() / "records.jsonl"

    def add(self, day: dt.date, record: dict[str, Any]) -> None:
        if day not in self.open:
            if len(self.open) >= OPEN_DAYS:
                self.open.pop(next(iter(self.open))).close()
            self.path(day).parent.mkdir(parents=True, exist_ok=True)
            self.open[day] = self.path(day).open("a", encoding="utf-8")
        self.open[day].write(json.dumps(record, ensure_ascii=False) + "\n")
        self.counts[day] += 1

    def close(self) -> None:
        for fh in self.open.values():
            fh.close()
        self.open.clear()


def import_key(files: list[Path], source: Path, mapping: FieldMap, source_name: str, split: str | None) -> str:
    """What identifies this import: the source's bytes and how its rows become records."""
    digest = hashlib.sha256(json.dumps([asdict(mapping), source_name, split]).encode())
    for path in files:
        with path.open("rb") as fh:
            digest.update(path.relative_to(source if source.is_dir() else source.parent).as_posix().encode())
            digest.update(hashlib.file_digest(fh, "sha256").digest())
    return digest.hexdigest()[:16]


@dataclass
class Tally:
    rows: int = 0
    bad: int = 0
    heldout: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    first_fields: list[str] | None = None

    def bad_share(self) -> float:
        return self.bad / self.rows if self.rows else 0.0


def is_heldout(text: str, every: int) -> bool:
    """Whether a text belongs to the held-out split: by the hash the snapshot step de-duplicates
    on (its normalized text), so each copy of a text is on the same side in every import. (Its
    second 8 hex digits: the first ones pick the tokenize step's validation split.)"""
    return int(records.content_hash(records.normalize_text(text))[8:16], 16) % every == 0


def sort_rows(rows: Iterator[Row], rules: RecordRules, days: DayFiles, quarantine: IO[str],
              heldout: tuple[IO[str], int] | None = None) -> Tally:
    """Every row into its day's file, into the held-out file (``heldout``: the file and one in how
    many texts), or into the quarantine with its reason."""
    tally = Tally()
    for row in rows:
        tally.rows += 1
        if tally.first_fields is None and row.fields is not None:
            tally.first_fields = sorted(map(str, row.fields))
        problem, raw = row.problem, row.raw
        if row.fields is not None:
            try:
                record = record_of(row.fields, rules)
                if heldout is not None and is_heldout(record["text"], heldout[1]):
                    heldout[0].write(json.dumps(record, ensure_ascii=False) + "\n")
                    tally.heldout += 1
                    continue
                days.add(dt.date.fromisoformat(record["created_at"][:10]), record)
                continue
            except BadRow as exc:
                problem, raw = str(exc), json.dumps(row.fields, default=str)[:RAW_CHARS]
        tally.bad += 1
        tally.reasons[problem] += 1
        # ASCII: a row's raw text may hold what UTF-8 cannot encode (a lone surrogate)
        quarantine.write(json.dumps({"row": row.where, "reason": problem, "raw": raw}) + "\n")
    return tally


def refusal(source: Path, tally: Tally, mapping: FieldMap, limit: float) -> str | None:
    """Why the import must not land (one line), or None."""
    if tally.rows == 0:
        return f"{source}: no rows"
    missing_text = tally.reasons.get(f"no field {mapping.text!r}", 0)
    if missing_text == tally.rows:
        return (f"{source}: no row has a field {mapping.text!r} (its rows have: {', '.join(tally.first_fields or [])}): "
                "name the text field with --text-field")
    if tally.bad_share() > limit:
        worst = ", ".join(f"{reason} ({count})" for reason, count in tally.reasons.most_common(3))
        return (f"{source}: {tally.bad} of {tally.rows} rows are bad ({tally.bad_share():.1%}, above "
                f"ingest.max_bad_share {limit:.0%}): {worst}")
    return None


def ledger_uri(to: str, key: str) -> str:
    return storage.join(to, "_imports", f"import-{key}.json")


def import_day(to: str, key: str, asked: str | None) -> dt.date:
    """The day of rows without a timestamp: ``--date``, else today (UTC); this source imported
    before (its ledger, written before anything lands): that import's day, so a second import, or
    a rerun after a crash past midnight, lands the same records in the same files."""
    try:
        wanted = dt.date.fromisoformat(asked) if asked else None
    except ValueError:
        raise StepError(f"--date {asked!r}: expected YYYY-MM-DD") from None
    if storage.exists(ledger_uri(to, key)):
        before = dt.date.fromisoformat(storage.read_json(ledger_uri(to, key))["date"])
        if wanted is not None and wanted != before:
            raise StepError(f"{ledger_uri(to, key)}: this source was imported with --date {before}: import it with "
                            "that date (or none) to finish or repeat it, not another")
        return before
    return wanted or dt.datetime.now(dt.UTC).date()


def land(days: DayFiles, to: str, key: str) -> dict[str, list[str]]:
    """Each day's file into its partition (:func:`storage.add_files`): ``{"added": days, "present": days}``."""
    landed: dict[str, list[str]] = {"added": [], "present": []}
    for day in sorted(days.counts):
        folder = days.path(day).parent
        named_file = folder / f"part-import-{key}.jsonl"
        days.path(day).rename(named_file)
        added = storage.add_files(folder, records.partition_uri(to, day))
        landed["added" if added else "present"].append(day.isoformat())
    return landed


def import_main(args: argparse.Namespace) -> IngestResult:
    started = time.monotonic()
    settings = load_settings("ingest", args.overrides)
    source = Path(args.source)
    kind = source_format(source)
    mapping = FieldMap(args.text_field, args.id_field, args.source_field, args.timestamp_field)
    if kind == "text" and (args.id_field or args.source_field or args.timestamp_field or args.text_field != "text"):
        raise StepError(f"{source}: a folder of text files has no fields to map (each file is one record: its text, "
                        "its path as id)")
    if kind == "text":
        mapping = FieldMap(id="id")
    source_name = args.source_name or source.name
    files = source_files(source, kind, args.split)
    key = import_key(files, source, mapping, source_name, args.split)
    today = import_day(args.to, key, args.date)
    heldout_name = f"eval-import-{key}.jsonl"
    with storage.scratch() as scratch:
        days = DayFiles(scratch / "days")
        (scratch / "quarantine").mkdir()
        (scratch / "heldout").mkdir()
        with (scratch / "quarantine" / "rows.jsonl").open("w", encoding="utf-8") as quarantine, \
                (scratch / "heldout" / heldout_name).open("w", encoding="utf-8") as held:
            try:
                rules = RecordRules(mapping, source_name, today, settings.snapshot.max_record_bytes)
                tally = sort_rows(rows_of(source, kind, args.split, settings.snapshot.max_record_bytes), rules, days,
                                  quarantine, (held, settings.ingest.heldout_every) if args.heldout_output else None)
            finally:
                days.close()
        why_not = refusal(source, tally, mapping, settings.ingest.max_bad_share)
        if why_not:
            raise StepError(why_not)
        storage.write_bytes(ledger_uri(args.to, key), json.dumps({"date": today.isoformat(), "source": str(source),
                                                                  "format": kind}).encode())
        quarantine_uri = storage.join(args.to, "_quarantine", f"import-{key}")
        if tally.bad:
            storage.add_files(scratch / "quarantine", quarantine_uri)
        if args.heldout_output:  # before the partitions: a run can never train on what it holds out
            storage.add_files(scratch / "heldout", args.heldout_output)
        landed = land(days, args.to, key)
    seconds = time.monotonic() - started
    peak_mb = peak_rss_mb()
    heldout_uri = storage.join(args.heldout_output, heldout_name) if args.heldout_output else None
    if heldout_uri:
        log.info("held out %d texts (one in %d) at %s: pass it as the evaluation set (make retrain EVAL_SET=...)",
                 tally.heldout, settings.ingest.heldout_every, heldout_uri)
    log.info("imported %d of %d rows of %s (%s) into %d day partitions under %s (%d added, %d already there); "
             "%d bad%s; %.1f s, %.0f rows/s, peak RSS %.0f MB", tally.rows - tally.bad - tally.heldout, tally.rows,
             source, kind, len(days.counts), args.to, len(landed["added"]), len(landed["present"]), tally.bad,
             f" (quarantined at {quarantine_uri}: " + "; ".join(f"{r} ({n})" for r, n in tally.reasons.most_common(3))
             + ")" if tally.bad else "", seconds, tally.rows / max(seconds, 1e-9), peak_mb)
    return IngestResult(source=str(source), format=kind, to=args.to, key=key, rows=tally.rows,
                        imported=tally.rows - tally.bad - tally.heldout, bad=tally.bad, bad_reasons=dict(tally.reasons),
                        heldout=tally.heldout, heldout_uri=heldout_uri,
                        quarantine_uri=quarantine_uri if tally.bad else None,
                        days={d.isoformat(): n for d, n in sorted(days.counts.items())},
                        days_added=tuple(landed["added"]), days_already_there=tuple(landed["present"]),
                        seconds=round(seconds, 2), peak_rss_mb=round(peak_mb, 1))


def peak_rss_mb() -> float:
    """This process's own peak resident memory (VmHWM; ``ru_maxrss`` would keep a large parent's
    across the fork and exec)."""
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def parser() -> argparse.ArgumentParser:
    p = step_parser("ingest", "Raw data in: import a corpus as raw partitions.")  # --set goes before "import"
    commands = p.add_subparsers(dest="command", required=True)
    imp = commands.add_parser("import", help=__doc__.splitlines()[0] if __doc__ else "")
    imp.add_argument("source", help="a .jsonl/.parquet/.csv file, a folder of .txt/.md files, or a datasets folder")
    imp.add_argument("--to", required=True, help="the raw data URI (params.yaml pipeline.raw_data_uri)")
    imp.add_argument("--text-field", default="text")
    imp.add_argument("--id-field", help="(default: the text's content hash)")
    imp.add_argument("--source-field", help="(default: --source-name)")
    imp.add_argument("--source-name", help="every record's source (default: the file or folder name)")
    imp.add_argument("--timestamp-field", help="ISO 8601 or epoch seconds; picks the day (default: --date)")
    imp.add_argument("--date", help="the day of rows without a timestamp field, YYYY-MM-DD (default: today, UTC)")
    imp.add_argument("--split", help="of a datasets DatasetDict folder (default: every split)")
    imp.add_argument("--heldout-output", help="a folder URI for a held-out split of the corpus (one text in "
                     "ingest.heldout_every, with every copy of it: never in a partition), written as "
                     "eval-import-<key>.jsonl: the evaluation set of your domain (default: none)")
    return p


def main(args: argparse.Namespace) -> IngestResult:
    return import_main(args)


if __name__ == "__main__":
    run_step(parser(), main)
