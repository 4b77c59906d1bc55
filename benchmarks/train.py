"""Training throughput, side by side in one run, on the same model (params.yaml train preset)
and the same tokenized data:

  (a) a plain single-process PyTorch loop (model + AdamW + random windows, nothing else; bf16
      autocast on a GPU, as the step)
  (a0) the same loop on glibc's malloc (CPUs: every other row runs on tcmalloc, the allocator
      the torchrun agent gives CPU training workers; this row shows what that is worth)
  (b) the train step, 1 process (`--set engine=single`, under one torchrun agent as the pipeline
      runs it)
  (b') the same with synchronous checkpoints (`train.async_checkpoint: false`)
  (c) the train step, 2 local nodes with FSDP2 (CPU: two torchrun agents, gloo, 1 thread each;
      GPU: one agent, a process per GPU, NCCL; needs train.nodes GPUs, else skipped)
  (c') the same with DDP (GPU only: FSDP2 vs DDP on the same GPUs)
  (c'') (c) with the other `train.reshard_after_forward` than auto's: weights freed after each
      block's forward on CPUs, kept for the backward on GPUs
  (d) the train step, 1 process, with `train.compile` (torch.compile of each block, inductor)
  (e) CPUs: the train step, 1 process, in bf16 autocast (`train.precision: bf16`; auto is fp32 on
      CPUs); (e') the same on 2 local nodes with FSDP2. Their MFU is against a bf16 matmul probe.

    .venvs/runtime/bin/python benchmarks/train.py [--steps 60] [--documents 6000]
    python benchmarks/train.py --preset gpu-125m --micro-batch 16 --steps 200   # on a GPU machine

Both the plain loop and the steps are timed from their first step (warm-up included: the step
cannot skip it). The steps also evaluate and checkpoint (every steps/3) and log: "same work" is
their rate with the evaluation and the checkpoint stalls taken out, i.e. the plain loop's work.
Per checkpoint: the loop's stall (median; "1st": the first save's, which also allocates the
staging buffers) and the time until the checkpoint was complete, and the median stall as a share
of the time between two checkpoints at the default cadence (train.checkpoint_every).
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
from tasks.config import SettingsError, TrainSettings, load  # noqa: E402
from tasks.contract import TORCHRUN_MODULE, Rendezvous, torchrun_args  # noqa: E402
from tasks.lib import parallel, records  # noqa: E402
from tasks.lib.data import BatchSampler, open_split  # noqa: E402
from tasks.lib.model import GPT  # noqa: E402
from tasks.lib.torchrun import malloc_in_use, preload_allocator  # noqa: E402
from tasks.train.meters import best_peak, matmul_probe, peak_flops  # noqa: E402
from tasks.train.trainer import build_optimizer, loss_fn, model_config  # noqa: E402

BIN = Path(sys.executable).parent


def step(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**os.environ, "MLFLOW_TRACKING_URI": "", **(env or {})})
    if done.returncode:
        raise SystemExit(f"{' '.join(args[:2])} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done


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


def plain_loop(dataset: Path, steps: int, params: TrainSettings, micro_batch: int) -> tuple[float, float]:
    """Tokens/s of the plain loop and its model FLOPs utilization against this process's peak."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    split = open_split(dataset, "train")
    config = model_config(params, split.vocab_size)
    torch.manual_seed(0)
    model = GPT(config).to(device)
    optimizer = build_optimizer(model, params)
    sampler = BatchSampler(split.tokens, config.seq_len, micro_batch, 0)
    peak_before = peak_flops(device)
    started = time.perf_counter()
    for i in range(steps):
        x, y = sampler.batch(i * micro_batch, 0, 1)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=parallel.use_bf16(device)):
            loss = loss_fn(model, x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    rate = steps * micro_batch * config.seq_len / (time.perf_counter() - started)
    peak, _ = best_peak(peak_before, peak_flops(device))
    return rate, rate * config.flops_per_token() / peak


def train_step(dataset: Path, out: Path, nodes: int, steps: int, micro_batch: int, *extra: str) -> dict[str, Any]:
    args = ["--dataset", str(dataset), "--checkpoints", str(out / "ckpt"), "--output", str(out / "model"),
            "--set", f"max_steps={steps}", "--set", f"micro_batch={micro_batch}", "--set", "log_every=5",
            "--set", f"checkpoint_every={max(steps // 3, 1)}", "--set", f"eval_every={max(steps // 3, 1)}", *extra]
    if nodes == 1:
        args = [*args, "--set", "engine=single"]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "MLFLOW_TRACKING_URI": "", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nodes))}
    # CPU: one agent per node, as on separate machines; GPU: one agent with a process per GPU
    # (two agents of one process each would both take cuda:0)
    agents, per_agent = (1, nodes) if torch.cuda.is_available() else (nodes, 1)
    torchrun = torchrun_args(nodes=agents, procs_per_node=per_agent,
                             rendezvous=Rendezvous(f"127.0.0.1:{port}", f"bench-{port}"), max_restarts=0,
                             module="tasks.train", arguments=args)
    procs = [subprocess.Popen([str(BIN / "python"), "-m", TORCHRUN_MODULE, *torchrun],
                              cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(agents)]
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(outputs[0][-3000:])
    return result_of(outputs[0])


def plain_loop_on_glibc(dataset: Path, steps: int, micro_batch: int, preset: str) -> float:
    """(a0): the plain loop in a process of its own on glibc's malloc (an empty LD_PRELOAD)."""
    done = subprocess.run([sys.executable, __file__, "--plain-loop-only", str(dataset), "--steps", str(steps),
                           "--micro-batch", str(micro_batch), "--preset", preset],
                          cwd=REPO_ROOT, capture_output=True, text=True, env={**os.environ, "LD_PRELOAD": ""})
    if done.returncode:
        raise SystemExit(f"the glibc plain loop exited {done.returncode}:\n{done.stderr[-3000:]}")
    return float(done.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plain-loop-only", type=Path, metavar="DATASET", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--documents", type=int, default=6000)
    parser.add_argument("--preset", help="a train.presets name (default: params.yaml's train.preset)")
    parser.add_argument("--micro-batch", type=int, help="sequences per process (default: train.micro_batch)")
    args = parser.parse_args()
    try:
        params = load(section="train", overrides=[f"preset={args.preset}"] if args.preset else []).train
    except SettingsError as exc:
        raise SystemExit(f"--preset: {exc}") from None
    micro = args.micro_batch or params.micro_batch
    if args.plain_loop_only:
        print(plain_loop(args.plain_loop_only, args.steps, params, micro)[0])
        return
    nodes = params.nodes
    gpus = torch.cuda.device_count()
    env = dict(os.environ)
    if preload_allocator(env, on_gpu=gpus > 0):  # the plain loop in this process on the workers' allocator too
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    preset = ["--set", f"preset={params.preset}"]
    chosen = [*preset, "--set", "compile=false"]  # eager, but (d)
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        root = Path(tmp)
        dataset = build_dataset(root, args.documents)
        # same global batch everywhere: the 1-process variants take all of it
        plain, plain_mfu = plain_loop(dataset, args.steps, params, micro * nodes)
        malloc = malloc_in_use()
        plain_glibc = plain_loop_on_glibc(dataset, args.steps, micro * nodes, params.preset) if malloc != "glibc" else None
        rows = {
            "(b) train step, 1 process": train_step(dataset, root / "single", 1, args.steps, micro * nodes, *chosen),
            "(b') the same, sync checkpoints": train_step(dataset, root / "sync", 1, args.steps, micro * nodes, *chosen,
                                                          "--set", "async_checkpoint=false"),
        }
        if gpus == 0 or gpus >= nodes:
            rows[f"(c) train step, {nodes} nodes FSDP2"] = train_step(dataset, root / "multi", nodes, args.steps, micro,
                                                                      *chosen, "--set", "engine=fsdp2")
            other, weights = ("false", "kept") if gpus else ("true", "freed")  # auto: kept on CPUs, freed on GPUs
            rows[f"(c'') FSDP2, weights {weights} after fwd"] = train_step(
                dataset, root / "reshard", nodes, args.steps, micro, *chosen, "--set", "engine=fsdp2",
                "--set", f"reshard_after_forward={other}")
        if gpus >= nodes:
            rows[f"(c') train step, {nodes} GPUs DDP"] = train_step(dataset, root / "ddp", nodes, args.steps, micro,
                                                                   *chosen, "--set", "engine=ddp")
        rows["(d) train step, 1 process, compile"] = train_step(dataset, root / "compiled", 1, args.steps, micro * nodes,
                                                                 *preset, "--set", "compile=true")
        if gpus == 0:  # bf16 on CPUs only where asked: fast with AMX, slow with AVX2 alone
            bf16 = [*chosen, "--set", "precision=bf16"]
            rows["(e) train step, 1 process, bf16"] = train_step(dataset, root / "bf16", 1, args.steps, micro * nodes, *bf16)
            rows[f"(e') {nodes} nodes FSDP2, bf16"] = train_step(dataset, root / "bf16-multi", nodes, args.steps, micro,
                                                                  *bf16, "--set", "engine=fsdp2")
        tokens = int(np.load(dataset / "train.offsets.npy")[-1])
    cadence, seq_len = params.checkpoint_every, params.model.seq_len
    where = f"{gpus} x {torch.cuda.get_device_name(0)}" if gpus else f"{os.cpu_count()} CPUs"
    print(f"\npreset {params.preset}, {tokens:,} train tokens, global batch {micro * nodes} x {seq_len}, "
          f"{args.steps} steps, {where}, malloc: {malloc}; checkpoint stall share at the default cadence of {cadence} steps")
    if 0 < gpus < nodes:
        print(f"(c) FSDP2 and (c') DDP over {nodes} processes need {nodes} GPUs, this machine has {gpus}: not run")
    print(f"{'variant':<36}{'tokens/s':>9}{'ratio':>7}{'same work':>10}{'steady':>8}{'MFU %':>7}{'data %':>7}"
          f"{'eval %':>7}{'ckpt %':>7}{'stall ms':>9}{'1st ms':>8}{'save ms':>8}{'@cadence %':>11}")
    print(f"{'(a) plain PyTorch loop, 1 process':<36}{plain:>9,.0f}{1.0:>7.2f}{1.0:>10.2f}{'':>8}{100 * plain_mfu:>7.1f}")
    if plain_glibc is not None:
        print(f"{'(a0) the same, glibc malloc':<36}{plain_glibc:>9,.0f}{plain_glibc / plain:>7.2f}")
    for name, r in rows.items():
        same_work = r["tokens_per_s"] / (1 - r["eval_share"] - r["checkpoint_share"])
        step_seconds = micro * nodes * seq_len / r["tokens_per_s"]
        at_cadence = r["checkpoint_stall_s"] / (cadence * step_seconds)
        print(f"{name:<36}{r['tokens_per_s']:>9,.0f}{r['tokens_per_s'] / plain:>7.2f}{same_work / plain:>10.2f}"
              f"{r['steady_tokens_per_s']:>8,.0f}{100 * r['mfu']:>7.1f}{100 * r['data_loading_share']:>7.1f}"
              f"{100 * r['eval_share']:>7.1f}{100 * r['checkpoint_share']:>7.1f}{1000 * r['checkpoint_stall_s']:>9.0f}"
              f"{1000 * r['checkpoint_stalls_s'][0]:>8.0f}"
              f"{1000 * r['checkpoint_save_s']:>8.0f}{100 * at_cadence:>11.2f}")
    peaks = {f"{r['peak_flops'] / 1e9:,.0f} GFLOP/s, {r['peak_source']}" for r in rows.values()}
    print(f"MFU: model FLOPs (6N + attention per token) against each process's peak: {'; '.join(sorted(peaks))}")
    if gpus:  # what the card reaches here, beside the data sheet's figure MFU is quoted against
        peak, what = matmul_probe(torch.device("cuda"), 8192, 20)
        print(f"measured peak for comparison: {peak / 1e12:.0f} TFLOP/s ({what}, 8192^3, best of 20)")


if __name__ == "__main__":
    main()
