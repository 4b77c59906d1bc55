"""Tokenization throughput: the distributed step with 1 and 2 workers beside a plain
single-process ``tokenizers`` ``encode_batch`` baseline on the same text, measured in one run.

    .venvs/runtime/bin/python benchmarks/tokenization.py [--documents 12000] [--repeats 3]

Works on local files (no servers), so it measures tokenization, not S3. Reported per variant:
tokens/s of the encode work itself (what the step logs) and of the whole step wall clock
(process start-up, tokenizer load, snapshot read, merge included), each as a ratio to the
baseline. Best of ``--repeats``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

import argparse
import json
import subprocess
import tempfile
import time
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tasks import seed  # noqa: E402
from tasks.lib import records, tokens  # noqa: E402


def make_snapshot(path: Path, documents: int) -> list[str]:
    raw = (
        {"id": str(i), "text": doc, "source": name, "created_at": "2026-11-01T00:00:00"}
        for i, (name, doc) in enumerate(seed.documents(documents))
    )
    kept = records.normalize_and_dedup(raw).records
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return [r["text"] for r in kept]


def baseline(tokenizer_file: Path, texts: list[str]) -> tuple[float, int]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    started = time.perf_counter()
    total = sum(len(e.ids) + 1 for e in tokenizer.encode_batch(texts, add_special_tokens=False))  # +1: EOS
    return time.perf_counter() - started, total


def run(*args: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "tasks.tokenize", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, check=True)
    line = next(x for x in reversed(proc.stderr.splitlines()) if " result {" in x)
    loaded: dict[str, Any] = json.loads(line.split(" result ", 1)[1])
    return loaded


def distributed(snapshot: Path, tokenizer_file: Path, workers: int, out: Path) -> tuple[float, float, int]:
    """(wall seconds of the whole step, slowest worker's encode seconds, tokens)."""
    started = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tasks.tokenize", "encode", "--snapshot", str(snapshot),
             "--tokenizer", str(tokenizer_file), "--shard-index", str(i), "--num-shards", str(workers),
             "--output", str(out / "shards" / f"{i:05d}")],
            cwd=REPO_ROOT, stderr=subprocess.DEVNULL,
        )
        for i in range(workers)
    ]
    if any(p.wait() != 0 for p in procs):
        raise SystemExit("an encode worker failed")
    merged = run("merge", "--snapshot", str(snapshot), "--tokenizer", str(tokenizer_file),
                 "--num-shards", str(workers), "--shards", str(out / "shards"), "--output", str(out / "dataset"))
    wall = time.perf_counter() - started
    busiest = max(json.loads((out / "shards" / f"{i:05d}" / "stats.json").read_text())["seconds"]
                  for i in range(workers))
    total = sum(merged["tokens"].values())
    return wall, busiest, int(total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=12000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-tokenize-") as tmp:
        root = Path(tmp)
        snapshot = root / "snapshot.jsonl"
        texts = make_snapshot(snapshot, args.documents)
        tokenizer_file = root / "tokenizer.json"
        tokenizer_file.write_text(tokens.train_tokenizer(texts, 8192, len(texts)).to_str())
        mb = snapshot.stat().st_size / 1e6

        base_s, base_tokens = min(baseline(tokenizer_file, texts) for _ in range(args.repeats))
        base_rate = base_tokens / base_s
        rows = [("encode_batch, 1 process (baseline)", base_rate, base_rate, base_tokens)]
        for workers in (1, 2):
            best = min(distributed(snapshot, tokenizer_file, workers, root / f"w{workers}-{r}")
                       for r in range(args.repeats))
            wall, busiest, total = best
            assert total == base_tokens, f"{workers} workers: {total} tokens, baseline {base_tokens}"
            rows.append((f"tokenize step, {workers} worker(s)", total / busiest, total / wall, total))

    print(f"\n{len(texts)} documents, {mb:.1f} MB, {base_tokens:,} tokens, {os.cpu_count()} CPUs, best of {args.repeats}")
    print(f"{'variant':<38}{'encode tok/s':>14}{'ratio':>8}{'step wall tok/s':>18}{'ratio':>8}")
    for name, encode_rate, wall_rate, _ in rows:
        print(f"{name:<38}{encode_rate:>14,.0f}{encode_rate / base_rate:>8.2f}{wall_rate:>18,.0f}{wall_rate / base_rate:>8.2f}")


if __name__ == "__main__":
    main()
