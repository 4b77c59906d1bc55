"""Validation gate: a Great Expectations 1.x suite over the snapshot, with an HTML report.

The suite is defined in code (:func:`build_suite`) with thresholds from params.yaml ``validate``;
each day of the window is also checked on its own (:func:`check_partitions`, from the
snapshot's per-partition counts), so one bad day among good ones cannot hide in the totals.
The suite runs as SQL on an on-disk SQLite copy of the snapshot (:func:`load_snapshot`), so
the step's memory does not grow with the corpus.
The Data Docs report and a JSON summary are written to ``--output`` whether the gate passes
or not; on failure the step exits 2 with one line naming the failed expectations and their
counts, so the DAG stops before tokenization.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from tasks.config import ValidateSettings
from tasks.lib import storage
from tasks.lib.errors import StepError
from tasks.lib.params import load_settings
from tasks.lib.records import EMAIL_RE
from tasks.lib.step import log, run_step, step_parser
from tasks.results import ValidateResult

SNAPSHOT_COLUMNS = ["id", "text", "source", "created_at", "content_hash", "copies"]
# U+FFFD means text was decoded lossily upstream; C0 controls should be gone after normalization.
# SQLite evaluates the patterns with Python's re (the REGEXP function SQLAlchemy registers).
BROKEN_CHARS_RE = "[\ufffd\x00-\x08\x0b-\x1f\x7f]"
ISO_TIMESTAMP_RE = r"^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}"


def build_suite(gx: Any, params: ValidateSettings) -> Any:
    """The data contract of a snapshot."""
    e = gx.expectations
    max_copies_mean = 1.0 / (1.0 - params.max_duplicate_ratio)
    suite = gx.ExpectationSuite(name="snapshot_contract")
    for expectation in [
        e.ExpectTableColumnsToMatchSet(column_set=SNAPSHOT_COLUMNS, exact_match=True),
        e.ExpectTableRowCountToBeBetween(min_value=params.min_records, max_value=params.max_records),
        *[e.ExpectColumnValuesToNotBeNull(column=c) for c in ("id", "text", "source", "created_at")],
        e.ExpectColumnValuesToBeUnique(column="id"),
        e.ExpectColumnValueLengthsToBeBetween(
            column="text", min_value=params.min_text_chars, max_value=params.max_text_chars,
            mostly=params.text_length_mostly,
        ),
        # mean copies per kept record = records_in / records; duplicate ratio = 1 - 1/mean
        e.ExpectColumnMeanToBeBetween(column="copies", min_value=1.0, max_value=max_copies_mean),
        e.ExpectColumnValuesToNotMatchRegex(
            column="text", regex=BROKEN_CHARS_RE, mostly=1.0 - params.max_broken_text_ratio
        ),
        e.ExpectColumnValuesToMatchRegex(column="created_at", regex=ISO_TIMESTAMP_RE),
        e.ExpectColumnValuesToNotMatchRegex(
            column="text", regex=EMAIL_RE, mostly=1.0 - params.max_email_ratio
        ),
    ]:
        suite.add_expectation(expectation)
    return suite


def describe(result: Any) -> dict[str, Any]:
    config = result.expectation_config
    stats = result.result or {}
    return {
        "expectation": config.type,
        "column": config.kwargs.get("column"),
        "success": bool(result.success),
        "unexpected_count": stats.get("unexpected_count"),
        "unexpected_percent": stats.get("unexpected_percent"),
        "observed_value": stats.get("observed_value"),
        "examples": [str(v)[:80] for v in (stats.get("partial_unexpected_list") or [])[:3]],
        "error": (result.exception_info or {}).get("exception_message") if result.exception_info else None,
    }


def failure_line(failed: list[dict[str, Any]]) -> str:
    parts = []
    for f in failed:
        name = f["expectation"] + (f"({f['column']})" if f["column"] else "")
        if f.get("detail"):
            parts.append(f"{name}: {f['detail']}")
        elif f.get("error"):
            parts.append(f"{name}: could not be evaluated ({f['error']})")
        elif f["unexpected_count"] is not None:
            parts.append(f"{name}: {f['unexpected_count']} unexpected ({f['unexpected_percent']:.3g}%)")
        else:
            parts.append(f"{name}: observed {f['observed_value']}")
    return "; ".join(parts)


def run_suite(database: Path, params: ValidateSettings, docs_dir: Path) -> tuple[bool, list[dict[str, Any]]]:
    import great_expectations as gx  # (its analytics off: tasks/__init__.py)  # 8-11 s to import: only this step pays for it

    logging.getLogger("great_expectations").setLevel(logging.WARNING)
    context = gx.get_context(mode="ephemeral")
    context.add_data_docs_site(
        site_name="report",
        site_config={
            "class_name": "SiteBuilder",
            "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": str(docs_dir)},
            "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
        },
    )
    table = context.data_sources.add_sqlite("snapshot", connection_string=f"sqlite:///{database}").add_table_asset(
        "records", table_name="records")
    definition = context.validation_definitions.add(
        gx.ValidationDefinition(
            name="snapshot_contract",
            data=table.add_batch_definition_whole_table("all"),
            suite=context.suites.add(build_suite(gx, params)),
        )
    )
    checkpoint = context.checkpoints.add(
        gx.Checkpoint(
            name="snapshot_gate",
            validation_definitions=[definition],
            actions=[gx.checkpoint.UpdateDataDocsAction(name="report", site_names=["report"])],
            result_format={"result_format": "SUMMARY", "partial_unexpected_count": 3},
        )
    )
    outcome = checkpoint.run()
    results = [describe(r) for run in outcome.run_results.values() for r in run.results]
    return bool(outcome.success), results


def check_partitions(partitions: dict[str, dict[str, int]], params: ValidateSettings) -> list[dict[str, Any]]:
    """Each day of the window on its own (a bad day among good ones passes the window's
    totals): not empty, within ``partition_min_share``..``partition_max_share`` of an even share
    of the window's records, at most ``partition_max_repeated_ratio`` of its records repeating a
    text seen earlier in the window. One result per failed check, named by the partition."""
    total = sum(p["records"] for p in partitions.values())
    even = total / max(len(partitions), 1)
    failed = []

    def fail(day: str, check: str, observed: Any, detail: str) -> None:
        failed.append({"expectation": f"partition_{check}", "column": f"date={day}", "success": False,
                       "unexpected_count": None, "unexpected_percent": None, "observed_value": observed,
                       "detail": detail, "examples": [], "error": None})

    for day, counts in sorted(partitions.items()):
        records = counts["records"]
        if records == 0:
            fail(day, "not_empty", 0, "no records")
            continue
        share = records / even if even else 0.0
        if not params.partition_min_share <= share <= params.partition_max_share:
            fail(day, "share", round(share, 3), f"{records} records, {share:.2f}x an even share of the window "
                 f"(bounds {params.partition_min_share}..{params.partition_max_share})")
        repeated = counts["repeated"] / records
        if repeated > params.partition_max_repeated_ratio:
            fail(day, "repeated_ratio", round(repeated, 3), f"{repeated:.0%} of its {records} records repeat "
                 f"earlier texts (max {params.partition_max_repeated_ratio:.0%})")
    return failed


# Declared types for the contract's columns; any other key of a record becomes an untyped column
# (so the column-set expectation sees it), added the first time a record carries it.
COLUMN_TYPES = {"id": "TEXT", "text": "TEXT", "source": "TEXT", "created_at": "TEXT", "content_hash": "TEXT",
                "copies": "INTEGER"}
LOAD_BATCH_ROWS = 5_000


def sql_value(value: Any) -> Any:
    return json.dumps(value) if isinstance(value, (dict, list)) else value


def quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def add_columns(db: Any, keys: set[str], columns: list[str]) -> None:
    """Creates the table with its first keys, then adds a column for each key not seen before."""
    for key in sorted(keys - set(columns)):
        definition = f"{quoted(key)} {COLUMN_TYPES.get(key, '')}"
        db.execute(f"ALTER TABLE records ADD COLUMN {definition}" if columns else f"CREATE TABLE records ({definition})")
        columns.append(key)


def insert_rows(db: Any, batch: list[dict[str, Any]], columns: list[str]) -> None:
    add_columns(db, {key for record in batch for key in record}, columns)
    db.executemany(f"INSERT INTO records ({', '.join(map(quoted, columns))}) VALUES ({', '.join('?' * len(columns))})",
                   ([sql_value(record.get(c)) for c in columns] for record in batch))
    batch.clear()


def load_snapshot(uri: str, scratch: Path) -> tuple[Path, int]:
    """The snapshot as an on-disk SQLite table ``records``, filled a batch of lines at a time:
    Great Expectations then validates it with SQL, so the step's memory does not grow with the
    corpus (a pandas frame held every record). Returns the database and its row count."""
    import sqlite3

    local = storage.download(uri, scratch / "snapshot.jsonl")
    database = scratch / "snapshot.sqlite"
    database.unlink(missing_ok=True)  # a retry starts over
    columns: list[str] = []
    batch: list[dict[str, Any]] = []
    rows = 0
    db = sqlite3.connect(database)
    try:
        db.execute("PRAGMA journal_mode=OFF")  # scratch, rebuilt from the snapshot by a retry
        db.execute("PRAGMA synchronous=OFF")
        with local.open("rb") as lines:
            for lineno, raw in enumerate(lines, start=1):
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw)
                except ValueError as exc:
                    raise StepError(f"{uri}:{lineno}: cannot be read as JSON Lines ({exc})") from None
                if not isinstance(record, dict):
                    raise StepError(f"{uri}:{lineno}: expected a JSON object, got {type(record).__name__}")
                batch.append(record)
                rows += 1
                if len(batch) == LOAD_BATCH_ROWS:
                    insert_rows(db, batch, columns)
        insert_rows(db, batch, columns)
        if not columns:  # no records: the contract's columns, so the row count is what fails
            add_columns(db, set(COLUMN_TYPES), columns)
        db.commit()
    finally:
        db.close()
    return database, rows


def main(args: argparse.Namespace) -> ValidateResult:
    params = load_settings("validate", args.overrides).validate
    with storage.staged_output(args.output) as out_dir, storage.scratch() as scratch:
        database, records = load_snapshot(args.snapshot, scratch)
        success, results = run_suite(database, params, out_dir / "report")
        stats_uri = storage.sibling(args.snapshot, "stats.json")  # the snapshot step's, beside it
        partitions = storage.read_json(stats_uri).get("partitions", {}) if storage.exists(stats_uri) else {}
        partition_failures = check_partitions(partitions, params)
        success = success and not partition_failures
        results += partition_failures
        failed = [r for r in results if not r["success"]]
        summary = {
            "snapshot_uri": args.snapshot,
            "records": records,
            "success": success,
            "evaluated": len(results),
            "partitions": partitions,
            "failed": failed,
            "results": results,
        }
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    report_uri = storage.join(args.output, "report", "index.html")
    if not success:
        raise StepError(
            f"validation of {args.snapshot} failed {len(failed)}/{len(results)} expectations: "
            f"{failure_line(failed)} (report: {report_uri})"
        )
    log.info("validation passed: %d expectations on %d records; report %s", len(results), records, report_uri)
    return ValidateResult(success=True, report_uri=report_uri, summary_uri=storage.join(args.output, "summary.json"),
                          evaluated=len(results), records=records)


def parser() -> argparse.ArgumentParser:
    p = step_parser("validate", __doc__.splitlines()[0])
    p.add_argument("--snapshot", required=True, help="URI of the snapshot.jsonl to validate")
    p.add_argument("--output", required=True, help="run-scoped URI for the report and summary")
    return p


if __name__ == "__main__":
    run_step(parser(), main)
