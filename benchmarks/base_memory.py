"""What a 1B base model needs: a random checkpoint of Llama 3.2 1B's shape (1.24B parameters,
GQA 32/8, tied embedding over 128,256 ids, rope llama3), built offline by transformers and saved
in bf16 shards, taken through the real steps as `train.base` takes a team's checkpoint:

  import   `tasks.tokenize prepare --base`: the checkpoint read a tensor at a time into our layout
           and stored (peak RSS of the step's process)
  encode   `tasks.tokenize encode` + `merge` of a small corpus with the base's tokenizer
  train    `tasks.train` under torchrun, one process (FSDP2), starting from the import: peak RSS
           of the training process and, on a GPU, the device's peak memory in use (nvidia-smi)

    .venvs/runtime/bin/python benchmarks/base_memory.py [--steps 20] [--micro-batch 4] [--out result.json]
    .venvs/runtime/bin/python benchmarks/base_memory.py --size tiny --preset cpu-tiny --steps 4  # a smoke test

``--steps 0`` measures the import alone (what a CPU node needs to take the base; training a 1B
model on 2 cores is not a workload). The figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import psutil  # noqa: E402

from examples.tiny_base import make_base, read_texts  # noqa: E402
from tasks.contract import TORCHRUN_MODULE, Rendezvous, torchrun_args  # noqa: E402
from tasks.lib import records  # noqa: E402

# Llama 3.2 1B's config.json (its tokenizer is ours, 4,096 ids, inside the 128,256 rows)
LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072,
            "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
SHAPES = {"1b": LLAMA_1B, "tiny": {}}  # tiny: examples/tiny_base.py's own, a smoke test of this script
NO_MLFLOW = {"MLFLOW_TRACKING_URI": ""}


class PeakSampler:
    """Peak resident memory of a process tree (the largest single process) and, where nvidia-smi
    answers, the GPU memory in use, sampled every ``period_s`` while a step runs."""

    def __init__(self, period_s: float = 0.25) -> None:
        self.period_s, self.rss_mb, self.gpu_mb = period_s, 0.0, 0.0
        self.root: psutil.Process | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            if self.root is not None:
                with_children = [self.root, *self.root.children(recursive=True)] if self.root.is_running() else []
                for proc in with_children:
                    with contextlib.suppress(psutil.Error):  # a process that ended meanwhile
                        self.rss_mb = max(self.rss_mb, proc.memory_info().rss / 2**20)
            self.gpu_mb = max(self.gpu_mb, gpu_memory_used_mb())

    def run(self, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        self._thread.start()
        started = time.monotonic()
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        self.root = psutil.Process(proc.pid)
        stdout, stderr = proc.communicate()
        self._stop.set()
        self._thread.join()
        self.seconds = time.monotonic() - started
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(argv[1:4])} exited {proc.returncode}: {stderr[-3000:]}")
        return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def gpu_memory_used_mb() -> float:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5).stdout
        return float(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return 0.0


def step_result(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    line = next(x for x in reversed((proc.stdout + proc.stderr).splitlines()) if " result {" in x)
    loaded: dict[str, Any] = json.loads(line.split(" result ", 1)[1])
    return loaded


def measured(argv: list[str], env: dict[str, str] | None = None) -> tuple[dict[str, Any], dict[str, float]]:
    sampler = PeakSampler()
    proc = sampler.run([sys.executable, "-m", *argv], {**NO_MLFLOW, **(env or {})})
    return step_result(proc), {"seconds": round(sampler.seconds, 1), "peak_rss_mb": round(sampler.rss_mb),
                               "peak_gpu_mb": round(sampler.gpu_mb)}


def corpus(root: Path, texts: list[str]) -> Path:
    """A snapshot as the snapshot step writes one: normalized, de-duplicated records."""
    raw = ({"id": str(i), "text": t, "source": "docs", "created_at": "2026-11-01T00:00:00"} for i, t in enumerate(texts))
    path = root / "snapshot.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records.normalize_and_dedup(raw).records))
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="training steps (0: the import alone)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--size", choices=SHAPES, default="1b")
    p.add_argument("--preset", default="gpu-1b", help="the context (seq_len) the base is imported at")
    p.add_argument("--out", type=Path, help="also write the result here (JSON)")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="base-memory-"))
    texts = read_texts(str(REPO_ROOT / "docs" / "*.md"))
    started = time.monotonic()
    base = make_base("llama", texts, root / "llama-1b", vocab_size=4096, shard_size="1GB", shape=SHAPES[args.size],
                     dtype="bfloat16")
    built_s = time.monotonic() - started
    # the docs' paragraphs, each also in four numbered variants: ~2 MB, batches enough for the steps
    paragraphs = [chunk for t in texts for chunk in t.split("\n\n") if chunk.strip()]
    snapshot = corpus(root, [f"{n}. {chunk}" if n else chunk for n in range(5) for chunk in paragraphs])
    result: dict[str, Any] = {"checkpoint_gb": round(sum(f.stat().st_size for f in base.glob("*.safetensors")) / 1e9, 2),
                              "built_s": round(built_s, 1)}
    prepared, result["import"] = measured(
        ["tasks.tokenize", "prepare", "--snapshot", str(snapshot), "--base", str(base), "--preset", args.preset,
         "--output", str(root / "prepare"), "--set", f"tokenizer_store={root / 'tokenizers'}",
         "--set", f"base_store={root / 'bases'}"])
    if args.steps:
        _, result["encode"] = measured(
            ["tasks.tokenize", "encode", "--snapshot", str(snapshot), "--tokenizer", prepared["tokenizer_uri"],
             "--shard-index", "0", "--num-shards", "1", "--output", str(root / "shards" / "00000")])
        measured(["tasks.tokenize", "merge", "--snapshot", str(snapshot), "--tokenizer", prepared["tokenizer_uri"],
                  "--num-shards", "1", "--shards", str(root / "shards"), "--output", str(root / "dataset")])
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        train_args = ["--dataset", str(root / "dataset"), "--checkpoints", str(root / "ckpt"), "--output",
                      str(root / "model"), "--init-from", prepared["init_model_uri"], "--set", f"preset={args.preset}",
                      "--set", "engine=fsdp2", "--set", f"max_steps={args.steps}", "--set", f"micro_batch={args.micro_batch}",
                      "--set", f"log_every={max(1, args.steps // 4)}", "--set", f"eval_every={args.steps}",
                      "--set", "eval_batches=2", "--set", f"checkpoint_every={args.steps}",
                      "--set", "warmup_steps=2"]
        trained, result["train"] = measured([TORCHRUN_MODULE, *torchrun_args(
            nodes=1, procs_per_node=1, rendezvous=Rendezvous(f"127.0.0.1:{port}", f"base-{port}"), max_restarts=0,
            module="tasks.train", arguments=train_args)])
        result["train"] |= {k: trained.get(k) for k in ("precision", "engine", "tokens_per_s", "mfu",
                                                          "final_loss", "world_size")}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
