"""Write demo raw data: date partitions of real text from the installed software.

The local demo needs no network, so its corpus is the docstrings of the Python standard
library and of the packages installed in the runtime environment, read with ``ast`` (nothing is
imported). One document in ``heldout_every`` (by id hash) never enters a partition: it goes to
the held-out evaluation text, written once, which every evaluation reuses. Files are visited in sorted order and each document lands on a date chosen by the
hash of its id, so the output is deterministic for a given environment. Days after
``seed.end_date`` (the daily landing of llm_ingest) draw on the corpus further on: each block of
``seed.days`` days after it gets the next ``max_documents`` documents, so a new day holds new text,
as a real day would (not the same documents again, which validation refuses as repeats), for as
long as the installed software has docstrings. Existing partitions are never rewritten (raw data
is immutable); a second run only reports them.

``--drifted-share S``: a share S of the documents of the days this run writes (by id) lands in the
drifted domain instead, transliterated to Cyrillic letters as the demo's drifted traffic is
(``stack traffic drifted``): the new data a drift-started retrain learns from (``make drift-loop``).
"""

from __future__ import annotations

import argparse
import ast
import collections
import datetime as dt
import hashlib
import json
import sysconfig
import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from tasks.lib import records, storage
from tasks.lib.params import load_settings
from tasks.lib.step import Progress, log, run_step, step_parser
from tasks.results import SeedResult

MIN_DOC_CHARS = 80
STATEMENT_HOLDERS = (ast.stmt, ast.excepthandler, ast.match_case)
HELDOUT_FILE = "eval.jsonl"
# the demo's other domain: the same text in Cyrillic letters (other characters, other bytes, tokens
# the vocabulary never merged), for the drifted traffic (stack/traffic.py) and the data that answers it
CYRILLIC = dict(zip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
                    "абцдефгхийклмнопярстуввхызАБЦДЕФГХИЙКЛМНОПЯРСТУВВХЫЗ", strict=True))
DRIFTED_SOURCE = "drifted:"  # a drifted document's source: its original's, after this


def transliterate(text: str) -> str:
    """``text`` in the demo's drifted domain: Latin letters as Cyrillic ones."""
    return "".join(CYRILLIC.get(c, c) for c in text)


def drifted(rows: list[dict[str, Any]], share: float) -> list[dict[str, Any]]:
    """``rows`` with a ``share`` of them (by id) in the drifted domain."""
    return [{**row, "text": transliterate(row["text"]), "source": DRIFTED_SOURCE + row["source"]}
            if int(row["id"][12:18], 16) < share * 0x1000000 else row for row in rows]


def source_roots() -> list[Path]:
    paths = sysconfig.get_paths()
    return [Path(paths["stdlib"]), Path(paths["purelib"])]


