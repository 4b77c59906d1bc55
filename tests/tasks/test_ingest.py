"""``python -m tasks.ingest import``: a team's corpus into raw partitions, each format, bad rows
quarantined, nothing written past the bound, idempotent."""

from __future__ import annotations

import csv
import datetime as dt
import json
from pathlib import Path
from typing import Any

import pytest
from helpers import run_module, step_result

from tasks.lib import records, storage
from tasks.lib.errors import StepError

ROWS = [{"doc": f"Document {i}: how to return the number of items in bucket {i}.", "key": f"d{i}",
         "when": f"2026-10-{1 + i % 3:02d}T12:00:00Z"} for i in range(30)]
MAPPING = ("--text-field", "doc", "--id-field", "key", "--timestamp-field", "when")


def run_import(source: Path, to: Path | str, *args: str) -> tuple[int, dict[str, Any], str]:
    """The import in this process (the exit code and the one line: :func:`run_import_process`)."""
    from tasks.contract import to_json
    from tasks.ingest import main, parser

    try:
        return 0, to_json(main(parser().parse_args(["import", str(source), "--to", str(to), *args]))), ""
    except StepError as exc:
        return 2, {}, f"ERROR python -m tasks.ingest: {exc}"


def run_import_process(source: Path, to: Path, *args: str) -> tuple[int, str]:
    """``python -m tasks.ingest [--set ...] import SOURCE --to TO ARGS``."""
    settings = list(args[:2]) if args[:1] == ("--set",) else []
    proc = run_module("tasks.ingest", *settings, "import", str(source), "--to", str(to), *args[len(settings):])
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
    assert {r["id"].split("@")[0]: r["text"] for r in landed} == {"guide/install.md": "# Install\nRun make pipeline.",
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
    code, stderr = run_import_process(write_jsonl(tmp_path / "a.jsonl", rows), tmp_path / "raw", *MAPPING)
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


def test_a_heldout_split_keeps_every_copy_of_its_texts_out_of_the_partitions(tmp_path: Path) -> None:
    """--heldout-output: one text in heldout_every by its normalized text's hash, each copy of it
    (another id, day, spacing) on the held-out side, nothing of it in a partition; again: nothing
    added, nothing changed."""
    from tasks.ingest import is_heldout

    texts = [f"Document {i} about canaries, rollbacks and the {i % 7}th shard." for i in range(300)]
    rows = [{"doc": t, "key": f"a{i}", "when": f"2026-10-0{1 + i % 3}T08:00:00"} for i, t in enumerate(texts)]
    rows += [{"doc": t + "  \r\n", "key": f"b{i}", "when": "2026-10-05T08:00:00"} for i, t in enumerate(texts[:100])]
    source = write_jsonl(tmp_path / "corpus.jsonl", rows)
    code, stderr = run_import_process(source, tmp_path / "raw", "--set", "heldout_every=10", *MAPPING,
                                      "--heldout-output", str(tmp_path / "heldout"))
    assert code == 0, stderr[-2000:]
    [held_file] = (tmp_path / "heldout").glob("eval-import-*.jsonl")
    held = [json.loads(line)["text"] for line in held_file.read_text().splitlines()]
    kept = [r["text"] for day in partitions(tmp_path / "raw").values() for r in day]
    wanted = {t for t in texts if is_heldout(t, 10)}
    assert 10 <= len(wanted) <= 60  # ~30 of 300: the hash's share, not a lucky pick
    assert {records.normalize_text(t) for t in held} == wanted
    assert len(held) == len(wanted) + sum(t in wanted for t in texts[:100])  # the second copies too
    assert not {records.normalize_text(t) for t in kept} & wanted and len(held) + len(kept) == len(rows)
    storage.require_complete(str(tmp_path / "heldout"))
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and "corpus" not in p.name}
    code, _ = run_import_process(source, tmp_path / "raw", "--set", "heldout_every=10", *MAPPING,
                                 "--heldout-output", str(tmp_path / "heldout"))
    assert code == 0 and {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and "corpus" not in p.name} \
        == before


def test_a_day_partition_is_read_by_the_snapshot_layout(tmp_path: Path) -> None:
    """What the import wrote is what the snapshot step reads: records.partition_files finds each
    day's files, and each line parses as a raw record."""
    source = write_jsonl(tmp_path / "corpus.jsonl", ROWS)
    assert run_import(source, tmp_path / "raw", *MAPPING)[0] == 0
    days = [dt.date(2026, 10, d) for d in (1, 2, 3)]
    files = records.partition_files(str(tmp_path / "raw"), days)
    parsed = [r for _, uri in files for r in records.parse_lines(uri, Path(uri).read_bytes(), 1 << 20)]
    assert len(parsed) == 30


