"""Training throughput, side by side in one run, on the same model (params.yaml train preset)
and the same tokenized data:

  (a) a plain single-process PyTorch loop (model + AdamW + random windows, nothing else)
  (b) the train step, 1 process (`python -m tasks.train --set engine=single`)
  (b') the same with synchronous checkpoints (`train.async_checkpoint: false`)
  (c) the train step, 2 local nodes with FSDP2 (two torchrun agents, gloo, 1 thread each)
  (d) the train step, 1 process, with `train.compile` (torch.compile of each block, inductor)

    .venvs/runtime/bin/python benchmarks/train.py [--steps 60] [--documents 6000]

Both the plain loop and the steps are timed from their first step (warm-up included: the step
cannot skip it). The steps also evaluate and checkpoint (every steps/3) and log: "same work" is
their rate with the evaluation and the checkpoint stalls taken out, i.e. the plain loop's work.
Per checkpoint: the loop's stall and the time until the checkpoint was complete, and the stall as
a share of the time between two checkpoints at the default cadence (train.checkpoint_every).
"steady" is the median of the step's logged windows after its first (which holds torch.compile's
compilation, when on).
MFU: model FLOPs per token (6N + attention) x tokens/s per process, against the peak a matmul
probe measures in that process (a GPU: its bf16 data-sheet peak).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tasks import seed  # noqa: E402
from tasks.lib import parallel, records  # noqa: E402
from tasks.lib.data import BatchSampler, open_split  # noqa: E402
from tasks.lib.model import GPT  # noqa: E402
from tasks.lib.params import step_params  # noqa: E402
from tasks.train import build_optimizer, loss_fn, model_config  # noqa: E402

BIN = Path(sys.executable).parent


def step(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**os.environ, "MLFLOW_TRACKING_URI": "", **(env or {})}, check=True)


def result_of(text: str) -> dict[str, Any]:
    line = next(x for x in reversed(text.splitlines()) if " result {" in x)
    loaded: dict[str, Any] = json.loads(line.split(" result ", 1)[1])
    windows = [float(rate) for rate in re.findall(r" ([0-9.]+) tok/s ", text)][1:]
    loaded["steady_tokens_per_s"] = float(np.median(windows)) if windows else loaded["tokens_per_s"]
    return loaded


def build_dataset(root: Path, documents: int) -> Path:
    raw = ({"id": str(i), "text": d, "source": n, "created_at": "2026-11-01T00:00:00"}
           for i, (n, d) in enumerate(seed.documents(documents)))
    snapshot = root / "snapshot.jsonl"
    snapshot.write_text("".join(json.dumps(r) + "\n" for r in records.normalize_and_dedup(raw).records))
    step("tasks.tokenize", "prepare", "--snapshot", str(snapshot), "--output", str(root / "tok"),
         "--set", f"tokenizer_store={root / 'store'}")
    tok = str(root / "tok" / "tokenizer.json")
    step("tasks.tokenize", "encode", "--snapshot", str(snapshot), "--tokenizer", tok, "--shard-index", "0",
         "--num-shards", "1", "--output", str(root / "shards" / "00000"))
    step("tasks.tokenize", "merge", "--snapshot", str(snapshot), "--tokenizer", tok, "--num-shards", "1",
         "--shards", str(root / "shards"), "--output", str(root / "dataset"))
    return root / "dataset"


def plain_loop(dataset: Path, steps: int, params: dict[str, Any], micro_batch: int) -> tuple[float, float]:
    """Tokens/s of the plain loop and its model FLOPs utilization against this process's matmul peak."""
    split = open_split(dataset, "train")
    config = model_config(params, split.vocab_size)
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = build_optimizer(model, params)
    sampler = BatchSampler(split.tokens, config.seq_len, micro_batch, 0)
    started = time.perf_counter()
    for i in range(steps):
        x, y = sampler.batch(i * micro_batch, 0, 1)
        loss_fn(model, x, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    rate = steps * micro_batch * config.seq_len / (time.perf_counter() - started)
    peak, _ = parallel.peak_flops(torch.device("cpu"))
    return rate, rate * config.flops_per_token() / peak


def train_step(dataset: Path, out: Path, nodes: int, steps: int, micro_batch: int, *extra: str) -> dict[str, Any]:
    args = ["--dataset", str(dataset), "--checkpoints", str(out / "ckpt"), "--output", str(out / "model"),
            "--set", f"max_steps={steps}", "--set", f"micro_batch={micro_batch}", "--set", "log_every=5",
            "--set", f"checkpoint_every={max(steps // 3, 1)}", "--set", f"eval_every={max(steps // 3, 1)}", *extra]
    if nodes == 1:
        return result_of(step("tasks.train", *args, "--set", "engine=single").stderr)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "MLFLOW_TRACKING_URI": "", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nodes))}
    procs = [subprocess.Popen([str(BIN / "python"), "-m", "tasks.lib.torchrun", f"--nnodes={nodes}", "--nproc-per-node=1", "--rdzv-backend=c10d",
                               f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=bench-{port}", "-m", "tasks.train", *args],
                              cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(nodes)]
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(outputs[0][-3000:])
    return result_of(outputs[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--documents", type=int, default=6000)
    args = parser.parse_args()
    params = step_params("train")
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        root = Path(tmp)
        dataset = build_dataset(root, args.documents)
        micro = int(params["micro_batch"])
        nodes = int(params["nodes"])
        # same global batch everywhere: the 1-process variants take all of it
        plain, plain_mfu = plain_loop(dataset, args.steps, params, micro * nodes)
        rows = {
            "(b) train step, 1 process": train_step(dataset, root / "single", 1, args.steps, micro * nodes),
            "(b') the same, sync checkpoints": train_step(dataset, root / "sync", 1, args.steps, micro * nodes,
                                                          "--set", "async_checkpoint=false"),
            f"(c) train step, {nodes} nodes FSDP2": train_step(dataset, root / "multi", nodes, args.steps, micro),
            "(d) train step, 1 process, compile": train_step(dataset, root / "compiled", 1, args.steps, micro * nodes,
                                                             "--set", "compile=true"),
        }
        tokens = int(np.load(dataset / "train.offsets.npy")[-1])
    cadence, seq_len = int(params["checkpoint_every"]), int(params["presets"][params["preset"]]["seq_len"])
    print(f"\npreset {params['preset']}, {tokens:,} train tokens, global batch {micro * nodes} x seq, "
          f"{args.steps} steps, {os.cpu_count()} CPUs; checkpoint stall share at the default cadence of {cadence} steps")
    print(f"{'variant':<36}{'tokens/s':>9}{'ratio':>7}{'same work':>10}{'steady':>8}{'MFU %':>7}{'data %':>7}"
          f"{'eval %':>7}{'ckpt %':>7}{'stall ms':>9}{'save ms':>8}{'@cadence %':>11}")
    print(f"{'(a) plain PyTorch loop, 1 process':<36}{plain:>9,.0f}{1.0:>7.2f}{1.0:>10.2f}{'':>8}{100 * plain_mfu:>7.1f}")
    for name, r in rows.items():
        same_work = r["tokens_per_s"] / (1 - r["eval_share"] - r["checkpoint_share"])
        step_seconds = micro * nodes * seq_len / r["tokens_per_s"]
        at_cadence = r["checkpoint_stall_s"] / (cadence * step_seconds)
        print(f"{name:<36}{r['tokens_per_s']:>9,.0f}{r['tokens_per_s'] / plain:>7.2f}{same_work / plain:>10.2f}"
              f"{r['steady_tokens_per_s']:>8,.0f}{100 * r['mfu']:>7.1f}{100 * r['data_loading_share']:>7.1f}"
              f"{100 * r['eval_share']:>7.1f}{100 * r['checkpoint_share']:>7.1f}{1000 * r['checkpoint_stall_s']:>9.0f}"
              f"{1000 * r['checkpoint_save_s']:>8.0f}{100 * at_cadence:>11.2f}")
    print(f"MFU: model FLOPs (6N + attention per token) against each process's peak: {next(iter(rows.values()))['peak_source']}")


if __name__ == "__main__":
    main()
