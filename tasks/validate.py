"""Validation gate: a Great Expectations 1.x suite over the snapshot, with an HTML report.

The suite is defined in code (:func:`build_suite`) with thresholds from params.yaml ``validate``;
each day of the window is also checked on its own (:func:`check_partitions`, from the
snapshot's per-partition counts), so one bad day among good ones cannot hide in the totals.
The Data Docs report and a JSON summary are written to ``--output`` whether the gate passes
or not; on failure the step exits 2 with one line naming the failed expectations and their
counts, so the DAG stops before tokenization.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Any

from tasks.lib import storage
from tasks.lib.errors import StepError
from tasks.lib.params import step_params
from tasks.lib.step import log, run_step, step_parser

SNAPSHOT_COLUMNS = ["id", "text", "source", "created_at", "content_hash", "copies"]
EMAIL_RE = r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"
# U+FFFD means text was decoded lossily upstream; C0 controls should be gone after normalization.
# Literal characters, not escapes: pandas hands the pattern to Arrow's RE2, which lacks \\u.
BROKEN_CHARS_RE = "[\ufffd\x00-\x08\x0b-\x1f\x7f]"
ISO_TIMESTAMP_RE = r"^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}"


def build_suite(gx: Any, params: dict[str, Any]) -> Any:
    """The data contract of a snapshot."""
    e = gx.expectations
    max_copies_mean = 1.0 / (1.0 - float(params["max_duplicate_ratio"]))
    suite = gx.ExpectationSuite(name="snapshot_contract")
    for expectation in [
        e.ExpectTableColumnsToMatchSet(column_set=SNAPSHOT_COLUMNS, exact_match=True),
        e.ExpectTableRowCountToBeBetween(min_value=params["min_records"], max_value=params["max_records"]),
        *[e.ExpectColumnValuesToNotBeNull(column=c) for c in ("id", "text", "source", "created_at")],
        e.ExpectColumnValuesToBeUnique(column="id"),
        e.ExpectColumnValueLengthsToBeBetween(
            column="text", min_value=params["min_text_chars"], max_value=params["max_text_chars"],
            mostly=params["text_length_mostly"],
        ),
        # mean copies per kept record = records_in / records; duplicate ratio = 1 - 1/mean
        e.ExpectColumnMeanToBeBetween(column="copies", min_value=1.0, max_value=max_copies_mean),
        e.ExpectColumnValuesToNotMatchRegex(
            column="text", regex=BROKEN_CHARS_RE, mostly=1.0 - float(params["max_broken_text_ratio"])
        ),
        e.ExpectColumnValuesToMatchRegex(column="created_at", regex=ISO_TIMESTAMP_RE),
        e.ExpectColumnValuesToNotMatchRegex(
            column="text", regex=EMAIL_RE, mostly=1.0 - float(params["max_email_ratio"])
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


def run_suite(df: Any, params: dict[str, Any], docs_dir: Path) -> tuple[bool, list[dict[str, Any]]]:
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import great_expectations as gx  # 8-11 s to import: only this step pays for it

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
    batch = context.data_sources.add_pandas("snapshot").add_dataframe_asset("records")
    definition = context.validation_definitions.add(
        gx.ValidationDefinition(
            name="snapshot_contract",
            data=batch.add_batch_definition_whole_dataframe("all"),
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
    outcome = checkpoint.run(batch_parameters={"dataframe": df})
    results = [describe(r) for run in outcome.run_results.values() for r in run.results]
    return bool(outcome.success), results


def check_partitions(partitions: dict[str, dict[str, int]], params: dict[str, Any]) -> list[dict[str, Any]]:
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
        if not params["partition_min_share"] <= share <= params["partition_max_share"]:
            fail(day, "share", round(share, 3), f"{records} records, {share:.2f}x an even share of the window "
                 f"(bounds {params['partition_min_share']}..{params['partition_max_share']})")
        repeated = counts["repeated"] / records
        if repeated > params["partition_max_repeated_ratio"]:
            fail(day, "repeated_ratio", round(repeated, 3), f"{repeated:.0%} of its {records} records repeat "
                 f"earlier texts (max {params['partition_max_repeated_ratio']:.0%})")
    return failed


def load_snapshot(uri: str, scratch: Path) -> Any:
    import pandas as pd

    local = storage.download(uri, scratch / "snapshot.jsonl")
    try:
        return pd.read_json(local, lines=True, dtype={"id": str, "content_hash": str, "created_at": str})
    except ValueError as exc:
        raise StepError(f"{uri}: cannot be read as JSON Lines ({exc})") from None


def main(args: argparse.Namespace) -> dict[str, Any]:
    params = step_params("validate", args.overrides)
    with storage.staged_output(args.output) as out_dir, storage.scratch() as scratch:
        df = load_snapshot(args.snapshot, scratch)
        success, results = run_suite(df, params, out_dir / "report")
        stats_uri = storage.sibling(args.snapshot, "stats.json")  # the snapshot step's, beside it
        partitions = storage.read_json(stats_uri).get("partitions", {}) if storage.exists(stats_uri) else {}
        partition_failures = check_partitions(partitions, params)
        success = success and not partition_failures
        results += partition_failures
        failed = [r for r in results if not r["success"]]
        summary = {
            "snapshot_uri": args.snapshot,
            "records": len(df),
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
    log.info("validation passed: %d expectations on %d records; report %s", len(results), len(df), report_uri)
    return {
        "success": True,
        "report_uri": report_uri,
        "summary_uri": storage.join(args.output, "summary.json"),
        "evaluated": len(results),
        "records": len(df),
    }


def parser() -> argparse.ArgumentParser:
    p = step_parser("validate", __doc__.splitlines()[0])
    p.add_argument("--snapshot", required=True, help="URI of the snapshot.jsonl to validate")
    p.add_argument("--output", required=True, help="run-scoped URI for the report and summary")
    return p


if __name__ == "__main__":
    run_step(parser(), main)
