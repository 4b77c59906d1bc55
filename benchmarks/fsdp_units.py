"""How FSDP2's layout costs on CPUs: the bare 2-rank training step (forward, backward, gradient
clipping, AdamW; random tokens, no data, evaluation, checkpoints or logging) of the preset's
model, against a plain one-process loop given every core, side by side, rounds interleaved, with
rank 0's median forward, backward and optimizer-step times (where a layout's collectives land):

  plain     one process, every core (the baseline)
  apart     2 ranks of one core each, no collective at all: the ceiling of any 2-rank layout
  apart, synced  the same with a one-number all-reduce after each step: what waiting for the
            slower rank costs by itself, without moving the weights and gradients
  ddp       DistributedDataParallel (one bucketed all-reduce)
  one unit  FSDP2, the whole model one unit: one all-gather and one reduce-scatter a step
            (the CPU default, tasks.train.engines.per_block_units)
  per block FSDP2, a unit per block and the root, weights kept for the backward (torchtitan's
            layout; the GPU default)
  one unit, AdamW loop   the one-unit layout with PyTorch's per-parameter AdamW loop instead
            of foreach (CPU's default before train.build_optimizer asked for foreach)

    .venvs/runtime/bin/python benchmarks/fsdp_units.py [--preset cpu-small] [--rounds 3]

Every process runs on the torchrun agent's allocator (tcmalloc where installed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tasks.config import SettingsError, load  # noqa: E402
from tasks.lib import parallel  # noqa: E402
from tasks.lib.model import GPT  # noqa: E402
from tasks.lib.torchrun import preload_allocator  # noqa: E402
from tasks.train.engines import Engine, shard  # noqa: E402
from tasks.train.trainer import build_optimizer, loss_fn, model_config  # noqa: E402

VARIANTS = ("plain", "apart", "apart, synced", "ddp", "one unit", "per block", "one unit, AdamW loop")
RANKS = 2  # the ranks of every distributed layout (train.nodes of the demo); each gets cpu_count // RANKS threads
RUN_TIMEOUT_S = 600
VOCAB = load().tokenize.vocab_size  # the size of the pipeline's trained tokenizer


def layout(model: torch.nn.Module, variant: str) -> torch.nn.Module:
    if variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if variant in ("one unit", "per block", "one unit, AdamW loop"):
        kept = [False] * len(model.blocks)  # type: ignore[arg-type]
        return shard(model, kept, variant == "per block", torch.device("cpu"))  # fp32 weights on CPUs
    return model  # plain, apart


def worker(variant: str, preset: str, micro_batch: int, steps: int, warmup: int) -> None:
    """One process of ``variant``; rank 0 prints the tokens/s of all ranks together."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rate, phases_ms = timed_steps(variant, preset, micro_batch, steps, warmup, world)
    if world == 1 or dist.get_rank() == 0:
        print(json.dumps({"tokens_per_s": rate, "phases_ms": phases_ms}), flush=True)
    if world > 1:  # after the model is gone: a DDP reducer freed after the group deadlocks in gloo's destructor
        dist.destroy_process_group()


