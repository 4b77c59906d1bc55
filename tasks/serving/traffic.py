"""The canary's traffic: bounded load generators and what each request got.

Two streams of traffic per step, both through the router's split: logits requests to
``/v2/models/llm/infer`` (:func:`send_traffic`) and streamed greedy completions through the
OpenAI-compatible ``/v1/completions`` (:func:`send_text_traffic`): what users of the text
endpoint get. Each generator sends at a fixed rate for a fixed time (a new connection per
request, loopback only) and records, per response, the version that answered
(``X-Model-Version``), status, client-side timings, and whether the answer equals the export's
PyTorch reference (the next token; the greedy continuation of its prompt).

:mod:`tasks.serving.analysis` judges these samples; this module only sends and records.
"""

from __future__ import annotations

import http.client
import json
import math
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from tasks.config import CanarySettings
from tasks.lib import step, triton
from tasks.serving.contract import PAIR_HEADER

T = TypeVar("T")


@dataclass(frozen=True)
class Target:
    """Where requests go: a URL, the headers that reach the right backend, and the version it
    serves (None: the router's split picks one per request, named by ``X-Model-Version``)."""

    url: str
    headers: Mapping[str, str] = field(default_factory=dict)
    version: int | None = None


@dataclass(frozen=True)
class Load:
    """A bounded load: ``rate_rps`` requests a second for ``duration_s``, at most ``concurrency``
    at once, each given ``timeout_s``."""

    rate_rps: float
    duration_s: float
    concurrency: int
    timeout_s: float


@dataclass(frozen=True)
class LogitsRequests:
    """The export's parity inputs (windows of held-out text, fixed prompts) and the next tokens
    its PyTorch reference gives each."""

    inputs: list[np.ndarray[Any, Any]]
    expected: list[list[int]]

    @classmethod
    def of(cls, reference: Mapping[str, Any]) -> LogitsRequests:
        return cls([np.asarray(ids, dtype=np.int64) for ids in reference["inputs"]], reference["next_tokens"])


@dataclass
class Sample:
    version: int | None  # None: no version header (the router or the connection failed)
    ok: bool
    status: int
    latency_ms: float
    finite: bool
    agrees: bool
    sent_s: float  # time.monotonic() when the request left: windows of two streams can be compared


def one_request(target: Target, ids: np.ndarray[Any, Any], expected: list[int], timeout_s: float) -> Sample:
    """POST one inference to ``target`` (a full infer URL); the answering version is the
    response's ``X-Model-Version``, else the target's (a stream sent to one version by its path)."""
    parsed = urllib.parse.urlsplit(target.url)
    conn = http.client.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port or 80, timeout=timeout_s)
    sent = time.monotonic()
    start = time.perf_counter()
    try:
        conn.request("POST", parsed.path, body=triton.infer_request(ids),
                     headers={"Content-Type": "application/json", **target.headers})
        resp = conn.getresponse()
        body = resp.read()
        latency = (time.perf_counter() - start) * 1000
        header = resp.getheader("X-Model-Version")
        answered = int(header) if header and header.isdigit() else target.version
        if resp.status != 200:
            return Sample(answered, False, resp.status, latency, False, False, sent)
        length = resp.getheader("Inference-Header-Content-Length")
        logits, next_tokens = triton.parse_infer_response(body, int(length) if length else None)
        return Sample(answered, True, 200, latency, bool(np.isfinite(logits).all()),
                      next_tokens.tolist() == list(expected), sent)
    except (OSError, http.client.HTTPException, ValueError, KeyError):
        return Sample(None, False, 0, (time.perf_counter() - start) * 1000, False, False, sent)
    finally:
        conn.close()


def send_traffic(target: Target, requests: LogitsRequests, load: Load,
                 stop: threading.Event | None = None) -> list[Sample]:
    """``rate_rps * duration_s`` requests to ``target`` at a fixed rate (bounded in count and time)."""
    def one(index: int) -> Sample:
        pick = index % len(requests.inputs)
        return one_request(target, requests.inputs[pick], requests.expected[pick], load.timeout_s)

    return at_rate(one, load, stop)


