"""What served-traffic capture costs a request: the OpenAI API with capture off, with every
request captured, and with every request captured while S3 is frozen (SIGSTOP), side by side.

    make up && make pipeline    # a champion serving
    .venvs/runtime/bin/python benchmarks/capture.py [--requests 600] [--concurrency 4]

Three fronts of today's code (``tasks.serving.front``) on free ports before the stack's Triton, one
per mode, get the same streamed greedy completions in turn (round robin, ``--concurrency``
clients): held-out opening words, 16 new tokens. Per mode: the client's time to first token and
whole-stream time (p50, p90, p99), failed requests, and the capture's counts. For the frozen
mode the stack's SeaweedFS is stopped for the mode's requests and resumed after (its records
cannot be written: dropped, counted, while requests go on).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from stack.servers import SERVERS, client_env  # noqa: E402
from stack.traffic import prompts  # noqa: E402

MODES = {"capture off": 0.0, "capture on": 1.0, "capture on, S3 frozen": 1.0}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_front(port: int, rate: float, env: dict[str, str]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "tasks.serving.front", "--port", str(port), "--triton-url",
                             env["TRITON_URL"], "--capture-rate", str(rate), "--capture-uri", "s3://raw/benchmark-capture"],
                            cwd=REPO_ROOT, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the front on port {port} did not start")


def stream(port: int, prompt: str) -> tuple[float, float, bool]:
    """One streamed completion: (time to first token, whole time, ok)."""
    started = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("POST", "/v1/completions", json.dumps(
            {"prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True}), {"Content-Type": "application/json"})
        response = connection.getresponse()
        first = None
        for line in response:
            if line.startswith(b"data: {") and first is None:
                first = time.perf_counter() - started
        return first or float("nan"), time.perf_counter() - started, response.status == 200 and first is not None
    finally:
        connection.close()


def seaweedfs_pid() -> int:
    server = next(s for s in SERVERS if s.name == "seaweedfs")
    pid = server.pid()
    if pid is None:
        raise RuntimeError("SeaweedFS is not running: make up first")
    return pid


def measure(port: int, texts: list[str], concurrency: int) -> dict[str, Any]:
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: stream(port, p), texts))
    ttft = np.array([r[0] for r in results if r[2]]) * 1000
    total = np.array([r[1] for r in results if r[2]]) * 1000
    return {"ok": int(sum(r[2] for r in results)), "failed": int(sum(not r[2] for r in results)),
            **{f"ttft_p{q}": float(np.percentile(ttft, q)) for q in (50, 90, 99)},
            **{f"total_p{q}": float(np.percentile(total, q)) for q in (50, 90, 99)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=600, help="per mode")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="the modes take turns this many times")
    args = parser.parse_args()
    env = client_env()
    os.environ.update(env)
    try:
        urllib.request.urlopen(f"{env['TRITON_URL']}/v2/models/llm_generate/ready", timeout=5).read()
    except OSError:
        print("benchmarks/capture.py: skipped: no model serves on the local stack (make pipeline first)")
        return
    from tasks.config import load
    from tasks.lib import storage

    documents = [json.loads(line)["text"] for line in storage.read_bytes(load().evaluate.eval_set_uri).splitlines() if line]
    texts = prompts(documents, "normal", args.requests, seed=7)
    ports = {mode: free_port() for mode in MODES}
    fronts = {mode: start_front(ports[mode], rate, env) for mode, rate in MODES.items()}
    rows: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    s3 = seaweedfs_pid()
    try:
        for mode in MODES:  # warm each front (its connection pool, Triton's engine)
            measure(ports[mode], texts[:20], args.concurrency)
        per_round = len(texts) // args.rounds
        for round_index in range(args.rounds):
            chunk = texts[round_index * per_round:(round_index + 1) * per_round]
            for mode in MODES:
                frozen = mode.endswith("frozen")
                if frozen:
                    os.kill(s3, signal.SIGSTOP)
                try:
                    rows[mode].append(measure(ports[mode], chunk, args.concurrency))
                finally:
                    if frozen:
                        os.kill(s3, signal.SIGCONT)
        counts = {}
        for mode in MODES:
            with urllib.request.urlopen(f"http://127.0.0.1:{ports[mode]}/capture/stats", timeout=5) as resp:
                counts[mode] = json.loads(resp.read())
    finally:
        for proc in fronts.values():
            proc.terminate()
    print(f"{args.requests} streamed completions per mode, 16 new tokens, concurrency {args.concurrency}, "
          f"{args.rounds} rounds (median of the rounds' percentiles)\n")
    print("| mode | TTFT p50 / p90 / p99 ms | whole stream p50 / p90 / p99 ms | failed | captured: written / dropped |")
    print("|---|---|---|---|---|")
    for mode in MODES:
        med = {k: float(np.median([r[k] for r in rows[mode]])) for k in rows[mode][0]}
        stats = counts[mode]
        captured = (f"{stats.get('written', 0)} / {stats.get('dropped_full', 0) + stats.get('dropped_write', 0)}"
                    if stats.get("enabled") else "-")
        print(f"| {mode} | {med['ttft_p50']:.1f} / {med['ttft_p90']:.1f} / {med['ttft_p99']:.1f} | "
              f"{med['total_p50']:.1f} / {med['total_p90']:.1f} / {med['total_p99']:.1f} | "
              f"{sum(r['failed'] for r in rows[mode])} | {captured} |")


if __name__ == "__main__":
    main()
