"""Where a served token's time goes: the same streamed generations measured at each hop of the
serving path, side by side in one run, rounds interleaved.

    .venvs/runtime/bin/python benchmarks/serve_path.py [--preset cpu-tiny] [--prompt 32] [--new 64]
        [--concurrency 1 8] [--requests 16] [--rounds 3] [--output FILE]

It starts the real stack on ports of its own (benchmarks/serve.py's), registers a GPT of the preset
(random weights), exports it with the export step, loads its engine into Triton and routes the
router to it. Hops, innermost first, each given ``--concurrency`` streams at a time of a prompt of
``--prompt`` tokens and exactly ``--new`` new tokens (``ignore_eos``), greedy:

- ``engine``: the export's engine in this process (:class:`Engine`, the same file Triton loads),
  no HTTP: the floor.
- ``triton``: Triton's generate extension (``/v2/models/<engine>/versions/<v>/generate_stream``,
  SSE), the Triton python backend's decoupled model around the same engine.
- ``front``: the OpenAI front (``/v1/completions``, streamed), which calls Triton's.
- ``router``: the nginx router's public listener, in front of the OpenAI front: what clients call.

The HTTP hops are measured by one asyncio client (aiohttp) in this process, reading each SSE event
as it arrives; its own parsing is part of each HTTP row alike. Figures: output tokens/s over each
measurement, and microseconds per output token of the whole path at that concurrency (wall
time x concurrency / tokens, i.e. how long one stream waits per token); the breakdown is the
difference between consecutive hops. On 2 cores the client shares the CPU with the servers.

Where the cores are shared the wall-time differences are noisy (another tenant's load moves
them by tens of percent between runs), so each measurement also reads the CPU time each process
of the path spent (Linux's accounting, through psutil) per output token: the engine's process
(Triton's python backend stub: the engine's thread, the Outbox's, ONNX Runtime's), Triton's
server, the OpenAI front, nginx's workers and this client. That table says what each hop costs
whatever else ran on the machine; at concurrency 8 the path is CPU-bound, so its sum bounds the
tokens per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

import aiohttp  # noqa: E402
import numpy as np  # noqa: E402
import psutil  # noqa: E402
from serve import benchmark_stack, make_tokenizer_and_eval_text, register, run_step  # noqa: E402
from serve_engine import run_all, sampling  # noqa: E402
from serve_llm import load_models, served_name  # noqa: E402

from tasks.config import load  # noqa: E402
from tasks.lib import triton  # noqa: E402
from tasks.serving.router import NginxRouter  # noqa: E402
from tasks.serving.triton_models.llm_generate.engine import Engine, EngineLimits  # noqa: E402

HOPS = ("engine", "triton", "front", "router")
PROCESSES = ("engine process", "triton server", "front", "router", "client")


class PathProcesses:
    """The processes a token crosses, by role, from the stack's pid files: Triton's server and
    its python backend's stub (the engine's process) apart, the OpenAI front, nginx's master and
    workers, and this process (the client; for the ``engine`` hop, the engine itself)."""

    def __init__(self, stack_dir: Path) -> None:
        def pid(server: str) -> psutil.Process:
            return psutil.Process(int((stack_dir / f"{server}.pid").read_text()))

        triton = pid("triton")
        stubs = [p for p in triton.children(recursive=True) if "stub" in p.name()]
        router = pid("router")
        self.roles: dict[str, list[psutil.Process]] = {
            "engine process": stubs, "triton server": [triton], "front": [pid("openai-api")],
            "router": [router, *router.children(recursive=True)], "client": [psutil.Process()]}

    def cpu_s(self) -> dict[str, float]:
        """Each role's CPU seconds so far (user + system)."""
        return {role: sum(sum(p.cpu_times()[:2]) for p in processes) for role, processes in self.roles.items()}