def at_rate(one: Callable[[int], T], load: Load, stop: threading.Event | None = None) -> list[T]:
    """``one(i)`` for ``rate_rps * duration_s`` indices, each started at its time on the fixed
    rate by ``concurrency`` threads; those not started before ``stop`` is set (or the step is
    stopping: SIGTERM) are left out."""
    total = max(1, int(load.rate_rps * load.duration_s))
    start = time.monotonic()
    stop = stop or step.stopping

    def fire(index: int) -> T | None:
        delay = start + index / load.rate_rps - time.monotonic()
        if (delay > 0 and stop.wait(delay)) or stop.is_set() or step.stopping.is_set():
            return None
        return one(index)

    with ThreadPoolExecutor(max_workers=load.concurrency) as pool:
        results = list(pool.map(fire, range(total)))
    return [r for r in results if r is not None]


@dataclass
class TextSample:
    """One streamed completion."""

    version: int | None
    ok: bool  # HTTP 200, no error event, ended with [DONE]
    status: int
    ttft_ms: float  # request sent -> first text chunk
    itl_ms: float  # mean gap between text chunks after the first (nan with one chunk)
    chunks: int
    matches: bool  # the text equals the reference continuation of its prompt
    sent_s: float
    error: str = ""
    request_id: str = ""  # sent in X-Shadow-Pair (the front records the answer under it)
    expected: str = ""  # the reference continuation of its prompt
    # the answering engine's own time to first token (from taking a slot) and mean gap between
    # tokens, from the front's record of this request (NaN: not recorded, or not timed)
    engine_ttft_ms: float = math.nan
    engine_itl_ms: float = math.nan


def one_stream(target: Target, body: bytes, expected: str, timeout_s: float, request_id: str = "") -> TextSample:
    """POST one streamed completion to ``target`` (OpenAI ``/v1/completions``) and time its chunks."""
    headers = {**target.headers, PAIR_HEADER: request_id} if request_id else dict(target.headers)
    sample = _one_stream(Target(target.url, headers, target.version), body, expected, timeout_s)
    sample.request_id, sample.expected = request_id, expected
    return sample


def _one_stream(target: Target, body: bytes, expected: str, timeout_s: float) -> TextSample:
    parsed = urllib.parse.urlsplit(target.url)
    conn = http.client.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port or 80, timeout=timeout_s)
    sent = time.monotonic()
    start = time.perf_counter()
    arrivals: list[float] = []
    text: list[str] = []
    answered = target.version
    try:
        conn.request("POST", parsed.path, body=body, headers={"Content-Type": "application/json", **target.headers})
        resp = conn.getresponse()
        header = resp.getheader("X-Model-Version")
        answered = int(header) if header and header.isdigit() else target.version
        if resp.status != 200:
            detail = resp.read()[:200].decode(errors="replace")
            return TextSample(answered, False, resp.status, math.nan, math.nan, 0, False, sent, detail)
        done = False
        for line in resp:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                break
            event = json.loads(payload)
            if "error" in event:
                return TextSample(answered, False, 200, math.nan, math.nan, len(arrivals), False, sent,
                                  str(event["error"])[:200])
            piece = "".join(choice.get("text", "") for choice in event.get("choices", []))
            if piece:
                arrivals.append(time.perf_counter())
                text.append(piece)
        if not done:
            return TextSample(answered, False, 200, math.nan, math.nan, len(arrivals), False, sent, "stream cut")
        ttft = (arrivals[0] - start) * 1000 if arrivals else math.nan
        itl = (arrivals[-1] - arrivals[0]) * 1000 / (len(arrivals) - 1) if len(arrivals) > 1 else math.nan
        return TextSample(answered, True, 200, ttft, itl, len(arrivals), "".join(text) == expected, sent)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return TextSample(answered, False, 0, math.nan, math.nan, len(arrivals), False, sent, type(exc).__name__)
    finally:
        conn.close()


def text_requests(reference: Mapping[str, Any], model: str | None = None) -> list[tuple[bytes, str]]:
    """Greedy streamed completions of the export's reference prompts, each as long as its
    reference continuation, with the text it must produce. They name ``model`` (default: the model
    line this process runs for, by its registered name; none for the demo line, the API's model
    of a request that names none, whatever a deployment calls it): one API serves every line."""
    if model is None:
        from tasks.config import DEMO, current_line
        from tasks.lib.params import load_settings

        model = None if current_line() == DEMO else load_settings().pipeline.model_name
    requests = []
    for generation in reference.get("generations", []):
        body = {"prompt": generation["prompt"], "max_tokens": max(1, len(generation["tokens"])),
                "temperature": 0, "stream": True, **({"model": model} if model else {})}
        requests.append((json.dumps(body).encode(), generation["text"]))
    return requests


