"""Write demo raw data: date partitions of real text from the installed software.

The embedded default has no network, so its corpus is the docstrings of the Python standard
library and of the packages installed in the runtime environment, read with ``ast`` (nothing is
imported). Files are visited in sorted order and each document lands on a date chosen by the
hash of its id, so the output is deterministic for a given environment. Existing partitions are
never rewritten (raw data is immutable); a second run only reports them.
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import hashlib
import json
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tasks.lib import records, storage
from tasks.lib.params import step_params
from tasks.lib.step import Progress, log, run_step, step_parser

MIN_DOC_CHARS = 80


def source_roots() -> list[Path]:
    paths = sysconfig.get_paths()
    return [Path(paths["stdlib"]), Path(paths["purelib"])]


def python_files(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*.py")):
        parts = set(path.parts)
        if parts & {"test", "tests", "__pycache__", "idle_test"}:
            continue
        yield path


def docstrings(path: Path, root: Path) -> Iterator[tuple[str, str]]:
    """(qualified name, docstring) of a module and its classes and functions."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, UnicodeDecodeError):
        return
    module = ".".join(path.relative_to(root).with_suffix("").parts)
    nodes: list[tuple[str, ast.AST]] = [(module, tree)]
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            nodes.append((f"{module}.{node.name}", node))
    for name, node in nodes:
        doc = ast.get_docstring(node)  # type: ignore[arg-type]
        if doc and len(doc) >= MIN_DOC_CHARS:
            yield name, doc


def documents(max_documents: int) -> Iterator[tuple[str, str]]:
    count = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escape sequences in old sources
        for root in source_roots():
            for path in python_files(root):
                for name, doc in docstrings(path, root):
                    yield name, doc
                    count += 1
                    if count >= max_documents:
                        return


def day_of(doc_id: str, days: list[dt.date]) -> dt.date:
    return days[int(hashlib.sha256(doc_id.encode()).hexdigest()[:8], 16) % len(days)]


def build_partitions(days: list[dt.date], max_documents: int) -> dict[dt.date, list[dict[str, Any]]]:
    by_day: dict[dt.date, list[dict[str, Any]]] = {day: [] for day in days}
    progress = Progress("seed", max_documents, "docs")
    for name, doc in documents(max_documents):
        doc_id = hashlib.sha1(f"{name}\0{doc}".encode()).hexdigest()[:20]
        day = day_of(doc_id, days)
        created = dt.datetime.combine(day, dt.time(), dt.UTC) + dt.timedelta(
            seconds=int(doc_id[:6], 16) % 86400
        )
        by_day[day].append(
            {"id": doc_id, "text": doc, "source": f"python-docstring:{name}", "created_at": created.isoformat()}
        )
        progress.update(1)
    return by_day


def main(args: argparse.Namespace) -> dict[str, Any]:
    params = step_params("seed", args.overrides)
    output = args.output or params["output"]
    end = dt.date.fromisoformat(args.end_date or params["end_date"])
    days = records.interval_days(end + dt.timedelta(days=1), int(params["days"]))
    existing = [day for day in days if storage.exists(storage.join(records.partition_uri(output, day), storage.SUCCESS_MARKER))]
    if len(existing) == len(days):
        log.info("all %d partitions exist under %s: raw data is immutable, nothing written", len(days), output)
        return {"output_uri": output, "days": [d.isoformat() for d in days], "written": 0}
    by_day = build_partitions(days, int(params["max_documents"]))
    written = 0
    for day in days:
        if day in existing:
            continue
        with storage.staged_output(records.partition_uri(output, day)) as scratch:
            lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in by_day[day])
            (scratch / "part-00000.jsonl").write_text(lines, encoding="utf-8")
        written += len(by_day[day])
    log.info("seeded %d documents into %d partitions under %s", written, len(days) - len(existing), output)
    return {"output_uri": output, "days": [d.isoformat() for d in days], "written": written}


def parser() -> argparse.ArgumentParser:
    p = step_parser("seed", __doc__.splitlines()[0])
    p.add_argument("--output", help="raw data URI (default: seed.output in params.yaml)")
    p.add_argument("--end-date", help="last partition date, YYYY-MM-DD (default: seed.end_date)")
    return p


if __name__ == "__main__":
    run_step(parser(), main)