def test_a_partition_another_job_landed_with_a_bare_marker_gets_the_import_beside_its_files(tmp_path: Path) -> None:
    """Other ingestion jobs (Spark, Hadoop) mark a partition complete with an empty ``_SUCCESS``:
    the import adds its file and leaves their files and marker as they are; again, nothing."""
    day = tmp_path / "raw" / "date=2026-10-01"
    day.mkdir(parents=True)
    theirs = day / "part-00000.jsonl"
    theirs.write_text(json.dumps({"id": "x", "text": "landed by Spark", "source": "spark",
                                  "created_at": "2026-10-01T00:00:00"}) + "\n")
    (day / storage.SUCCESS_MARKER).write_bytes(b"")
    source = write_jsonl(tmp_path / "corpus.jsonl", ROWS)
    assert run_import(source, tmp_path / "raw", *MAPPING)[1]["days_added"] == ["2026-10-01", "2026-10-02", "2026-10-03"]
    assert (day / storage.SUCCESS_MARKER).read_bytes() == b"" and theirs.exists()
    assert len(partitions(tmp_path / "raw")["2026-10-01"]) == 11
    assert run_import(source, tmp_path / "raw", *MAPPING)[1]["days_added"] == []


@pytest.mark.integration
def test_an_import_to_s3_lands_what_the_snapshot_step_reads(stack_env: dict[str, str], tmp_path: Path) -> None:
    """On the real S3 server: the partitions committed with their manifests, the same corpus
    again adds nothing, and the snapshot step versions the imported records."""
    import uuid

    raw = f"s3://raw/test-import-{uuid.uuid4().hex[:8]}"
    source = write_jsonl(tmp_path / "corpus.jsonl", ROWS)
    code, first, stderr = run_import(source, raw, *MAPPING)
    assert code == 0 and len(first["days_added"]) == 3, stderr
    names = storage.list_files(raw)
    landed = {n.rsplit("/", 1)[-1] for n in names if "/date=" in n}
    assert landed == {"part-import-" + first["key"] + ".jsonl", storage.SUCCESS_MARKER}
    assert {n.removeprefix(raw + "/") for n in names if "/date=" not in n} == {f"_imports/import-{first['key']}.json"}
    assert run_import(source, raw, *MAPPING)[1]["days_already_there"] == ["2026-10-01", "2026-10-02", "2026-10-03"]
    assert storage.list_files(raw) == names
    snapshot = run_module("tasks.snapshot", "--source", raw, "--end-date", "2026-10-04", "--lookback-days", "3",
                          "--output", f"s3://pipeline/tests/{uuid.uuid4().hex[:12]}/snapshot")
    assert snapshot.returncode == 0, snapshot.stderr[-2000:]
    assert step_result(snapshot)["data_version"]["records"] == 30  # type: ignore[index]


def test_the_day_is_the_timestamps_in_utc_whatever_its_form(tmp_path: Path) -> None:
    """Offsets, ``Z``, naive times (UTC), epoch seconds as numbers and as CSV text: each row in
    the partition of its UTC day, near midnight too."""
    stamps = ["2026-10-01T23:30:00-02:00", "2026-10-02T00:30:00+02:00", "2026-10-01T23:59:59Z",
              "2026-10-03T00:00:00", 1790812800, "1790812800.5"]
    days = ["2026-10-02", "2026-10-01", "2026-10-01", "2026-10-03", "2026-10-01", "2026-10-01"]
    rows = [{"doc": f"text {i}", "key": f"k{i}", "when": stamp} for i, stamp in enumerate(stamps)]
    code, result, stderr = run_import(write_csv(tmp_path / "c.csv", rows), tmp_path / "raw", *MAPPING)
    assert code == 0 and result["bad"] == 0, (stderr, result)
    landed = {r["id"]: day for day, rows in partitions(tmp_path / "raw").items() for r in rows}
    assert landed == {f"k{i}": day for i, day in enumerate(days)}


def test_bad_rows_of_every_kind_are_rows_not_tracebacks(tmp_path: Path) -> None:
    from tasks.lib.params import load_settings

    limit = load_settings().snapshot.max_record_bytes
    rows: list[Any] = [dict(r) for r in ROWS]
    rows[1] = {**ROWS[1], "doc": "\ud800 lone"}  # json.dumps escapes it: the import reads a lone surrogate
    rows[2] = {**ROWS[2], "doc": "\x00\x01 \x7f"}  # only control characters: empty once normalized
    rows[3] = {**ROWS[3], "when": "0001-01-01T00:00:00+05:00"}  # before year 1 in UTC
    rows[4] = {**ROWS[4], "doc": "x" * (limit + 10)}
    rows[5] = "[" * 100000  # nested too deeply
    rows[6] = '"a string"'
    code, result, stderr = run_import(write_jsonl(tmp_path / "a.jsonl", rows), tmp_path / "raw", *MAPPING)
    assert code == 0, stderr
    assert result["bad"] == 6 and set(result["bad_reasons"]) == {
        "'doc' is not valid UTF-8 (a lone surrogate)", "'doc' is empty (or only spaces and control characters)",
        "timestamp field 'when': '0001-01-01T00:00:00+05:00' is not ISO 8601 or epoch seconds",
        f"a line above snapshot.max_record_bytes {limit}", "not JSON (nested too deeply)",
        "a JSON str, not an object"}
    with_bom = tmp_path / "bom.csv"
    with_bom.write_bytes(b"\xef\xbb\xbf" + write_csv(tmp_path / "plain.csv", ROWS).read_bytes())
    assert run_import(with_bom, tmp_path / "raw2", *MAPPING)[1]["imported"] == 30