def prompt_text(export: Path, tokens: int) -> tuple[str, list[int]]:
    """A prompt of exactly ``tokens`` tokens of the export's tokenizer (decoded from random ids
    and encoded again until the count holds)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(export / "hf" / "tokenizer.json"))
    rng = np.random.default_rng(0)
    for _ in range(100):
        text = tokenizer.decode(rng.integers(300, tokenizer.get_vocab_size(), size=tokens).tolist())
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) == tokens:
            return text, ids
    raise SystemExit(f"no prompt of exactly {tokens} tokens found")


Measurement = tuple[float, int, dict[str, float]]  # wall seconds, output tokens, CPU seconds by role


def measure_engine(engine: Engine, ids: list[int], new: int, concurrency: int, requests: int,
                   processes: PathProcesses) -> Measurement:
    before, started = processes.cpu_s(), time.perf_counter()
    done = run_all(engine, [ids] * requests, sampling(engine, len(ids), new), concurrency)
    wall, after = time.perf_counter() - started, processes.cpu_s()
    return wall, sum(len(s.tokens) for s in done), {"client": after["client"] - before["client"]}


async def stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any], count: str) -> int:
    """One streamed request; the tokens it produced (``count``: how its events say so)."""
    tokens = 0
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise SystemExit(f"{url}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            event = json.loads(line[5:])
            if count == "openai":
                tokens = event.get("usage", {}).get("completion_tokens", tokens) if event.get("usage") else tokens
            else:
                tokens = int(event.get("completion_tokens", tokens) or tokens)
    return tokens


async def measure_http(url: str, body: dict[str, Any], count: str, concurrency: int, requests: int,
                       processes: PathProcesses) -> Measurement:
    gate = asyncio.Semaphore(concurrency)

    async def one(session: aiohttp.ClientSession) -> int:
        async with gate:
            return await stream(session, url, body, count)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(one(session) for _ in range(min(concurrency, 4))))  # warm connections
        before, started = processes.cpu_s(), time.perf_counter()
        produced = await asyncio.gather(*(one(session) for _ in range(requests)))
        wall, after = time.perf_counter() - started, processes.cpu_s()
    return wall, sum(produced), {role: after[role] - before[role] for role in PROCESSES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu-tiny")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--new", type=int, default=64, help="new tokens per request")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--requests", type=int, default=16, help="requests per measurement (at least the concurrency)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the median is shown)")
    parser.add_argument("--output", type=Path, help="write the figures here as JSON")
    args = parser.parse_args()
    settings = load()
    serve = settings.serve
    with benchmark_stack(settings, "bench-serve-path") as (folder, env, name):
        tokenizer_uri, eval_text = make_tokenizer_and_eval_text(folder, settings.tokenize.vocab_size)
        version = register(name, tokenizer_uri, 1, settings.train.presets[args.preset], settings.tokenize.vocab_size)
        export = folder / "export"
        run_step("tasks.export", "--model-version", version, "--output", str(export), "--eval-set", str(eval_text),
                 "--no-mlflow", env=env)
        load_models(triton.TritonClient(env["TRITON_URL"]), Path(env["TRITON_REPOSITORY"]), export, version, serve,
                    ["engine"])
        NginxRouter.from_env().apply(int(version), None, 0.0)
        text, ids = prompt_text(export, args.prompt)
        limits = EngineLimits(serve.max_slots, max(args.requests, 64), serve.generate.max_tokens, 600.0,
                              kv_cache_bytes=int(serve.kv_cache_mb * 2**20), prefill_tokens=serve.generate.prefill_tokens)
        engine = Engine.from_folder(str(export / "triton" / serve.generate_model / version), limits).start()
        served = served_name(env["OPENAI_API_URL"])
        openai_body = {"model": served, "prompt": text, "max_tokens": args.new, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}, "temperature": 0}
        triton_body = {"text_input": text, "max_tokens": args.new, "ignore_eos": True, "stream": True}
        targets = {
            "triton": (f"{env['TRITON_URL']}/v2/models/{serve.generate_model}/versions/{version}/generate_stream",
                       triton_body, "triton"),
            "front": (f"{env['OPENAI_API_URL']}/v1/completions", openai_body, "openai"),
            "router": (f"{env['ROUTER_URL']}/v1/completions", openai_body, "openai"),
        }
        processes = PathProcesses(folder / "stack")
        runs: dict[tuple[str, int], list[Measurement]] = {}
        for _ in range(args.rounds):
            for concurrency in args.concurrency:
                requests = max(args.requests, concurrency)
                runs.setdefault(("engine", concurrency), []).append(
                    measure_engine(engine, ids, args.new, concurrency, requests, processes))
                for hop, (url, body, count) in targets.items():
                    runs.setdefault((hop, concurrency), []).append(
                        asyncio.run(measure_http(url, body, count, concurrency, requests, processes)))
        engine.stop()
    rows: dict[str, dict[str, float]] = {}
    for (hop, concurrency), found in runs.items():
        tok_s = statistics.median(tokens / wall for wall, tokens, _ in found)
        cpu_us = {f"cpu_us {role}": statistics.median(1e6 * cpu[role] / tokens for _, tokens, cpu in found)
                  for role in PROCESSES if role in found[0][2]}
        rows[f"{hop} c{concurrency}"] = {"output_tok_s": tok_s, "us_per_token": 1e6 * concurrency / tok_s, **cpu_us}
    print(f"{args.preset}: prompts of {args.prompt} tokens, {args.new} new, {serve.max_slots} slots, "
          f"{args.rounds} rounds (median)")
    print("| hop | concurrency | output tok/s | us per token (a stream's wait) | added by this hop |")
    print("|---|---|---|---|---|")
    for concurrency in args.concurrency:
        previous = None
        for hop in HOPS:
            row = rows[f"{hop} c{concurrency}"]
            added = "" if previous is None else f"{row['us_per_token'] - previous:+,.0f}"
            print(f"| {hop} | {concurrency} | {row['output_tok_s']:,.0f} | {row['us_per_token']:,.0f} | {added} |")
            previous = row["us_per_token"]
    print_cpu_table(rows, args.concurrency)
    if args.output:
        args.output.write_text(json.dumps({"preset": args.preset, "prompt": args.prompt, "new": args.new,
                                           "slots": serve.max_slots, "rows": rows}, indent=1))


def print_cpu_table(rows: dict[str, dict[str, float]], concurrencies: list[int]) -> None:
    """CPU microseconds per output token, by process (medians; the in-process engine's is the client's)."""
    print()
    print(f"| hop | concurrency | {' | '.join(PROCESSES)} | sum |")
    print("|---|---|" + "---|" * (len(PROCESSES) + 1))
    for concurrency in concurrencies:
        for hop in HOPS:
            row = rows[f"{hop} c{concurrency}"]
            cells = [row.get(f"cpu_us {role}") for role in PROCESSES]
            shown = " | ".join("" if cell is None else f"{cell:,.0f}" for cell in cells)
            print(f"| {hop} | {concurrency} | {shown} | {sum(c for c in cells if c is not None):,.0f} |")


if __name__ == "__main__":
    main()
