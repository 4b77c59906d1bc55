"""``python -m tasks.ingest import``: a team's corpus into raw partitions, each format, bad rows
quarantined, nothing written past the bound, idempotent."""

from __future__ import annotations

import csv
import datetime as dt
import json
from pathlib import Path
from typing import Any

import pytest
from helpers import run_module

from tasks.lib import records, storage
from tasks.lib.errors import StepError

ROWS = [{"doc": f"Document {i}: how to return the number of items in bucket {i}.", "key": f"d{i}",
         "when": f"2026-10-{1 + i % 3:02d}T12:00:00Z"} for i in range(30)]
MAPPING = ("--text-field", "doc", "--id-field", "key", "--timestamp-field", "when")


def run_import(source: Path, to: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    """The import in this process (the exit code and the one line: :func:`run_import_process`)."""
    from tasks.ingest import main, parser

    try:
        return 0, main(parser().parse_args(["import", str(source), "--to", str(to), *args])), ""
    except StepError as exc:
        return 2, {}, f"ERROR python -m tasks.ingest: {exc}"


def run_import_process(source: Path, to: Path, *args: str) -> tuple[int, str]:
    proc = run_module("tasks.ingest", *args[:2], "import", str(source), "--to", str(to), *args[2:])
    return proc.returncode, proc.stderr


def partitions(to: Path) -> dict[str, list[dict[str, Any]]]:
    """Each complete partition's records, as the snapshot reads them."""
    found: dict[str, list[dict[str, Any]]] = {}
    for folder in sorted(to.glob("date=*")):
        storage.require_complete(str(folder))
        lines = [json.loads(line) for path in sorted(folder.glob("*.jsonl")) for line in path.read_text().splitlines()]
        found[folder.name.removeprefix("date=")] = lines
    return found


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(path), row_group_size=7)
    return path


def write_csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_dataset(path: Path, rows: list[dict[str, Any]]) -> Path:
    from datasets import Dataset, DatasetDict

    half = len(rows) // 2
    DatasetDict({"train": Dataset.from_list(rows[:half]), "test": Dataset.from_list(rows[half:])}).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "csv", "datasets"])
def test_each_format_lands_its_rows_in_their_days_partitions(kind: str, tmp_path: Path) -> None:
    writers = {"jsonl": (write_jsonl, "corpus.jsonl"), "parquet": (write_parquet, "corpus.parquet"),
               "csv": (write_csv, "corpus.csv"), "datasets": (write_dataset, "corpus")}
    write, name = writers[kind]
    source = write(tmp_path / name, ROWS)
    code, result, stderr = run_import(source, tmp_path / "raw", *MAPPING, "--source-name", "manuals")
    assert code == 0, stderr[-2000:]
    assert result["rows"] == result["imported"] == 30 and result["bad"] == 0
    landed = partitions(tmp_path / "raw")
    assert sorted(landed) == ["2026-10-01", "2026-10-02", "2026-10-03"]
    every = [r for day in landed.values() for r in day]
    assert sorted(r["id"] for r in every) == sorted(r["key"] for r in ROWS)
    assert all(set(r) == set(records.REQUIRED_FIELDS) and r["source"] == "manuals" for r in every)
    assert {r["id"]: r["text"] for r in every} == {r["key"]: r["doc"] for r in ROWS}
    assert all(r["created_at"].startswith(day) for day, rows in landed.items() for r in rows)


def test_a_folder_of_text_files_is_one_record_a_file_on_the_import_date(tmp_path: Path) -> None:
    folder = tmp_path / "docs"
    (folder / "guide").mkdir(parents=True)
    (folder / "guide" / "install.md").write_text("# Install\nRun make pipeline.")
    (folder / "notes.txt").write_text("Notes on the canary.")
    (folder / "image.png").write_bytes(b"\x89PNG")  # not text: not read
    code, result, stderr = run_import(folder, tmp_path / "raw", "--date", "2026-11-02")
    assert code == 0 and result["format"] == "text", stderr[-2000:]
    landed = partitions(tmp_path / "raw")["2026-11-02"]
    assert {r["id"]: r["text"] for r in landed} == {"guide/install.md": "# Install\nRun make pipeline.",
                                                    "notes.txt": "Notes on the canary."}
    assert {r["source"] for r in landed} == {"docs"}