def test_a_broken_datasets_folder_or_a_foreign_partition_is_one_line(tmp_path: Path) -> None:
    folder = write_dataset(tmp_path / "ds", ROWS)
    next((folder / "train").glob("*.arrow")).unlink()
    code, _, stderr = run_import(folder, tmp_path / "raw", *MAPPING)
    assert code == 2 and "is missing (its state.json lists it)" in stderr
    code, _, stderr = run_import(write_dataset(tmp_path / "ds2", ROWS), tmp_path / "raw", *MAPPING, "--split", "val")
    assert code == 2 and "no split 'val' (it has train, test)" in stderr
    unfinished = tmp_path / "raw" / "date=2026-10-02"  # another writer's, no marker yet
    unfinished.mkdir(parents=True)
    (unfinished / "part-00000.jsonl").write_text("{}\n")
    code, _, stderr = run_import(write_jsonl(tmp_path / "a.jsonl", ROWS), tmp_path / "raw", *MAPPING)
    assert code == 2 and "files but no _SUCCESS marker" in stderr and (unfinished / "part-00000.jsonl").exists()


def test_an_import_killed_midway_lands_the_rest_when_run_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second corpus on the days the first landed: the first day gets its file, then the
    import dies after the second day's file landed but before that partition's manifest was
    rewritten. The rerun lists the stray file, adds the third day: every record once, the first
    corpus's files untouched."""
    assert run_import(write_jsonl(tmp_path / "corpus.jsonl", ROWS), tmp_path / "raw", *MAPPING)[0] == 0
    original = storage.add_files
    calls = {"n": 0}

    def dies_on_the_second(local_dir: Path, uri: str) -> list[str]:
        calls["n"] += 1
        if calls["n"] == 2:
            for path in local_dir.iterdir():  # the file lands, the manifest never does
                (Path(uri) / path.name).write_bytes(path.read_bytes())
            raise KeyboardInterrupt
        return original(local_dir, uri)

    more = [{**r, "key": f"e{i}", "doc": r["doc"] + " Again."} for i, r in enumerate(ROWS)]
    second = write_jsonl(tmp_path / "more.jsonl", more)
    monkeypatch.setattr(storage, "add_files", dies_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        run_import(second, tmp_path / "raw", *MAPPING)
    monkeypatch.setattr(storage, "add_files", original)
    code, rerun, stderr = run_import(second, tmp_path / "raw", *MAPPING)
    assert code == 0, stderr
    assert rerun["days_already_there"] == ["2026-10-01"] and rerun["days_added"] == ["2026-10-02", "2026-10-03"]
    stray = tmp_path / "raw" / "date=2026-10-02"
    assert set(storage.read_manifest(str(stray))["files"]) == {p.name for p in stray.glob("*.jsonl")}
    assert sum(len(day) for day in partitions(tmp_path / "raw").values()) == 60


def test_a_source_without_timestamps_lands_on_its_first_imports_day_again(tmp_path: Path) -> None:
    """Rows without a timestamp go to the import's day; the same source imported again on
    another day (or a rerun after a crash past midnight) uses the first import's day, recorded
    before anything landed: nothing twice. Another explicit --date is refused with one line."""
    rows = [{"doc": r["doc"], "key": r["key"]} for r in ROWS]
    source = write_jsonl(tmp_path / "corpus.jsonl", rows)
    mapping = ("--text-field", "doc", "--id-field", "key")
    assert run_import(source, tmp_path / "raw", *mapping, "--date", "2026-10-05")[1]["days_added"] == ["2026-10-05"]
    again = run_import(source, tmp_path / "raw", *mapping)  # today: the ledger's day instead
    assert again[0] == 0 and again[1]["days_already_there"] == ["2026-10-05"] and again[1]["days_added"] == []
    code, _, stderr = run_import(source, tmp_path / "raw", *mapping, "--date", "2026-10-06")
    assert code == 2 and "this source was imported with --date 2026-10-05" in stderr


def test_a_new_partition_an_earlier_attempt_left_without_its_marker_is_completed(tmp_path: Path) -> None:
    """On S3 a commit uploads the files, then the marker: an attempt that died between left our
    own file alone in the folder. The rerun completes it; a folder holding another writer's
    file is refused (see above)."""
    from tasks.lib.storage import add_files

    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "part-import-k.jsonl").write_text("{}\n")
    target = tmp_path / "raw" / "date=2026-10-01"
    target.mkdir(parents=True)
    (target / "part-import-k.jsonl").write_text("{}\n")
    assert add_files(ours, str(target)) == ["part-import-k.jsonl"]
    assert set(storage.read_manifest(str(target))["files"]) == {"part-import-k.jsonl"}