def timed_steps(variant: str, preset: str, micro_batch: int, steps: int, warmup: int,
                world: int) -> tuple[float, list[float]]:
    """Tokens/s of all ranks over ``steps`` steps after ``warmup``, timed by the slowest rank, and
    this rank's median forward, backward and optimizer-step milliseconds."""
    rank = dist.get_rank() if world > 1 else 0
    params = load(section="train", overrides=[f"preset={preset}"]).train
    config = model_config(params, VOCAB)
    torch.manual_seed(0)
    model = layout(GPT(config), variant)
    optimizer = build_optimizer(model, params)
    if variant.endswith("AdamW loop"):
        for group in optimizer.param_groups:
            group["foreach"] = False
    # the trainer's optimizer step (clipping, the update): the plain engine over the laid-out model
    engine = Engine(model, params, parallel.Dist(rank, world, 0, torch.device("cpu")), lambda _: optimizer)
    tokens = torch.Generator().manual_seed(rank)
    phases: list[tuple[float, float, float]] = []
    for i in range(warmup + steps):
        if i == warmup:
            started = time.perf_counter()
        batch = torch.randint(0, VOCAB, (micro_batch, config.seq_len + 1), generator=tokens)
        begun = time.perf_counter()
        loss = loss_fn(model, batch[:, :-1], batch[:, 1:])
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        engine.step(params.grad_clip)
        if variant == "apart, synced":  # timed with the optimizer step: its third phase holds the wait
            dist.all_reduce(torch.zeros(1))
        if i >= warmup:
            phases.append((forward - begun, backward - forward, time.perf_counter() - backward))
    elapsed = torch.tensor(time.perf_counter() - started)
    if world > 1:
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    phases_ms = [1000 * statistics.median(phase) for phase in zip(*phases, strict=True)]
    return steps * micro_batch * config.seq_len * world / float(elapsed), phases_ms


def measure(variant: str, preset: str, micro_batch: int, steps: int, warmup: int,
            env: dict[str, str]) -> dict[str, Any]:
    """Tokens/s and rank 0's phase times of one run of ``variant``: ``RANKS`` ranks sharing the
    cores, or one process of every core."""
    cores = os.cpu_count() or 2
    own = [__file__, "--worker", variant, "--preset", preset, "--steps", str(steps), "--warmup", str(warmup)]
    if variant == "plain":
        command = [sys.executable, *own, "--micro-batch", str(RANKS * micro_batch)]
        threads = cores
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}",
                   *own, "--micro-batch", str(micro_batch)]
        threads = max(1, cores // RANKS)
    try:
        done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                              env={**env, "OMP_NUM_THREADS": str(threads)})
    except subprocess.TimeoutExpired:  # a hung collective must not hang the benchmark
        raise SystemExit(f"{variant} did not finish in {RUN_TIMEOUT_S} s: run the benchmark again") from None
    if done.returncode:
        raise SystemExit(f"{variant} exited {done.returncode}:\n{done.stderr[-3000:]}")
    measured: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--preset", help="a train.presets name (default: params.yaml's train.preset)")
    parser.add_argument("--micro-batch", type=int, help="sequences per rank (default: train.micro_batch)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    try:
        params = load(section="train", overrides=[f"preset={args.preset}"] if args.preset else []).train
    except SettingsError as exc:
        raise SystemExit(f"--preset: {exc}") from None
    preset, micro = params.preset, args.micro_batch or params.micro_batch
    if args.worker:
        worker(args.worker, preset, micro, args.steps, args.warmup)
        return
    env = dict(os.environ)
    preload_allocator(env, on_gpu=False)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            runs[variant].append(measure(variant, preset, micro, args.steps, args.warmup, env))
    plain = statistics.median(r["tokens_per_s"] for r in runs["plain"])
    print(f"\npreset {preset}, global batch {RANKS * micro} x {params.model.seq_len}, {args.steps} steps "
          f"after {args.warmup}, {os.cpu_count()} CPUs, medians of {args.rounds} interleaved rounds")
    print(f"{'variant':<24}{'tokens/s':>10}{'ratio':>7}{'fwd ms':>8}{'bwd ms':>8}{'opt ms':>8}  {'each round':<30}")
    for variant, measured in runs.items():
        median = statistics.median(r["tokens_per_s"] for r in measured)
        phases = [statistics.median(phase) for phase in zip(*(r["phases_ms"] for r in measured), strict=True)]
        each = ", ".join(f"{r['tokens_per_s']:,.0f}" for r in measured)
        print(f"{variant:<24}{median:>10,.0f}{median / plain:>7.2f}{phases[0]:>8.1f}{phases[1]:>8.1f}{phases[2]:>8.1f}"
              f"  {each}")


if __name__ == "__main__":
    main()