def test_bad_rows_are_quarantined_with_their_reasons_and_the_rest_lands(tmp_path: Path) -> None:
    """One row in ten bad, each a different way: the other 27 land, the 3 are in the quarantine
    with their reasons, the summary counts them by reason."""
    rows: list[Any] = [dict(r) for r in ROWS]
    rows[3] = {"key": "d3", "when": "2026-10-01"}  # no text
    rows[13] = "{not json"
    rows[23] = {**ROWS[23], "when": "yesterday"}
    source = write_jsonl(tmp_path / "corpus.jsonl", rows)
    source.write_bytes(source.read_bytes() + b'{"doc": "caf\xe9", "key": "latin1"}\n')  # not UTF-8
    code, result, stderr = run_import(source, tmp_path / "raw", *MAPPING)
    assert code == 0, stderr[-2000:]
    assert (result["rows"], result["imported"], result["bad"]) == (31, 27, 4)
    assert result["bad_reasons"] == {"no field 'doc'": 1, "not JSON (Expecting property name enclosed in double "
                                     "quotes)": 1, "timestamp field 'when': 'yesterday' is not ISO 8601 or epoch "
                                     "seconds": 1, "not UTF-8": 1}
    quarantined = [json.loads(line) for path in Path(result["quarantine_uri"]).glob("*.jsonl")
                   for line in path.read_text().splitlines()]
    assert {q["row"] for q in quarantined} == {"corpus.jsonl:4", "corpus.jsonl:14", "corpus.jsonl:24", "corpus.jsonl:31"}
    assert sum(len(day) for day in partitions(tmp_path / "raw").values()) == 27


def test_too_many_bad_rows_or_no_text_field_fail_with_one_line_and_nothing_written(tmp_path: Path) -> None:
    rows = [dict(r) for r in ROWS]
    for row in rows[:10]:
        row["doc"] = 7  # a third of the rows: over ingest.max_bad_share (20%)
    code, stderr = run_import_process(write_jsonl(tmp_path / "a.jsonl", rows), tmp_path / "raw", "--set",
                                      "max_bad_share=0.2", *MAPPING)
    assert code == 2 and not (tmp_path / "raw").exists()
    assert stderr.strip().splitlines()[-1] == (
        f"ERROR python -m tasks.ingest: {tmp_path / 'a.jsonl'}: 10 of 30 rows are bad (33.3%, above "
        "ingest.max_bad_share 20%): 'doc' is int, not a string (10)")
    code, _, stderr = run_import(write_jsonl(tmp_path / "b.jsonl", ROWS), tmp_path / "raw")  # text field: "text"
    assert code == 2 and not (tmp_path / "raw").exists()
    assert stderr.strip().splitlines()[-1].endswith(
        "no row has a field 'text' (its rows have: doc, key, when): name the text field with --text-field")
    looser, stderr = run_import_process(tmp_path / "a.jsonl", tmp_path / "raw", "--set", "max_bad_share=0.5", *MAPPING)
    assert looser == 0, stderr[-2000:]
    assert "imported 20 of 30 rows" in stderr and "10 bad (quarantined at" in stderr
    for bad_source, message in ((tmp_path / "corpus.xlsx", "a .xlsx file is not a corpus this importer reads"),
                                (tmp_path / "absent.jsonl", "no such file or folder")):
        if bad_source.suffix == ".xlsx":
            bad_source.write_bytes(b"x")
        code, _, stderr = run_import(bad_source, tmp_path / "elsewhere", *MAPPING)
        assert code == 2 and message in stderr.strip().splitlines()[-1]


def test_importing_the_same_corpus_again_adds_nothing_and_a_new_one_adds_beside(tmp_path: Path) -> None:
    """Again: every day already has this import's file, nothing changes. A second corpus with
    rows on the same days: its own file beside the first's, the first untouched, the
    partition's manifest listing both."""
    source = write_jsonl(tmp_path / "corpus.jsonl", ROWS)
    assert run_import(source, tmp_path / "raw", *MAPPING)[0] == 0
    before = {p: p.read_bytes() for p in (tmp_path / "raw").rglob("*") if p.is_file()}
    code, again, _ = run_import(source, tmp_path / "raw", *MAPPING)
    assert code == 0 and again["days_added"] == [] and len(again["days_already_there"]) == 3
    assert {p: p.read_bytes() for p in (tmp_path / "raw").rglob("*") if p.is_file()} == before
    more = [{**r, "key": f"e{i}", "doc": r["doc"] + " Again."} for i, r in enumerate(ROWS)]
    code, second, _ = run_import(write_jsonl(tmp_path / "more.jsonl", more), tmp_path / "raw", *MAPPING)
    assert code == 0 and len(second["days_added"]) == 3
    day = tmp_path / "raw" / "date=2026-10-01"
    manifest = storage.read_manifest(str(day))
    assert len(manifest["files"]) == 2 and all((day / name).exists() for name in manifest["files"])
    assert all(p.read_bytes() == data for p, data in before.items() if p.name != storage.SUCCESS_MARKER)
    assert sum(len(rows) for rows in partitions(tmp_path / "raw").values()) == 60


def test_a_day_partition_is_read_by_the_snapshot_layout(tmp_path: Path) -> None:
    """What the import wrote is what the snapshot step reads: records.partition_files finds each
    day's files, and each line parses as a raw record."""
    source = write_jsonl(tmp_path / "corpus.jsonl", ROWS)
    assert run_import(source, tmp_path / "raw", *MAPPING)[0] == 0
    days = [dt.date(2026, 10, d) for d in (1, 2, 3)]
    files = records.partition_files(str(tmp_path / "raw"), days)
    parsed = [r for _, uri in files for r in records.parse_lines(uri, Path(uri).read_bytes(), 1 << 20)]
    assert len(parsed) == 30
