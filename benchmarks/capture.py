"""What capturing served traffic costs: a request's latency with capture off, on, and on while S3
is frozen (SIGSTOP); and how long the front takes to answer its ``/health`` while the capture
keeps huge prompts and scrubs long fields (issue 42 item 4), in one run.

    .venvs/runtime/bin/python benchmarks/capture.py [--requests 600] [--concurrency 4] [--rounds 3]
        [--health-seconds 20] [--health-rounds 2] [--health-rps 4] [--flush-every-s 1]

It starts the real stack (SeaweedFS, MLflow, Triton, the OpenAI front, nginx) on
benchmarks/serve.py's ports, registers a cpu-tiny GPT (random weights), exports it with the
export step and deploys it (promoted alone). The fronts measured are processes of today's code
(``tasks.serving.front``) on free ports before that stack's Triton, capturing to
``s3://raw/benchmark-capture``; clients reach them straight, not through the router.

1. Request latency (``--requests`` per mode, 0: skipped). Three fronts, one per mode, get the
   same streamed greedy completions in turn (round robin, ``--concurrency`` clients): held-out
   opening words, 16 new tokens. Per mode: the client's time to first token and whole-stream
   time (p50, p90, p99), failed requests, and the capture's counts. For the frozen mode the
   stack's SeaweedFS is stopped for the mode's requests and resumed after (its records cannot be
   written: dropped, counted, while requests go on).

2. The front's responsiveness (``--health-seconds`` per mode and round, 0: skipped; the modes
   take turns ``--health-rounds`` times). In each mode clients send ``--health-rps`` streamed
   completions a second (2 at once) to a front, ``POST /capture/flush`` runs again
   ``--flush-every-s`` after the last one returned (and once more after the clients' last
   request), and a probe (a process of its own, one keep-alive connection) GETs the front's
   ``/health`` every 10 ms until 2 s after the clients stopped. The prompts are e-mail-like
   text (headers, names, addresses in several scripts, phone numbers, card numbers, quoted
   replies; fixed seed), the completions' ``max_tokens`` 4096:

   - idle: no clients; the probe and the flushes alone (the machine's own noise);
   - 1 MB prompts (bodies just under the 1 MiB limit), refused by the engine as too long for the
     context: the capture keeps a refused request as its refusal alone; and the same with
     capture off;
   - 150 KB prompts, refused likewise;
   - 150 KB prompts accepted and answered with 16 KB of e-mail-like text, as a model of a long
     context (~40k tokens) would: the capture cuts each prompt and answer to
     ``serve.capture.max_field_chars`` (16,384) and scrubs both whole. cpu-tiny cannot accept
     them (a context of 128 tokens: its engine refuses any prompt over ~2 KB by its size), so
     these fronts call a stub engine (this script, ``--stub-engine``: Triton's
     ``generate_stream`` for any prompt, 64 chunks of the answer 2 ms apart, with the engine's
     timings on the last) in place of Triton; and the same with capture off.

   Per mode: /health p50, p99, max and the share over 50 ms (goal: p99 under 50 ms), the
   clients' requests by status, the flushes (how many, p50 and longest), the records written.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

from serve import benchmark_stack, make_tokenizer_and_eval_text, register, run_step  # noqa: E402

from stack.servers import SERVERS  # noqa: E402
from stack.traffic import prompts  # noqa: E402
from tasks.serving.contract import MAX_BODY_BYTES  # noqa: E402

MODES = {"capture off": 0.0, "capture on": 1.0, "capture on, S3 frozen": 1.0}
CAPTURE_URI = "s3://raw/benchmark-capture"

# 2. responsiveness: the fronts (upstream, capture rate) and each mode's front and prompts
HEALTH_FRONTS = {"engine, capture on": ("engine", 1.0), "engine, capture off": ("engine", 0.0),
                 "stub, capture on": ("stub", 1.0), "stub, capture off": ("stub", 0.0)}
ONE_MB = MAX_BODY_BYTES - 1024  # a body just under the limit the router and the front enforce
PROMPT_BYTES = {"1 MB": ONE_MB, "150 KB": 150_000}
HEALTH_MODES: dict[str, tuple[str, str | None]] = {
    "idle (probe and flushes only)": ("engine, capture on", None),
    "1 MB prompts, refused, capture off": ("engine, capture off", "1 MB"),
    "1 MB prompts, refused": ("engine, capture on", "1 MB"),
    "150 KB prompts, refused": ("engine, capture on", "150 KB"),
    "150 KB prompts + 16 KB answers, accepted (stub engine), capture off": ("stub, capture off", "150 KB"),
    "150 KB prompts + 16 KB answers, accepted (stub engine)": ("stub, capture on", "150 KB"),
}
HEALTH_CONCURRENCY = 2
PROBE_INTERVAL_S = 0.01
PROBE_TAIL_S = 2.0  # the probe runs this much longer than the clients: the last flush is measured too
SLOW_MS = 50.0  # the goal: /health p99 under this
STUB_ANSWER_CHARS, STUB_CHUNKS, STUB_GAP_S = 16_384, 64, 0.002


# -- e-mail-like text --------------------------------------------------------------------------

FIRST = ("Jürgen", "Anna", "María", "Wei", "Olivia", "Ahmed", "Søren", "Chloé", "Raj", "Yuki", "Élodie", "Tomás",
         "Zoë", "Dmitri", "Fatima", "Liam")
LAST = ("Müller", "Smith", "García", "Zhang", "Johnson", "Haddad", "Nielsen", "Dubois", "Patel", "Tanaka",
        "Łukasik", "O'Brien", "Kowalski", "Rossi", "Nakamura", "Okafor")
DOMAINS = ("example.com", "mail.example.org", "exämple.de", "example.co.uk", "例子.广告", "corp.example.net",
           "uni-example.edu", "post.example.fr")
WORDS = ("please", "find", "attached", "the", "invoice", "for", "March", "meeting", "moved", "to", "Thursday",
         "call", "me", "when", "you", "can", "thanks", "project", "budget", "review", "draft", "contract",
         "shipment", "order", "number", "delivery", "address", "account", "update", "with", "and", "a", "our",
         "team", "before", "after", "lunch", "signed", "copy", "schedule", "quarter", "report", "travel")


def person(rng: random.Random) -> tuple[str, str]:
    first, last = rng.choice(FIRST), rng.choice(LAST)
    local = rng.choice((f"{first}.{last}", f"{first[0]}{last}", f"{first}{rng.randint(1, 99)}", f"{last}.{first}"))
    return f"{first} {last}", f"{local.lower().replace(' ', '')}@{rng.choice(DOMAINS)}"


def phone(rng: random.Random) -> str:
    return rng.choice((f"+49 30 {rng.randint(1000000, 9999999)}", f"(415) 555-{rng.randint(0, 9999):04d}",
                       f"+44 20 7946 {rng.randint(0, 9999):04d}", f"+86 10 {rng.randint(10000000, 99999999)}",
                       f"+33 1 {rng.randint(10, 99)} {rng.randint(10, 99)} {rng.randint(10, 99)} {rng.randint(10, 99)}",
                       f"212-555-{rng.randint(0, 9999):04d}"))


def sentence(rng: random.Random) -> str:
    words = rng.choices(WORDS, k=rng.randint(6, 18))
    extra = rng.random()
    if extra < 0.25:
        words.insert(rng.randrange(len(words)), f"<{person(rng)[1]}>")
    elif extra < 0.4:
        words.insert(rng.randrange(len(words)), phone(rng))
    elif extra < 0.45:  # a card number passing Luhn, or 16 digits that do not
        words.insert(rng.randrange(len(words)), rng.choice(("4111 1111 1111 1111", str(rng.randint(10**15, 10**16)))))
    elif extra < 0.6:
        words.insert(rng.randrange(len(words)), f"#{rng.randint(100000, 99999999)}")
    return " ".join(words).capitalize() + rng.choice((".", ".", "?", "!"))


def email_text(rng: random.Random, chars: int) -> str:
    """At least ``chars`` characters of e-mail-like text: messages with headers, a body, a
    signature with a phone number and a quoted reply."""
    messages: list[str] = []
    size = 0
    while size < chars:
        (sender, sender_address), (to, to_address), (_, cc) = person(rng), person(rng), person(rng)
        lines = [f"From: {sender} <{sender_address}>", f"To: {to} <{to_address}>", f"Cc: {cc}",
                 f"Subject: Re: {' '.join(rng.choices(WORDS, k=4))}",
                 f"Date: Tue, {rng.randint(1, 28)} Nov 2026 {rng.randint(7, 19):02d}:{rng.randint(0, 59):02d} +0100",
                 "", f"Hi {to.split()[0]},", ""]
        lines += [sentence(rng) for _ in range(rng.randint(2, 6))]
        lines += ["", "Best,", sender, f"Tel. {phone(rng)}", "", f"> On Monday {to} <{to_address}> wrote:"]
        lines += [f"> {sentence(rng)}" for _ in range(rng.randint(1, 3))]
        messages.append("\n".join(lines) + "\n\n")
        size += len(messages[-1])
    return "".join(messages)


def completion_body(prompt: str, max_tokens: int, stream: bool = True) -> bytes:
    return json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream},
                      ensure_ascii=False).encode()


def sized_bodies(size: int, count: int, seed: int) -> list[bytes]:
    """``count`` completion requests of e-mail-like prompts, each body at most ``size`` bytes
    (and within a few bytes of it)."""
    rng = random.Random(seed)
    bodies = []
    for _ in range(count):
        text = email_text(rng, size)
        while len(body := completion_body(text, 4096)) > size:
            text = text[:len(text) - max(1, (len(body) - size) // 2)]
        bodies.append(body)
    return bodies


# -- fronts, the stub engine, the probe -----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{what} did not start")


def start_front(port: int, rate: float, triton_url: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "tasks.serving.front", "--port", str(port), "--triton-url",
                             triton_url, "--capture-rate", str(rate), "--capture-uri", CAPTURE_URI],
                            cwd=REPO_ROOT, env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ready(f"http://127.0.0.1:{port}/health", proc, f"the front on port {port}")
    return proc


def stub_engine(port: int) -> None:
    """Triton's ``generate_stream`` for the engine model, as an engine of a long context would
    answer: any prompt accepted, ``STUB_ANSWER_CHARS`` of e-mail-like text in ``STUB_CHUNKS``
    events ``STUB_GAP_S`` apart, the last with its finish reason and the engine's timings."""
    from aiohttp import web

    rng = random.Random(5)
    answers = [email_text(rng, STUB_ANSWER_CHARS)[:STUB_ANSWER_CHARS] for _ in range(4)]
    size = -(-STUB_ANSWER_CHARS // STUB_CHUNKS)

    async def generate(request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        inputs = await request.json()
        prompt = str(inputs.get("text_input", ""))
        answer = answers[len(prompt) % len(answers)]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        first = 0.0
        for i in range(STUB_CHUNKS):
            last = i == STUB_CHUNKS - 1
            event: dict[str, Any] = {
                "model_name": request.match_info["model"], "model_version": request.match_info.get("version", "1"),
                "text_output": answer[i * size:(i + 1) * size], "finish_reason": "length" if last else "",
                "prompt_tokens": len(prompt) // 4, "completion_tokens": i + 1}
            if last:
                event.update(engine_ttft_ms=first, engine_itl_ms=STUB_GAP_S * 1000)
            await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            first = first or (time.perf_counter() - started) * 1000
            if not last:
                await asyncio.sleep(STUB_GAP_S)
        await response.write_eof()
        return response

    async def ready(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application(client_max_size=4 * MAX_BODY_BYTES)
    app.router.add_post("/v2/models/{model}/generate_stream", generate)
    app.router.add_post("/v2/models/{model}/versions/{version}/generate_stream", generate)
    app.router.add_get("/v2/health/ready", ready)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def probe(port: int, seconds: float) -> None:
    """GET ``/health`` every PROBE_INTERVAL_S for ``seconds`` on one keep-alive connection (a
    new one after a failure); prints ``ready``, then one JSON line: each answer's time (ms) and
    the failures."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    times: list[float] = []
    errors = 0
    print("ready", flush=True)
    deadline = time.monotonic() + seconds
    tick = time.monotonic()
    while tick < deadline:
        started = time.perf_counter()
        try:
            conn.request("GET", "/health")
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                raise http.client.HTTPException(f"status {response.status}")
            times.append((time.perf_counter() - started) * 1000)
        except (OSError, http.client.HTTPException):
            errors += 1
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        tick = max(tick + PROBE_INTERVAL_S, time.monotonic())  # late: the next one at once, no catching up
        time.sleep(max(0.0, tick - time.monotonic()))
    print(json.dumps({"ms": [round(t, 3) for t in times], "errors": errors}), flush=True)


# -- 1. request latency ----------------------------------------------------------------------------


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
        raise RuntimeError("SeaweedFS is not running")
    return pid


def measure(port: int, texts: list[str], concurrency: int) -> dict[str, Any]:
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: stream(port, p), texts))
    ttft = np.array([r[0] for r in results if r[2]]) * 1000
    total = np.array([r[1] for r in results if r[2]]) * 1000
    return {"ok": int(sum(r[2] for r in results)), "failed": int(sum(not r[2] for r in results)),
            **{f"ttft_p{q}": float(np.percentile(ttft, q)) for q in (50, 90, 99)},
            **{f"total_p{q}": float(np.percentile(total, q)) for q in (50, 90, 99)}}


def capture_stats(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/capture/stats", timeout=30) as resp:
        loaded: dict[str, Any] = json.loads(resp.read())
    return loaded


def request_latency(args: argparse.Namespace, triton_url: str, documents: list[str]) -> None:
    texts = prompts(documents, "normal", args.requests, seed=7)
    ports = {mode: free_port() for mode in MODES}
    fronts = {mode: start_front(ports[mode], rate, triton_url) for mode, rate in MODES.items()}
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
        counts = {mode: capture_stats(ports[mode]) for mode in MODES}
    finally:
        for proc in fronts.values():
            proc.terminate()
    print(f"\n1. {args.requests} streamed completions per mode, 16 new tokens, concurrency {args.concurrency}, "
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
              f"{sum(r['failed'] for r in rows[mode])} | {captured} |", flush=True)


# -- 2. the front's responsiveness -------------------------------------------------------------


def post(port: int, body: bytes) -> int:
    """One completion request, its answer read whole: its status (0: no answer)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException):
        return 0
    finally:
        conn.close()


def send_at_rate(port: int, bodies: list[bytes], rate: float, seconds: float) -> Counter[int]:
    """``rate * seconds`` requests, each started at its time by HEALTH_CONCURRENCY threads: their statuses."""
    total = max(1, int(rate * seconds))
    start = time.monotonic()

    def one(index: int) -> int:
        time.sleep(max(0.0, start + index / rate - time.monotonic()))
        return post(port, bodies[index % len(bodies)])

    with concurrent.futures.ThreadPoolExecutor(HEALTH_CONCURRENCY) as pool:
        return Counter(pool.map(one, range(total)))


def flush(port: int) -> float:
    """``POST /capture/flush``: how long it took (ms)."""
    started = time.perf_counter()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/capture/flush", data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=120) as resp:
        resp.read()
    return (time.perf_counter() - started) * 1000


def flushing(port: int, every_s: float, stop: threading.Event, times: list[float]) -> None:
    """``POST /capture/flush`` each ``every_s`` after the last one returned, and once more when
    ``stop`` is set (what the last requests left is scrubbed while the probe still runs)."""
    while True:
        last = stop.is_set()
        times.append(flush(port))
        if last:
            return
        stop.wait(every_s)


def health_round(port: int, bodies: list[bytes] | None, args: argparse.Namespace) -> dict[str, Any]:
    """One mode's window: the probe, the flushes and (``bodies``) the clients, together."""
    prober = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--probe", str(port), "--probe-seconds",
                               str(args.health_seconds + PROBE_TAIL_S)], stdout=subprocess.PIPE, text=True)
    assert prober.stdout is not None
    if prober.stdout.readline().strip() != "ready":
        raise RuntimeError("the /health probe did not start")
    written = capture_stats(port).get("written", 0)
    stop, flushes = threading.Event(), list[float]()
    flusher = threading.Thread(target=flushing, args=(port, args.flush_every_s, stop, flushes))
    flusher.start()
    try:
        if bodies:
            statuses = send_at_rate(port, bodies, args.health_rps, args.health_seconds)
        else:
            statuses = Counter()
            time.sleep(args.health_seconds)
    finally:
        stop.set()
        flusher.join()
    probed = json.loads(prober.communicate(timeout=args.health_seconds + 120)[0].strip().splitlines()[-1])
    return {"health_ms": probed["ms"], "health_errors": probed["errors"], "statuses": statuses, "flush_ms": flushes,
            "written": capture_stats(port).get("written", 0) - written}


def responsiveness(args: argparse.Namespace, triton_url: str) -> None:
    bodies = {name: sized_bodies(size, 4, seed) for seed, (name, size) in enumerate(PROMPT_BYTES.items())}
    stub_port = free_port()
    stub = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--stub-engine", str(stub_port)],
                            cwd=REPO_ROOT)
    procs = [stub]
    try:
        wait_ready(f"http://127.0.0.1:{stub_port}/v2/health/ready", stub, "the stub engine")
        upstreams = {"engine": triton_url, "stub": f"http://127.0.0.1:{stub_port}"}
        ports = {name: free_port() for name in HEALTH_FRONTS}
        for name, (upstream, rate) in HEALTH_FRONTS.items():
            procs.append(start_front(ports[name], rate, upstreams[upstream]))
        for name in HEALTH_FRONTS:  # warm each front (its pool, request models, the engine's refusal path, S3)
            for body in bodies["150 KB"][:2]:
                post(ports[name], body)
            flush(ports[name])
        rows: dict[str, list[dict[str, Any]]] = {mode: [] for mode in HEALTH_MODES}
        for _ in range(args.health_rounds):
            for mode, (front, size) in HEALTH_MODES.items():
                rows[mode].append(health_round(ports[front], bodies[size] if size else None, args))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
    sizes = ", ".join(f"{name} {len(b[0]):,} bytes" for name, b in bodies.items())
    print(f"\n2. the front's GET /health every {PROBE_INTERVAL_S * 1000:g} ms for {args.health_seconds:g} s per mode "
          f"x {args.health_rounds} rounds (interleaved, pooled); clients {args.health_rps:g} requests/s, "
          f"{HEALTH_CONCURRENCY} at once (bodies: {sizes}); POST /capture/flush {args.flush_every_s:g} s after the "
          f"last returned; capture.max_field_chars cuts each field to 16,384; {os.cpu_count()} CPUs\n")
    print("| mode | /health probes | p50 ms | p99 ms | max ms | over 50 ms | requests by status | "
          "flushes: n, p50 / max ms | records written |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode, runs in rows.items():
        health = np.asarray([t for r in runs for t in r["health_ms"]])
        flushes = [t for r in runs for t in r["flush_ms"]]
        statuses: Counter[int] = sum((r["statuses"] for r in runs), Counter())
        errors = sum(r["health_errors"] for r in runs)
        print(f"| {mode} | {len(health)}" + (f" ({errors} failed)" if errors else "")
              + f" | {np.percentile(health, 50):.2f} | {np.percentile(health, 99):.2f} | {health.max():.1f} | "
              f"{np.mean(health > SLOW_MS):.2%} | {', '.join(f'{s}: {n}' for s, n in sorted(statuses.items())) or '-'} | "
              f"{len(flushes)}, {np.median(flushes):.1f} / {max(flushes):.1f} | {sum(r['written'] for r in runs)} |",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=600, help="1: per mode (0: part 1 skipped)")
    parser.add_argument("--concurrency", type=int, default=4, help="1: clients at once")
    parser.add_argument("--rounds", type=int, default=3, help="1: the modes take turns this many times")
    parser.add_argument("--health-seconds", type=float, default=20.0, help="2: per mode and round (0: part 2 skipped)")
    parser.add_argument("--health-rounds", type=int, default=2, help="2: the modes take turns this many times")
    parser.add_argument("--health-rps", type=float, default=4.0, help="2: the clients' requests a second")
    parser.add_argument("--flush-every-s", type=float, default=1.0,
                        help="2: POST /capture/flush again this long after the last one returned")
    parser.add_argument("--stub-engine", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--probe", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--probe-seconds", type=float, default=10.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stub_engine:
        return stub_engine(args.stub_engine)
    if args.probe:
        return probe(args.probe, args.probe_seconds)

    from tasks.lib.params import load_settings

    settings = load_settings()
    preset, vocab = settings.train.presets["cpu-tiny"], settings.tokenize.vocab_size
    with benchmark_stack(settings, "bench-capture") as (folder, env, name):
        os.environ.update(env)  # the fronts' stack, and STACK_DIR for SeaweedFS's pid
        tokenizer_uri, eval_text = make_tokenizer_and_eval_text(folder, vocab)
        version = register(name, tokenizer_uri, 1, preset, vocab)
        export = folder / "export"
        run_step("tasks.export", "--model-version", version, "--output", str(export), "--eval-set", str(eval_text),
                 "--no-mlflow", env=env)
        run_step("tasks.deploy", "canary", "--model-version", version, "--export", str(export), "--output",
                 str(folder / "deploy"), "--no-promote", env=env)
        documents = [json.loads(line)["text"] for line in eval_text.read_text().splitlines() if line]
        if args.requests > 0:
            request_latency(args, env["TRITON_URL"], documents)
        if args.health_seconds > 0:
            responsiveness(args, env["TRITON_URL"])


if __name__ == "__main__":
    main()
