"""What drawing one token costs the engine: its sampler (:func:`sample`: a partition and a sort of
the few logits that can be drawn) against the one it replaced (a float64 softmax, a stable
argsort of every candidate for top-p, ``rng.choice``), side by side in one run, rounds
interleaved (each sampler first in every other round), medians of per-token microseconds.

    .venvs/runtime/bin/python benchmarks/sampling.py [--vocab 8192 32000 128256] [--rounds 7] [--calls 20]

The vocabularies: the presets' (``params.yaml``'s ``tokenize.vocab_size``) and base checkpoints'
(Llama 2 and Mistral 32,000, Llama 3 128,256). The settings: greedy, top-k 50, top-p 0.9, at
temperature 1, on float32 logits of three made-up shapes (the table says how many tokens each
0.9 nucleus holds): peaked (16 plausible tokens far above a normal tail, a confident model: a
nucleus of a few), broad (a wide normal: a few percent of the vocabulary) and flat (a narrow
normal, a random-weight model's: most of it, the worst case for both).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402
import yaml  # noqa: E402

from tasks.serving.triton_models.llm_generate.engine import SamplingParams, nucleus, sample  # noqa: E402

BASE_VOCABS = (32000, 128256)
ROWS = 8  # distinct logit rows a measurement cycles through
SHAPES = ("peaked", "broad", "flat")
CASES = {  # name: (logit shape, sampling)
    "greedy": ("peaked", SamplingParams(1)),
    "top-k 50": ("peaked", SamplingParams(1, temperature=1.0, top_k=50)),
    "top-p 0.9, peaked": ("peaked", SamplingParams(1, temperature=1.0, top_p=0.9)),
    "top-p 0.9, broad": ("broad", SamplingParams(1, temperature=1.0, top_p=0.9)),
    "top-p 0.9, flat": ("flat", SamplingParams(1, temperature=1.0, top_p=0.9)),
}
Sampler = Callable[[np.ndarray[Any, Any], SamplingParams, np.random.Generator], int]


def full_sort_sample(logits: np.ndarray[Any, Any], params: SamplingParams, rng: np.random.Generator) -> int:
    """The engine's sampler until 2026-11-27, kept here as the baseline."""
    if params.greedy:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / params.temperature
    candidates = np.arange(scaled.shape[0])
    if 0 < params.top_k < scaled.shape[0]:
        candidates = np.argpartition(scaled, -params.top_k)[-params.top_k:]
    weights = np.exp(scaled[candidates] - scaled[candidates].max())
    weights /= weights.sum()
    if params.top_p < 1.0:
        order = np.argsort(-weights, kind="stable")
        keep = int(np.searchsorted(np.cumsum(weights[order]), params.top_p) + 1)
        candidates, weights = candidates[order[:keep]], weights[order[:keep]]
        weights /= weights.sum()
    return int(candidates[rng.choice(len(candidates), p=weights)])


SAMPLERS: dict[str, Sampler] = {"full sort (before)": full_sort_sample, "engine": sample}


def logit_rows(shape: str, vocab: int, seed: int) -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(ROWS):
        row = rng.normal(0.0, {"peaked": 1.0, "broad": 3.0, "flat": 0.5}[shape], vocab)
        if shape == "peaked":
            row[rng.choice(vocab, 16, replace=False)] = rng.uniform(10.0, 18.0, 16)
        rows.append(row.astype(np.float32))
    return rows


def per_token_us(sampler: Sampler, rows: list[np.ndarray[Any, Any]], params: SamplingParams, calls: int) -> float:
    rng = np.random.default_rng(0)
    started = time.perf_counter()
    for i in range(calls):
        sampler(rows[i % len(rows)], params, rng)
    return (time.perf_counter() - started) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    presets = int(yaml.safe_load((REPO_ROOT / "params.yaml").read_text())["tokenize"]["vocab_size"])
    parser.add_argument("--vocab", nargs="+", type=int, default=[presets, *BASE_VOCABS])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (the median is shown)")
    parser.add_argument("--calls", type=int, default=20, help="tokens drawn per measurement")
    args = parser.parse_args()

    rows = {(shape, vocab): logit_rows(shape, vocab, vocab) for shape in SHAPES for vocab in args.vocab}
    timings: dict[tuple[int, str, str], list[float]] = {}
    for round_ in range(args.rounds):
        for vocab in args.vocab:
            for case, (shape, params) in CASES.items():
                for name, sampler in list(SAMPLERS.items())[::1 if round_ % 2 else -1]:  # each goes first half the time
                    timings.setdefault((vocab, case, name), []).append(
                        per_token_us(sampler, rows[shape, vocab], params, args.calls))
    print("| vocabulary | sampling | tokens drawn from (median) | full sort (before), us/token | engine, us/token "
          "| before / engine |\n|---|---|---|---|---|---|")
    for vocab in args.vocab:
        for case, (shape, params) in CASES.items():
            before, after = (statistics.median(timings[vocab, case, name]) for name in SAMPLERS)
            drawn = "1" if params.greedy else f"{statistics.median(len(nucleus(r, params).cumulative) for r in rows[shape, vocab]):.0f}"
            print(f"| {vocab:,} | {case} | {drawn} | {before:,.0f} | {after:,.0f} | {before / after:.1f}x |")


if __name__ == "__main__":
    main()
