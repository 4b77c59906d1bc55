"""The corpus importer on a large file: throughput and peak memory.

    .venvs/runtime/bin/python benchmarks/ingest.py [--gigabytes 1] [--bad-share 0.01] [--to FOLDER]

Writes a JSON Lines corpus of ``--gigabytes`` (documents of 0.5-4 KB of real text: the installed
software's docstrings, repeated with a running number; timestamps spread over 14 days; a
``--bad-share`` of rows without text), then runs ``python -m tasks.ingest import`` on it as a
process of its own and reports rows/s, MB/s and the importer's own peak resident memory (VmHWM),
beside the file's size: bounded memory means the peak stays far below the file. The target is a
local folder (S3 uploads would measure the network): ``--to``, default a temporary one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tasks import seed  # noqa: E402


def write_corpus(path: Path, gigabytes: float, bad_share: float) -> int:
    """The corpus file; returns its rows."""
    texts = [doc for _, doc in seed.documents(4000) if 500 <= len(doc.encode()) <= 4000]
    target, written, rows = int(gigabytes * 1e9), 0, 0
    bad_every = round(1 / bad_share) if bad_share > 0 else 0
    with path.open("w", encoding="utf-8") as fh:
        while written < target:
            text = f"{texts[rows % len(texts)]}\n(copy {rows})"
            row = {"body": text, "ticket": f"t{rows}", "opened": f"2026-10-{1 + rows % 14:02d}T08:00:00Z"}
            if bad_every and rows % bad_every == 0:
                del row["body"]
            line = json.dumps(row, ensure_ascii=False) + "\n"
            fh.write(line)
            written += len(line.encode())
            rows += 1
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--bad-share", type=float, default=0.01)
    parser.add_argument("--to", type=Path, help="where the partitions go (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-ingest-", dir=os.environ.get("TMPDIR")) as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        started = time.monotonic()
        rows = write_corpus(corpus, args.gigabytes, args.bad_share)
        size_mb = corpus.stat().st_size / 1e6
        print(f"corpus: {rows:,} rows, {size_mb:,.0f} MB, written in {time.monotonic() - started:.0f} s", flush=True)
        to = args.to or Path(tmp) / "raw"
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "tasks.ingest", "import", str(corpus), "--to", str(to),
                               "--text-field", "body", "--id-field", "ticket", "--timestamp-field", "opened"],
                              cwd=REPO_ROOT, capture_output=True, text=True)
        seconds = time.monotonic() - started
        if proc.returncode != 0:
            raise SystemExit(f"the import failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        line = next(x for x in reversed(proc.stderr.splitlines()) if " result {" in x)
        result = json.loads(line.split(" result ", 1)[1])
    print("| corpus | rows | bad rows | days | wall s | rows/s | MB/s | peak RSS MB | peak RSS / file |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| JSON Lines, {size_mb:,.0f} MB | {result['rows']:,} | {result['bad']:,} | {len(result['days'])} | "
          f"{seconds:.0f} | {result['rows'] / seconds:,.0f} | {size_mb / seconds:.1f} | {result['peak_rss_mb']:.0f} | "
          f"{result['peak_rss_mb'] / size_mb:.3f} |")


if __name__ == "__main__":
    main()
