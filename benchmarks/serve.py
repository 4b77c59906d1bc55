"""Serving: Triton's dynamic batching against none, Triton against eager PyTorch, and how long a
canary takes to reach its verdict, measured in one run on a stack of the benchmark's own.

    .venvs/runtime/bin/python benchmarks/serve.py [--seconds 10] [--concurrency 8] [--requests 200]

It starts the real stack (SeaweedFS, MLflow, Triton, nginx) in a temporary folder on ports of
its own (a developer's stack is not touched), registers two GPTs of the cpu-tiny preset (random
weights: speed does not depend on them), exports them with the export step, then:

1. throughput at ``--concurrency`` clients (batch-1 requests of a full window, back to back, one
   keep-alive connection each) against the same exported model loaded in Triton with the
   params.yaml dynamic batching and without, with one ONNX Runtime thread and with every core;
2. latency of sequential batch-1 requests: eager PyTorch (the NextToken module that is
   exported), ONNX Runtime in-process and Triton over HTTP, all on the same inputs, one thread
   each (Triton's python backend runs ONNX Runtime with one intra-op thread);
3. the deploy step's wall time for the first model (checked alone at 100%) and for a canary of
   the second (params.yaml canary steps), with the seconds each step's traffic window took.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tasks.config import Preset, ServeSettings, Settings, load  # noqa: E402
from tasks.lib import triton  # noqa: E402

PORT_OFFSET = 700  # apart from a dev stack (defaults) and the tests (+100)
PORT_NAMES = ("s3", "seaweedfs_master", "seaweedfs_volume", "seaweedfs_filer", "mlflow", "airflow",
              "triton_http", "triton_grpc", "triton_metrics", "openai_api", "router", "router_internal", "prometheus",
              "pushgateway")


def run_module(module: str, *args: str, env: dict[str, str], ok: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess[str]:
    """``python -m module args``; an exit code outside ``ok`` ends the benchmark with its stderr."""
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True)
    if proc.returncode not in ok:
        raise SystemExit(f"{module} {' '.join(args[:2])} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def run_step(module: str, *args: str, env: dict[str, str]) -> dict[str, Any]:
    """A step that must succeed, and its result."""
    proc = run_module(module, *args, env=env)
    line = next(x for x in reversed(proc.stderr.splitlines()) if " result {" in x)
    loaded: dict[str, Any] = json.loads(line.split(" result ", 1)[1])
    return loaded


def start_stack(folder: Path) -> dict[str, str]:
    defaults = load().stack.ports
    env = {**os.environ, "STACK_DIR": str(folder / "stack"), "DVC_REGISTRY_DIR": str(folder / "dvc"),
           **{f"STACK_PORT_{n.upper()}": str(defaults[n] + PORT_OFFSET) for n in PORT_NAMES}}
    proc = subprocess.run([sys.executable, "-m", "stack", "up"], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"stack up failed:\n{proc.stderr[-3000:]}")
    client = dict(line.split("=", 1) for line in (folder / "stack" / "stack.env").read_text().splitlines() if line)
    return {**env, **client}


def start_benchmark_stack(folder: Path, settings: Settings, prefix: str) -> tuple[dict[str, str], str]:
    """The stack on the benchmark's ports, this process's environment pointed at it, and a params
    file (PIPELINE_PARAMS) naming a registered model of its own: ``(env, model name)``."""
    env = start_stack(folder)
    os.environ.update({k: v for k, v in env.items() if k.startswith(("MLFLOW", "AWS", "S3", "TRITON", "ROUTER"))})
    name = f"{prefix}-{time.time_ns()}"
    params = folder / "params.yaml"
    named = dataclasses.replace(settings, pipeline=dataclasses.replace(settings.pipeline, model_name=name))
    params.write_text(json.dumps(dataclasses.asdict(named)))
    env["PIPELINE_PARAMS"] = os.environ["PIPELINE_PARAMS"] = str(params)
    return env, name


@contextlib.contextmanager
def benchmark_stack(settings: Settings, prefix: str) -> Iterator[tuple[Path, dict[str, str], str]]:
    """A temporary folder, the stack in it (:func:`start_benchmark_stack`): ``(folder, env, model
    name)``; at the end the stack is stopped and the folder removed, also when it failed to start."""
    folder = Path(tempfile.mkdtemp(prefix=f"{prefix}-"))
    try:
        yield (folder, *start_benchmark_stack(folder, settings, prefix))
    finally:
        subprocess.run([sys.executable, "-m", "stack", "down"], cwd=REPO_ROOT,
                       env={**os.environ, "STACK_DIR": str(folder / "stack")}, capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


def make_tokenizer_and_eval_text(folder: Path, vocab: int) -> tuple[str, Path]:
    from tasks import seed
    from tasks.lib import tokens

    docs = [text for _, text in seed.documents(1500)]
    tokenizer = tokens.train_tokenizer(docs[:1200], vocab, 1200).to_str()
    digest = __import__("hashlib").sha256(tokenizer.encode()).hexdigest()
    path = folder / f"sha256-{digest}" / "tokenizer.json"  # the tokenizer store's layout
    path.parent.mkdir(parents=True)
    path.write_text(tokenizer)
    eval_text = folder / "eval.jsonl"
    eval_text.write_text("".join(json.dumps({"id": str(i), "text": d}) + "\n" for i, d in enumerate(docs[1200:])))
    return str(path), eval_text


def register(name: str, tokenizer_uri: str, seed: int, preset: Preset, vocab: int,
             weight_scale: float = 1.0) -> str:
    """A random-weight GPT registered the way the register step does. ``weight_scale`` multiplies
    the blocks' matrices: at 1 the tied embedding dominates and greedy decoding repeats the
    prompt's last token whatever the seed; at 10 the text depends on the weights."""
    import mlflow
    import torch

    from tasks.lib.model import FORMAT_VERSION, GPT, GPTConfig
    from tasks.lib.model_store import log_model

    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=vocab, **dataclasses.asdict(preset))
    model = GPT(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param.dim() == 2 and not param_name.startswith("embed"):
                param.mul_(weight_scale)
    description = {"format_version": FORMAT_VERSION, "config": config.to_dict(), "tokenizer_uri": tokenizer_uri,
                   "tokenizer_hash": tokenizer_uri.rsplit("sha256-", 1)[1].split("/")[0]}
    with mlflow.start_run(run_name=f"benchmark {name} seed {seed}"):
        model_uri = log_model(model, description)
    return str(mlflow.register_model(model_uri, name, tags={"model_description": json.dumps(description)}).version)


# -- 1. dynamic batching ----------------------------------------------------------------------


def load_copy(client: triton.TritonClient, repository: Path, export: Path, version: str, name: str,
              batching: bool, threads: int, serve: ServeSettings) -> None:
    """The exported logits model under another name, with or without dynamic batching."""
    target = repository / name / "1"
    shutil.rmtree(target.parent, ignore_errors=True)
    shutil.copytree(export / "triton" / serve.triton_model / version, target)
    threaded = dataclasses.replace(serve, intra_op_threads=threads)
    config = triton.with_versions(triton.logits_model_config(name, "python", threaded), [1])
    if not batching:
        config.pop("dynamic_batching")
    client.load(name, config)
    client.wait_ready(name, [1], serve.load_timeout_s)


def throughput(url: str, model: str, ids: np.ndarray[Any, Any], concurrency: int, seconds: float) -> float:
    """Requests/s of ``concurrency`` clients sending back to back for ``seconds``."""
    host, port = url.split("//")[1].split(":")
    body = triton.infer_request(ids)
    done, failed = [0] * concurrency, [0] * concurrency
    deadline = time.monotonic() + seconds

    def client(index: int) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        while time.monotonic() < deadline:
            conn.request("POST", triton.infer_path(model, 1), body=body,
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            if resp.status == 200:
                done[index] += 1
            else:
                failed[index] += 1
        conn.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if sum(failed):
        raise SystemExit(f"{model}: {sum(failed)} requests failed")
    return sum(done) / (time.monotonic() - started)


# -- 2. latency: Triton vs eager PyTorch ------------------------------------------------------


def p50_ms(run: Any, inputs: list[np.ndarray[Any, Any]]) -> float:
    for ids in inputs[:10]:  # warm-up
        run(ids)
    times = []
    for ids in inputs:
        started = time.perf_counter()
        run(ids)
        times.append((time.perf_counter() - started) * 1000)
    return float(np.median(times))


def latencies(url: str, model: str, name: str, version: str, export: Path, inputs: list[np.ndarray[Any, Any]]) -> dict[str, float]:
    import onnxruntime as ort
    import torch

    from tasks.export import NextToken
    from tasks.lib.model_store import load_version

    torch.set_num_threads(1)
    eager = NextToken(load_version(name, version).model).eval()

    def pytorch(ids: np.ndarray[Any, Any]) -> None:
        with torch.inference_mode():
            eager(torch.from_numpy(ids))

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(export / "triton" / "llm" / version / "model.onnx"), options,
                                   providers=["CPUExecutionProvider"])
    host, port = url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)

    def over_http(ids: np.ndarray[Any, Any]) -> None:
        conn.request("POST", triton.infer_path(model, 1), body=triton.infer_request(ids),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        if resp.status != 200:
            raise SystemExit(f"triton answered {resp.status}")

    return {"eager PyTorch (in-process)": p50_ms(pytorch, inputs),
            "ONNX Runtime (in-process)": p50_ms(lambda ids: session.run(None, {"input_ids": ids}), inputs),
            "Triton python backend + ORT (HTTP)": p50_ms(over_http, inputs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per throughput measurement")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=200, help="sequential requests per latency measurement")
    args = parser.parse_args()
    settings = load()
    serve = settings.serve
    preset = settings.train.presets["cpu-tiny"]
    vocab = settings.tokenize.vocab_size
    with benchmark_stack(settings, "bench-serve") as (folder, env, name):
        tokenizer_uri, eval_text = make_tokenizer_and_eval_text(folder, vocab)
        versions = [register(name, tokenizer_uri, seed, preset, vocab) for seed in (1, 2)]
        exports = [folder / f"export{v}" for v in versions]
        for version, out in zip(versions, exports, strict=True):
            run_step("tasks.export", "--model-version", version, "--output", str(out), "--eval-set", str(eval_text),
                     "--no-mlflow", env=env)

        client = triton.TritonClient(env["TRITON_URL"])
        repository = Path(env["TRITON_REPOSITORY"])
        rng = np.random.default_rng(0)
        window = rng.integers(0, vocab, size=(1, preset.seq_len), dtype=np.int64)
        rates: dict[tuple[int, bool], float] = {}
        for threads in (1, 0):
            for batching in (False, True):
                model = f"bench_t{threads}_{'batched' if batching else 'unbatched'}"
                load_copy(client, repository, exports[0], versions[0], model, batching, threads, serve)
                throughput(env["TRITON_URL"], model, window, args.concurrency, 2.0)  # warm-up
                rates[threads, batching] = throughput(env["TRITON_URL"], model, window, args.concurrency, args.seconds)
                if (threads, batching) != (1, False):  # kept for the latency comparison (one thread)
                    client.unload(model)
        inputs = [rng.integers(0, vocab, size=(1, preset.seq_len), dtype=np.int64) for _ in range(args.requests)]
        latency = latencies(env["TRITON_URL"], "bench_t1_unbatched", name, versions[0], exports[0], inputs)
        client.unload("bench_t1_unbatched")

        decisions = []
        for version, out in zip(versions, exports, strict=True):
            started = time.monotonic()
            result = run_step("tasks.deploy", "canary", "--model-version", version, "--export", str(out),
                              "--output", str(folder / f"deploy{version}"), "--no-promote", env=env)
            report = json.loads((folder / f"deploy{version}" / "report.json").read_text())
            decisions.append((version, result["verdict"], time.monotonic() - started,
                              [(s["weight"], s["seconds"]) for s in report["steps"]]))

    print(f"\ncpu-tiny GPT ({preset.n_layers} layers, d_model {preset.d_model}, vocab {vocab}), "
          f"batch-1 requests of {preset.seq_len} tokens, {os.cpu_count()} CPUs")
    print(f"\n{'throughput at concurrency ' + str(args.concurrency) + ' (1 instance)':<54}{'req/s':>10}"
          f"{'vs no batching':>16}")
    for threads in (1, 0):
        unbatched = rates[threads, False]
        label = "1 ORT thread" if threads == 1 else f"every core ({os.cpu_count()} ORT threads)"
        print(f"{'Triton, no batching, ' + label:<54}{unbatched:>10.1f}{1.0:>16.2f}")
        print(f"{'Triton, dynamic batching, ' + label:<54}{rates[threads, True]:>10.1f}"
              f"{rates[threads, True] / unbatched:>16.2f}")
    eager = latency["eager PyTorch (in-process)"]
    print(f"\n{'latency, ' + str(args.requests) + ' sequential requests':<54}{'p50 ms':>10}{'ratio':>8}")
    for label, ms in latency.items():
        print(f"{label:<54}{ms:>10.2f}{ms / eager:>8.2f}")
    print(f"\n{'deploy (canary steps ' + str(list(settings.canary.steps)) + ')':<54}{'seconds':>10}  verdict, traffic windows")
    for version, verdict, seconds, steps in decisions:
        label = "first model (alone at 100%)" if version == versions[0] else "canary of a second model"
        windows = ", ".join(f"{w:g}%: {s:.1f}s" for w, s in steps)
        print(f"{label:<54}{seconds:>10.1f}  {verdict}, {windows}")


if __name__ == "__main__":
    main()