def send_text_traffic(target: Target, requests: list[tuple[bytes, str]], load: Load,
                      with_ids: bool = False) -> list[TextSample]:
    """``rate_rps * duration_s`` streamed completions at a fixed rate (bounded in count and time);
    ``with_ids``: each with a request id of its own."""
    if not requests or load.rate_rps <= 0:
        return []

    def one(index: int) -> TextSample:
        body, expected = requests[index % len(requests)]
        return one_stream(target, body, expected, load.timeout_s, uuid.uuid4().hex if with_ids else "")

    return at_rate(one, load)


def with_engine_timings(samples: list[TextSample], records: list[dict[str, Any]]) -> None:
    """Each stream's engine figures, from the front's record of it (by request id and the
    version that answered)."""
    by_key = {(r["request_id"], r["version"]): r for r in records}
    for sample in samples:
        record = by_key.get((sample.request_id, sample.version))
        if record is not None:
            sample.engine_ttft_ms = float(record.get("engine_ttft_ms", math.nan))
            sample.engine_itl_ms = float(record.get("engine_itl_ms", math.nan))


def pair_records(sent: list[TextSample], records: list[dict[str, Any]], stable: int,
                 shadow: int) -> list[dict[str, Any]]:
    """Per request sent in the shadow stage: what the user got (``user``), the front's record of
    stable's answer and of the shadow's copy (None: not recorded), the reference text."""
    by_key = {(r["request_id"], r["version"]): r for r in records}
    return [{"request_id": s.request_id, "expected": s.expected, "user": s,
             "stable": by_key.get((s.request_id, stable)), "shadow": by_key.get((s.request_id, shadow))}
            for s in sent if s.request_id]


@dataclass
class StepTraffic:
    """One canary step's samples: logits requests and streamed completions, routed and direct
    (``text`` None: no streams sent, none judged)."""

    samples: list[Sample] = field(default_factory=list)
    direct: list[Sample] = field(default_factory=list)
    text: list[TextSample] | None = None
    text_direct: list[TextSample] = field(default_factory=list)
    compute: dict[int, list[float]] | None = None  # per version, Triton's compute ms per request per interval

    def enough(self, version: int, params: CanarySettings, baseline: int | None = None) -> bool:
        """The canary has its samples and (``baseline``: the version of a fresh baseline, judged
        alone) so has the baseline its direct ones."""
        def has(samples: list[Any], of: int, wanted: int) -> bool:
            return sum(s.version == of for s in samples) >= wanted

        canary_done = has(self.samples, version, params.min_samples) and has(self.text or [], version,
                                                                             params.text_min_samples)
        return canary_done and (baseline is None or (has(self.direct, baseline, params.min_samples)
                                                     and has(self.text_direct, baseline, params.text_min_samples)))


def split_rates(rate: float, wanted: float, weight: float, stable: int | None,
                duration_s: float, fresh_baseline: bool = False) -> tuple[float, float]:
    """``(routed, direct)``: the rates of the stream through the router and of the one sent
    straight to stable during a step. Where stable's routed share of a window gives it ``wanted``
    samples, all of ``rate`` is routed. Else (100%) stable gets, straight, the load the canary
    gets through the router, and the two together keep the step's load at ``rate``: a baseline
    from earlier steps read a change of the machine's load as a slower canary, and one of a fifth
    of the canary's rate read the canary's heavier load as a slower model (a better model rolled
    back in `make pipeline` at 2.51x stable's logits latency, 135 vs 54 ms; 2.2x its inter-token
    latency); adding the canary's rate on top doubled the step's load and the client's timing
    of it drifted (a good canary's inter-token latency read 2.8x stable's in the serving test).
    ``fresh_baseline`` (a baseline of stable beside the canary, at its size: the only stable side
    judged): at every weight, the baseline gets straight the load the canary gets routed."""
    routed_to_stable = rate * duration_s * (1 - weight / 100)
    if stable is None or (routed_to_stable >= wanted and not fresh_baseline):
        return rate, 0.0
    to_canary = weight / 100
    routed = rate / (1 + to_canary)
    return routed, routed * to_canary


def sent_span(samples: list[Sample], since: float) -> list[float]:
    """When a stream's first and last requests left, in seconds after ``since``: the report shows
    that a step's streams ran in the same window."""
    sent = [s.sent_s - since for s in samples]
    return [round(min(sent), 2), round(max(sent), 2)] if sent else []