def python_files(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*.py")):
        parts = set(path.parts)
        if parts & {"test", "tests", "__pycache__", "idle_test"}:
            continue
        yield path


def statements(tree: ast.AST) -> Iterator[ast.AST]:
    """The nodes of ``tree`` that can hold a definition, in ``ast.walk``'s order (breadth first,
    children in field order): a class or function is a statement, and statements are found only
    in the statement lists of statements, exception handlers and match cases, so the expressions
    (most of a tree's nodes) need not be visited. The corpus's order stays ``ast.walk``'s."""
    queue = collections.deque([tree])
    while queue:
        node = queue.popleft()
        yield node
        for field in node._fields:
            value = getattr(node, field, None)
            if isinstance(value, list):
                queue.extend(child for child in value if isinstance(child, STATEMENT_HOLDERS))


def docstrings(path: Path, root: Path) -> Iterator[tuple[str, str]]:
    """(qualified name, docstring) of a module and its classes and functions."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, UnicodeDecodeError):
        return
    module = ".".join(path.relative_to(root).with_suffix("").parts)
    nodes: list[tuple[str, ast.AST]] = [(module, tree)]
    for node in statements(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            nodes.append((f"{module}.{node.name}", node))
    for name, node in nodes:
        doc = ast.get_docstring(node)  # type: ignore[arg-type]
        if doc and len(doc) >= MIN_DOC_CHARS:
            yield name, doc


def documents(max_documents: int, skip: int = 0) -> Iterator[tuple[str, str]]:
    """The corpus in its (sorted) order: documents ``skip`` to ``max_documents`` (exclusive)."""
    count = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escape sequences in old sources
        for root in source_roots():
            for path in python_files(root):
                for name, doc in docstrings(path, root):
                    if count >= skip:
                        yield name, doc
                    count += 1
                    if count >= max_documents:
                        return


def day_of(doc_id: str, days: list[dt.date]) -> dt.date:
    return days[int(hashlib.sha256(doc_id.encode()).hexdigest()[:8], 16) % len(days)]


def is_heldout(doc_id: str, every: int) -> bool:
    return int(doc_id[6:12], 16) % every == 0


def build_partitions(
    days: list[dt.date], max_documents: int, heldout_every: int, block: int = 0
) -> tuple[dict[dt.date, list[dict[str, Any]]], list[dict[str, Any]]]:
    """Documents by day, and the held-out ones (never in any partition: the evaluation set);
    ``block`` N > 0: the corpus's N-th ``max_documents`` documents instead of its first."""
    by_day: dict[dt.date, list[dict[str, Any]]] = {day: [] for day in days}
    heldout: list[dict[str, Any]] = []
    progress = Progress("seed", max_documents, "docs")
    for name, doc in documents((block + 1) * max_documents, skip=block * max_documents):
        doc_id = hashlib.sha1(f"{name}\0{doc}".encode()).hexdigest()[:20]
        progress.update(1)
        if is_heldout(doc_id, heldout_every):
            heldout.append({"id": doc_id, "text": doc, "source": f"python-docstring:{name}"})
            continue
        day = day_of(doc_id, days)
        created = dt.datetime.combine(day, dt.time(), dt.UTC) + dt.timedelta(
            seconds=int(doc_id[:6], 16) % 86400
        )
        by_day[day].append(
            {"id": doc_id, "text": doc, "source": f"python-docstring:{name}", "created_at": created.isoformat()}
        )
    return by_day, heldout


def block_of(day: dt.date, anchor: dt.date, days: int) -> int:
    """0 up to ``anchor`` (the seed's window, and any day before it); then 1, 2, ... per ``days`` days."""
    return 0 if day <= anchor else ((day - anchor).days - 1) // days + 1


def block_days(block: int, anchor: dt.date, days: int) -> list[dt.date]:
    first = anchor + dt.timedelta(days=(block - 1) * days + 1)
    return [first + dt.timedelta(days=i) for i in range(days)]


def write_jsonl(uri: str, name: str, rows: list[dict[str, Any]]) -> None:
    with storage.staged_output(uri) as scratch:
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        (scratch / name).write_text(lines, encoding="utf-8")


def main(args: argparse.Namespace) -> SeedResult:
    params = load_settings("seed", args.overrides).seed
    output = args.output or params.output
    end = dt.date.fromisoformat(args.end_date or params.end_date)
    days = records.interval_days(end + dt.timedelta(days=1), params.days)
    heldout_uri = args.heldout_output or params.heldout_output
    existing = [day for day in days if storage.exists(storage.join(records.partition_uri(output, day), storage.SUCCESS_MARKER))]
    heldout_exists = storage.exists(storage.join(heldout_uri, storage.SUCCESS_MARKER))
    result = SeedResult(output_uri=output, days=tuple(d.isoformat() for d in days),
                        heldout_uri=storage.join(heldout_uri, HELDOUT_FILE), written=0)
    if len(existing) == len(days) and heldout_exists:
        log.info("all %d partitions and the held-out set exist: raw data is immutable, nothing written", len(days))
        return result
    anchor = dt.date.fromisoformat(params.end_date)
    blocks = {block_of(day, anchor, params.days) for day in days if day not in existing} | (set() if heldout_exists else {0})
    by_day: dict[dt.date, list[dict[str, Any]]] = {day: [] for day in days}
    heldout: list[dict[str, Any]] = []
    for block in sorted(blocks):
        # the first documents over the window's days up to the anchor (the seed's own window); a
        # later block's over its own days
        spread = ([d for d in days if d <= anchor] or records.interval_days(anchor + dt.timedelta(days=1), params.days)
                  ) if block == 0 else block_days(block, anchor, params.days)
        found, held = build_partitions(spread, params.max_documents, params.heldout_every, block)
        by_day.update({day: rows for day, rows in found.items() if day in by_day})
        heldout = held if block == 0 else heldout
    written = in_drift = 0
    for day in days:
        if day not in existing:
            if not by_day[day]:
                log.warning("%s: no documents left in the installed software's docstrings for this day", day)
            rows = drifted(by_day[day], args.drifted_share)
            write_jsonl(records.partition_uri(output, day), "part-00000.jsonl", rows)
            written += len(rows)
            in_drift += sum(row["source"].startswith(DRIFTED_SOURCE) for row in rows)
    if not heldout_exists:
        write_jsonl(heldout_uri, HELDOUT_FILE, heldout)
    log.info("seeded %d documents (%d in the drifted domain) into %d partitions under %s; %d held out for "
             "evaluation at %s", written, in_drift, len(days) - len(existing), output, len(heldout), heldout_uri)
    return replace(result, written=written, drifted=in_drift)


def share(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: a share is between 0 and 1")
    return value


def parser() -> argparse.ArgumentParser:
    p = step_parser("seed", __doc__.splitlines()[0])
    p.add_argument("--output", help="raw data URI (default: seed.output in params.yaml)")
    p.add_argument("--end-date", help="last partition date, YYYY-MM-DD (default: seed.end_date)")
    p.add_argument("--heldout-output", help="URI of the held-out evaluation text (default: seed.heldout_output)")
    p.add_argument("--drifted-share", type=share, default=0.0,
                   help="share of the documents written now that land in the drifted domain (0..1; default 0)")
    return p


if __name__ == "__main__":
    run_step(parser(), main)
