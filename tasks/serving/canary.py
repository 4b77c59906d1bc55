"""Canary analysis: real traffic through the router, then canary compared with stable.

Two streams of traffic per step, both through the router's split: logits requests to
``/v2/models/llm/infer`` (below) and streamed greedy completions through the OpenAI-compatible
``/v1/completions`` (:func:`send_text_traffic`): what users of the text endpoint get, judged on
time to first token, inter-token latency, failed or cut streams, and text equal to the export's
PyTorch reference generations.

:func:`send_traffic` is a bounded load generator (fixed rate and duration, a new connection
per request, loopback only): it replays the export's parity inputs (windows of the held-out
evaluation text and the fixed prompts) and records, per response, the version that answered
(``X-Model-Version``), status, client-side latency, whether the logits were finite and whether
the next token equals the export's PyTorch reference.

:func:`judge_step` turns one step's samples into checks, as Kayenta does: the canary's error
rate, finite outputs and next-token agreement against absolute bounds, and its latency against
stable's over the same window with a one-sided Mann-Whitney U test (is the canary slower?)
plus a minimum effect size (median ratio), so noise alone never fails a canary and a
slightly-faster-or-slower model never does either.

Each check's verdict is pass, fail or inconclusive (as Argo Rollouts' analysis): too few samples,
or a latency slower than its "clearly fine" ratio but not past its "clearly bad" one, is
inconclusive; the step's verdict is the worst of its checks', and deploy analyses an
inconclusive step again on fresh traffic.

:func:`judge_shadow` judges the shadow stage: the same requests answered by stable (for the
user) and by the new version (a mirrored copy), paired by request id from the OpenAI front's
records, compared per request (errors, text, time to first token and inter-token latency by a
one-sided Wilcoxon signed-rank test on the paired differences).
"""

from __future__ import annotations

import http.client
import json
import math
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from tasks.config import CanarySettings
from tasks.lib import step, triton
from tasks.serving.contract import PAIR_HEADER

T = TypeVar("T")
PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"
Check = Callable[[str, "bool | str", float, float, str], None]


@dataclass
class Sample:
    version: int | None  # None: no version header (the router or the connection failed)
    ok: bool
    status: int
    latency_ms: float
    finite: bool
    agrees: bool
    sent_s: float  # time.monotonic() when the request left: windows of two streams can be compared


def _one_request(url: str, headers: dict[str, str], ids: np.ndarray[Any, Any], expected: list[int],
                 timeout_s: float, version: int | None = None) -> Sample:
    """POST one inference to ``url`` (a full infer URL); the answering version is the response's
    ``X-Model-Version``, else ``version`` (a stream sent to one version by its path)."""
    parsed = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port or 80, timeout=timeout_s)
    sent = time.monotonic()
    start = time.perf_counter()
    try:
        conn.request("POST", parsed.path, body=triton.infer_request(ids),
                     headers={"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        body = resp.read()
        latency = (time.perf_counter() - start) * 1000
        header = resp.getheader("X-Model-Version")
        answered = int(header) if header and header.isdigit() else version
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


def send_traffic(url: str, headers: dict[str, str], inputs: list[np.ndarray[Any, Any]], expected: list[list[int]],
                 rate_rps: float, duration_s: float, concurrency: int, timeout_s: float,
                 stop: threading.Event | None = None, version: int | None = None) -> list[Sample]:
    """``rate_rps * duration_s`` requests to ``url`` at a fixed rate (bounded in count and time)."""
    def one(index: int) -> Sample:
        pick = index % len(inputs)
        return _one_request(url, headers, inputs[pick], expected[pick], timeout_s, version)

    return at_rate(one, rate_rps, duration_s, concurrency, stop)


def at_rate(one: Callable[[int], T], rate_rps: float, duration_s: float, concurrency: int,
            stop: threading.Event | None = None) -> list[T]:
    """``one(i)`` for ``rate_rps * duration_s`` indices, each started at its time on the fixed
    rate by ``concurrency`` threads; those not started before ``stop`` is set (or the step is
    stopping: SIGTERM) are left out."""
    total = max(1, int(rate_rps * duration_s))
    start = time.monotonic()
    stop = stop or step.stopping

    def fire(index: int) -> T | None:
        delay = start + index / rate_rps - time.monotonic()
        if (delay > 0 and stop.wait(delay)) or stop.is_set() or step.stopping.is_set():
            return None
        return one(index)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
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


def one_stream(url: str, headers: dict[str, str], body: bytes, expected: str, timeout_s: float,
                version: int | None = None, request_id: str = "") -> TextSample:
    """POST one streamed completion to ``url`` (OpenAI ``/v1/completions``) and time its chunks."""
    sample = _one_stream(url, {**headers, PAIR_HEADER: request_id} if request_id else headers, body, expected,
                         timeout_s, version)
    sample.request_id, sample.expected = request_id, expected
    return sample


def _one_stream(url: str, headers: dict[str, str], body: bytes, expected: str, timeout_s: float,
                version: int | None) -> TextSample:
    parsed = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parsed.hostname or "127.0.0.1", parsed.port or 80, timeout=timeout_s)
    sent = time.monotonic()
    start = time.perf_counter()
    arrivals: list[float] = []
    text: list[str] = []
    answered = version
    try:
        conn.request("POST", parsed.path, body=body, headers={"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        header = resp.getheader("X-Model-Version")
        answered = int(header) if header and header.isdigit() else version
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


def text_requests(reference: dict[str, Any]) -> list[tuple[bytes, str]]:
    """Greedy streamed completions of the export's reference prompts, each as long as its
    reference continuation, with the text it must produce. They name no ``model``: the front
    serves one, whatever a deployment calls it."""
    requests = []
    for generation in reference.get("generations", []):
        body = {"prompt": generation["prompt"], "max_tokens": max(1, len(generation["tokens"])),
                "temperature": 0, "stream": True}
        requests.append((json.dumps(body).encode(), generation["text"]))
    return requests


def send_text_traffic(url: str, headers: dict[str, str], requests: list[tuple[bytes, str]], rate_rps: float,
                      duration_s: float, concurrency: int, timeout_s: float,
                      version: int | None = None, with_ids: bool = False) -> list[TextSample]:
    """``rate_rps * duration_s`` streamed completions at a fixed rate (bounded in count and time);
    ``with_ids``: each with a request id of its own."""
    if not requests or rate_rps <= 0:
        return []

    def one(index: int) -> TextSample:
        body, expected = requests[index % len(requests)]
        return one_stream(url, headers, body, expected, timeout_s, version, uuid.uuid4().hex if with_ids else "")

    return at_rate(one, rate_rps, duration_s, concurrency)


def with_engine_timings(samples: list[TextSample], records: list[dict[str, Any]]) -> None:
    """Each stream's engine figures, from the front's record of it (by request id and the
    version that answered)."""
    by_key = {(r["request_id"], r["version"]): r for r in records}
    for sample in samples:
        record = by_key.get((sample.request_id, sample.version))
        if record is not None:
            sample.engine_ttft_ms = float(record.get("engine_ttft_ms", math.nan))
            sample.engine_itl_ms = float(record.get("engine_itl_ms", math.nan))


def _finite(samples: list[TextSample], name: str) -> list[float]:
    return [v for s in samples if math.isfinite(v := getattr(s, name))]


CLIENT_TIMED = "as deploy's client received them"


def step_timings(mine: list[TextSample], theirs: list[TextSample], key: str,
                 wanted: int) -> tuple[list[float], list[float], str]:
    """The canary's and stable's figures of ``key`` (``ttft_ms``, ``itl_ms``) at a step, and how
    they were measured: by the engines themselves where both sides have ``wanted`` of them (what
    the versions did: at 100% the canary's engine holds every routed stream, users' included,
    while stable's holds deploy's baseline alone, and an identical copy's time to first token as
    deploy received it read 10.9x stable's: the two engines' queues for a slot), else as deploy's
    client received the chunks (an engine that does not time itself; a platform whose split
    keeps no records)."""
    engine = _finite(mine, f"engine_{key}"), _finite(theirs, f"engine_{key}")
    if min(len(engine[0]), len(engine[1])) >= wanted:
        return engine[0], engine[1], ENGINE_TIMED
    return _finite(mine, key), _finite(theirs, key), CLIENT_TIMED


def summarize_text(samples: list[TextSample], version: int | None) -> dict[str, Any]:
    mine = [s for s in samples if s.version == version]
    ok = [s for s in mine if s.ok]
    ttft, itl = np.asarray(_finite(ok, "ttft_ms")), np.asarray(_finite(ok, "itl_ms"))
    errors = [s.error or str(s.status) for s in mine if not s.ok]
    return {"version": version, "streams": len(mine), "errors": len(errors),
            "error_rate": _share(len(errors), len(mine)), "first_error": errors[0] if errors else "",
            "text_agreement": _share(sum(s.matches for s in ok), len(ok)),
            "ttft_p50_ms": _percentile(ttft, 50), "ttft_p99_ms": _percentile(ttft, 99),
            "itl_p50_ms": _percentile(itl, 50), "itl_p99_ms": _percentile(itl, 99),
            "engine_ttft_p50_ms": _percentile(_finite(ok, "engine_ttft_ms"), 50),
            "engine_itl_p50_ms": _percentile(_finite(ok, "engine_itl_ms"), 50)}


def judge_text(samples: list[TextSample], direct: list[TextSample], stable: int | None, canary: int, weight: float,
               params: CanarySettings, baseline_only: bool = False) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The text endpoint's checks for one step: enough streams, their error rate, text equal to
    the reference, and time to first token and inter-token latency against stable's (the same
    Mann-Whitney rule as the logits latency, on the engines' own figures where recorded:
    :func:`step_timings`); ``baseline_only``: stable's side is the streams sent straight to the
    fresh baseline, not those the route gave the long-running stable pods."""
    stable_side = direct if baseline_only else samples + direct
    canary_stats, stable_stats = summarize_text(samples, canary), summarize_text(stable_side, stable)
    checks: list[dict[str, Any]] = []
    check = _recorder(checks)

    n, wanted = canary_stats["streams"], params.text_min_samples
    check("text_samples", enough(n, wanted), n, wanted, f"{n} canary streams at {weight:g}%")
    check("stream_error_rate", canary_stats["error_rate"] <= params.max_error_rate, canary_stats["error_rate"],
          params.max_error_rate, f"{canary_stats['errors']} of {n} canary streams failed or were cut"
          + (f" (first: {canary_stats['first_error']})" if canary_stats["first_error"] else ""))
    check("text_agreement", canary_stats["text_agreement"] >= params.min_text_agreement,
          canary_stats["text_agreement"], params.min_text_agreement,
          f"{canary_stats['text_agreement']:.0%} of canary greedy completions equal the export's PyTorch reference")
    tests: dict[str, dict[str, Any]] = {}
    canary_ok = [s for s in samples if s.version == canary and s.ok]
    stable_ok = [s for s in stable_side if s.version == stable and s.ok]
    for key, label in (("ttft_ms", "time to first token"), ("itl_ms", "inter-token latency")):
        mine, theirs, measured = step_timings(canary_ok, stable_ok, key, wanted)
        if len(mine) >= wanted and len(theirs) >= wanted:
            tests[key] = {**judge_latency(check, key.removesuffix("_ms"), label, mine, theirs,
                                          params.text_max_latency_ratio, params, measured), "measured": measured}
        elif stable is not None and len(theirs) < wanted:  # (a canary short of samples: text_samples)
            check(f"stable_{key.removesuffix('_ms')}_samples", INCONCLUSIVE, len(theirs), wanted,
                  f"{len(theirs)} stable streams with a {label} at {weight:g}%: no baseline to compare with")
    return {"canary": canary_stats, "stable": stable_stats, "direct_to_stable": len(direct), "tests": tests}, checks


def pair_records(sent: list[TextSample], records: list[dict[str, Any]], stable: int,
                 shadow: int) -> list[dict[str, Any]]:
    """Per request sent in the shadow stage: what the user got (``user``), the front's record of
    stable's answer and of the shadow's copy (None: not recorded), the reference text."""
    by_key = {(r["request_id"], r["version"]): r for r in records}
    return [{"request_id": s.request_id, "expected": s.expected, "user": s,
             "stable": by_key.get((s.request_id, stable)), "shadow": by_key.get((s.request_id, shadow))}
            for s in sent if s.request_id]


def paired_test(shadow_ms: list[float], stable_ms: list[float]) -> dict[str, float]:
    """One-sided Wilcoxon signed-rank on the per-request differences (shadow - stable): small p
    means the shadow is slower on the same requests. ``median_ratio``: of the two medians."""
    from scipy.stats import wilcoxon

    differences = np.asarray(shadow_ms) - np.asarray(stable_ms)
    p_value = 1.0 if not np.any(differences) else float(wilcoxon(differences, alternative="greater").pvalue)
    return {"p_value": p_value, "median_difference_ms": float(np.median(differences)),
            "median_ratio": float(np.median(shadow_ms)) / max(float(np.median(stable_ms)), 1e-9)}


ENGINE_TIMED, FRONT_TIMED = "as the engines timed them", "as the chunks reached the front"


def paired_timings(both: list[dict[str, Any]], key: str, wanted: int) -> tuple[list[tuple[float, float]], str]:
    """``(shadow, stable)`` figures of ``key`` per request, and how they were measured: by the
    two engines themselves where both answers carry their timings (what the versions did,
    whatever delays the chunks on their way: a front busy with other streams read stable's in
    bursts, and an identical copy once looked 34x slower between tokens), else as the chunks
    reached the front (versions whose engine does not time itself)."""
    def finite_pairs(name: str) -> list[tuple[float, float]]:
        values = [(p["shadow"].get(name, math.nan), p["stable"].get(name, math.nan)) for p in both]
        return [(a, b) for a, b in values if math.isfinite(a) and math.isfinite(b)]

    engine = finite_pairs(f"engine_{key}")
    return (engine, ENGINE_TIMED) if len(engine) >= wanted else (finite_pairs(key), FRONT_TIMED)


def token_agreement(mine: list[str], theirs: list[str]) -> tuple[float, int]:
    """The share of the longer answer's chunks (tokens) in the two answers' common prefix, and
    the index of the first differing chunk (the length of the prefix)."""
    prefix = 0
    while prefix < min(len(mine), len(theirs)) and mine[prefix] == theirs[prefix]:
        prefix += 1
    return prefix / max(len(mine), len(theirs), 1), prefix


def judge_shadow(pairs: list[dict[str, Any]], stable: int, shadow: int, params: CanarySettings) -> dict[str, Any]:
    """The shadow stage's checks on requests whose user got stable's answer: the copies'
    errors (a copy never recorded counts as one), their text against the new version's own
    reference, agreement with stable's answer (exact and token by token), and time to first
    token and inter-token latency compared request by request (:func:`paired_test`)."""
    served = [p for p in pairs if p["stable"] is not None and p["stable"]["ok"]]
    dropped = [p for p in served if p["shadow"] is not None and p["shadow"]["error"].startswith("dropped")]
    judged = [p for p in served if p not in dropped]  # a copy the front never ran tells nothing of the shadow
    copies = [p["shadow"] for p in judged if p["shadow"] is not None and p["shadow"]["ok"]]
    failures = [p["shadow"]["error"] or str(p["shadow"]["status"]) if p["shadow"] else "no answer recorded"
                for p in judged if p["shadow"] is None or not p["shadow"]["ok"]]
    both = [p for p in judged if p["shadow"] is not None and p["shadow"]["ok"]]
    texts = ["".join(c["chunks"]) for c in copies]
    same = [token_agreement(p["shadow"]["chunks"], p["stable"]["chunks"]) for p in both]
    checks: list[dict[str, Any]] = []
    check = _recorder(checks)
    wanted = params.text_min_samples
    unrecorded = sum(p["stable"] is None for p in pairs)
    check("shadow_samples", enough(len(judged), wanted), len(judged), wanted,
          f"{len(judged)} requests answered by stable and copied to the shadow"
          + (f" ({unrecorded} of {len(pairs)} sent have no record of stable's answer)" if unrecorded else "")
          + (f" ({len(dropped)} copies dropped by the front: too many in flight)" if dropped else ""))
    error_rate = _share(len(failures), len(judged))
    check("shadow_error_rate", error_rate <= params.max_error_rate, error_rate, params.max_error_rate,
          f"{len(failures)} of {len(judged)} shadow copies failed" + (f" (first: {failures[0]})" if failures else ""))
    # without answers to compare, agreement is unknown: inconclusive, not 0%
    reference = _share(sum(t == p["expected"] for t, p in zip(texts, both, strict=True)), len(both))
    check("shadow_text_agreement", reference >= params.min_text_agreement if both else INCONCLUSIVE, reference,
          params.min_text_agreement,
          f"{reference:.0%} of the shadow's {len(both)} greedy completions equal its export's PyTorch reference")
    exact = _share(sum("".join(p["shadow"]["chunks"]) == "".join(p["stable"]["chunks"]) for p in both), len(both))
    check("shadow_stable_agreement", exact >= params.shadow_min_stable_agreement if both else INCONCLUSIVE, exact,
          params.shadow_min_stable_agreement, f"{exact:.0%} of the shadow's answers equal stable's to the same request")
    tests: dict[str, dict[str, Any]] = {}
    for key, label in (("ttft_ms", "time to first token"), ("itl_ms", "inter-token latency")):
        paired, measured = paired_timings(both, key, wanted)
        name = f"shadow_{key.removesuffix('_ms')}"
        if len(paired) < wanted:
            check(name, INCONCLUSIVE, len(paired), wanted, f"{len(paired)} paired {label}s: too few to compare")
            continue
        test = tests[key] = {**paired_test([a for a, _ in paired], [b for _, b in paired]), "measured": measured}
        check(name, latency_verdict(test, params.text_max_latency_ratio, params), test["median_ratio"],
              params.text_max_latency_ratio,
              f"median {label} {test['median_ratio']:.2f}x stable's on the same {len(paired)} requests, "
              f"{measured} (Wilcoxon signed-rank p={test['p_value']:.2g}, alpha {params.latency_alpha})")
    users = [p["user"] for p in pairs]

    def side(records: list[dict[str, Any]]) -> dict[str, float]:
        def finite(key: str) -> np.ndarray[Any, Any]:
            return np.asarray([v for r in records if math.isfinite(v := r.get(key, math.nan))])

        ttft, itl = finite("ttft_ms"), finite("itl_ms")
        return {"ttft_p50_ms": _percentile(ttft, 50), "ttft_p99_ms": _percentile(ttft, 99),
                "itl_p50_ms": _percentile(itl, 50), "itl_p99_ms": _percentile(itl, 99),
                "engine_ttft_p50_ms": _percentile(finite("engine_ttft_ms"), 50),
                "engine_itl_p50_ms": _percentile(finite("engine_itl_ms"), 50)}

    return {"stage": "shadow", "weight": 0.0, "stable_version": stable, "shadow_version": shadow,
            "requests": len(pairs), "served": len(judged), "copies_ok": len(copies), "shadow_errors": len(failures),
            "copies_dropped": len(dropped),
            "stable": side([p["stable"] for p in both]), "shadow": side([p["shadow"] for p in both]),
            "agreement": {"reference": reference, "stable_exact": exact,
                          "stable_tokens": float(np.mean([a for a, _ in same])) if same else math.nan,
                          "first_divergence_median": float(np.median([i for _, i in same])) if same else math.nan},
            "users": {"requests": len(users), "errors": sum(not u.ok for u in users),
                      "ttft_p50_ms": _percentile(np.asarray([u.ttft_ms for u in users if u.ok and math.isfinite(u.ttft_ms)]),
                                                 50)},
            "paired_tests": tests, "checks": checks, **verdict_of(checks)}


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


def _share(count: int, of: int) -> float:
    return count / of if of else 0.0


def _percentile(values: Any, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def _recorder(checks: list[dict[str, Any]]) -> Check:
    """``check(name, verdict, value, limit, detail)`` appending to ``checks``; ``verdict``: one
    of PASS, FAIL, INCONCLUSIVE, or a bool (pass or fail)."""
    def check(name: str, verdict: bool | str, value: float, limit: float, detail: str) -> None:
        if isinstance(verdict, bool | np.bool_):
            verdict = PASS if verdict else FAIL
        checks.append({"check": name, "verdict": verdict, "passed": verdict == PASS, "value": value, "limit": limit,
                       "detail": detail})

    return check


def enough(count: int, wanted: int) -> str:
    """Too few samples tell nothing either way: inconclusive, not failed."""
    return PASS if count >= wanted else INCONCLUSIVE


def verdict_of(checks: list[dict[str, Any]]) -> dict[str, Any]:
    """The worst of the checks' verdicts, and the reasons of those that did not pass (failed first)."""
    verdicts = {c["verdict"] for c in checks}
    verdict = FAIL if FAIL in verdicts else INCONCLUSIVE if INCONCLUSIVE in verdicts else PASS
    not_passed = sorted((c for c in checks if c["verdict"] != PASS), key=lambda c: c["verdict"] != FAIL)
    return {"verdict": verdict, "passed": verdict == PASS,
            "failed": [f"{c['check']}: {c['detail']} (limit {c['limit']:g})"
                       + ("" if c["verdict"] == FAIL else ": inconclusive") for c in not_passed]}


def summarize(samples: list[Sample], version: int | None) -> dict[str, Any]:
    mine = [s for s in samples if s.version == version]
    latencies = np.asarray([s.latency_ms for s in mine if s.ok]) if mine else np.asarray([])
    ok = [s for s in mine if s.ok]

    def pct(q: float) -> float:
        return _percentile(latencies, q)

    return {"version": version, "requests": len(mine), "errors": len(mine) - len(ok),
            "error_rate": _share(len(mine) - len(ok), len(mine)),
            "non_finite": sum(not s.finite for s in ok), "agreement": _share(sum(s.agrees for s in ok), len(ok)),
            "p50_ms": pct(50), "p90_ms": pct(90), "p99_ms": pct(99)}


def latency_test(canary_ms: list[float], baseline_ms: list[float]) -> dict[str, float]:
    """One-sided Mann-Whitney U: small p means the canary's latencies are stochastically larger."""
    from scipy.stats import mannwhitneyu

    test = mannwhitneyu(canary_ms, baseline_ms, alternative="greater")
    return {"u": float(test.statistic), "p_value": float(test.pvalue),
            "median_ratio": float(np.median(canary_ms)) / max(float(np.median(baseline_ms)), 1e-9)}


def latency_verdict(test: dict[str, float], max_ratio: float, params: CanarySettings) -> str:
    """Pass unless slower (p < alpha) by more than ``max_ratio``; fail past ``max_ratio`` times
    ``clearly_slower_factor``; inconclusive between the two."""
    if test["p_value"] >= params.latency_alpha or test["median_ratio"] <= max_ratio:
        return PASS
    return FAIL if test["median_ratio"] > max_ratio * params.clearly_slower_factor else INCONCLUSIVE


def judge_latency(check: Check, name: str, label: str, canary_ms: list[float], baseline_ms: list[float],
                  max_ratio: float, params: CanarySettings, measured: str = "") -> dict[str, float]:
    """``name``'s verdict (:func:`latency_verdict`) on the canary's latencies against stable's
    (Mann-Whitney U; ``measured``: how they were timed, for the detail); returns the test."""
    test = latency_test(canary_ms, baseline_ms)
    check(name, latency_verdict(test, max_ratio, params), test["median_ratio"], max_ratio,
          f"median {label} {test['median_ratio']:.2f}x stable's{', ' + measured if measured else ''} "
          f"(Mann-Whitney U p={test['p_value']:.2g}, alpha {params.latency_alpha})")
    return test


TRITON_TIMED = "compute time per request as Triton timed it, per interval"


def logits_timings(samples: list[Sample], stable_side: list[Sample], stable: int | None, canary: int,
                   compute: dict[int, list[float]] | None, wanted: int) -> tuple[list[float], list[float], str]:
    """The canary's and stable's logits figures, and how they were measured: each version's
    compute time per request as Triton timed it over the step's intervals (``compute``: Kayenta
    compares metric series so), where both have ``wanted`` intervals; else the latencies as
    deploy's client received them. On 2 busy cores the latency is mostly the wait in each
    version's queue: an identical copy read 3.2x stable's latency with equal compute times (queue
    271 vs 171 ms, compute 34.9 vs 32.7 ms per request)."""
    series = compute or {}
    if stable is not None and min(len(series.get(canary, [])), len(series.get(stable, []))) >= wanted:
        return series[canary], series[stable], TRITON_TIMED
    return ([s.latency_ms for s in samples if s.version == canary and s.ok],
            [s.latency_ms for s in stable_side if s.version == stable and s.ok], CLIENT_TIMED)


def judge_step(samples: list[Sample], direct: list[Sample], stable: int | None, canary: int, weight: float,
               params: CanarySettings, text: list[TextSample] | None = None,
               text_direct: list[TextSample] | None = None, baseline_only: bool = False,
               compute: dict[int, list[float]] | None = None) -> dict[str, Any]:
    """One step's summary and checks (``passed`` False when any failed): ``samples`` came through
    the router, ``direct`` went straight to stable in the same window (see :func:`split_rates`);
    the canary's latencies are compared with all of stable's, or (``baseline_only``: a fresh
    baseline of stable beside the canary) with the baseline's alone; ``compute``: per version,
    Triton's compute time per request in each interval of the window (:func:`logits_timings`).
    ``text``/``text_direct``: the streamed completions of the same window (:func:`judge_text`)."""
    stable_side = direct if baseline_only else samples + direct
    canary_stats, stable_stats = summarize(samples, canary), summarize(stable_side, stable)
    unrouted = [s for s in samples if s.version is None]
    canary_ms, baseline_ms, measured = logits_timings(samples, stable_side, stable, canary, compute,
                                                      params.min_samples)
    checks: list[dict[str, Any]] = []
    check = _recorder(checks)
    n = canary_stats["requests"]
    check("canary_samples", enough(n, params.min_samples), n, params.min_samples,
          f"{n} canary requests at {weight:g}%")
    check("error_rate", canary_stats["error_rate"] <= params.max_error_rate, canary_stats["error_rate"],
          params.max_error_rate, f"{canary_stats['errors']} of {n} canary requests failed")
    check("finite_logits", canary_stats["non_finite"] == 0, canary_stats["non_finite"], 0,
          f"{canary_stats['non_finite']} canary responses had NaN/inf logits")
    check("next_token_agreement", canary_stats["agreement"] >= params.min_agreement, canary_stats["agreement"],
          params.min_agreement, f"{canary_stats['agreement']:.1%} of canary next tokens equal the export reference")
    latency: dict[str, Any] = {}
    if len(canary_ms) >= params.min_samples and len(baseline_ms) >= params.min_samples:
        latency = {**judge_latency(check, "latency", "latency", canary_ms, baseline_ms, params.max_latency_ratio,
                                   params, measured), "measured": measured}
    elif stable is not None:
        check("stable_samples", INCONCLUSIVE, len(baseline_ms), params.min_samples,
              f"{len(baseline_ms)} stable latencies at {weight:g}%: no baseline to compare the canary with")
    text_report: dict[str, Any] = {}
    if text is not None:
        text_report, text_checks = judge_text(text, text_direct or [], stable, canary, weight, params, baseline_only)
        checks += text_checks
    return {"weight": weight, "canary": canary_stats, "stable": stable_stats, "unrouted": len(unrouted),
            "direct_to_stable": len(direct), "baseline": "fresh" if baseline_only else "stable", "text": text_report,
            "latency_test": latency, "checks": checks, **verdict_of(checks)}


def plot_report(report: dict[str, Any], path: Any) -> None:
    """The shadow (paired TTFT and inter-token latency p50, stable vs the new version, its
    verdict) and, per step: requests by version, p50/p99 latency of canary vs stable, and the
    text endpoint's TTFT/ITL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, shadow = report.get("steps") or [], report.get("shadow") or []
    panels = (1 if shadow else 0) + (3 if steps else 0)
    fig, grid = plt.subplots(1, max(panels, 1), figsize=(5 * max(panels, 1), 4), squeeze=False)
    axes: list[Any] = list(grid[0])
    if shadow:
        plot_shadow(axes.pop(0), shadow[-1])
    if steps:
        plot_steps(axes[0], axes[1], axes[2], report)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_shadow(ax: Any, shadow: dict[str, Any]) -> None:
    figures = ("ttft_p50_ms", "itl_p50_ms")
    x = np.arange(len(figures))
    ax.bar(x - 0.2, [shadow["stable"][f] for f in figures], 0.4, label=f"stable v{shadow['stable_version']}")
    ax.bar(x + 0.2, [shadow["shadow"][f] for f in figures], 0.4, label=f"shadow v{shadow['shadow_version']}")
    ax.set_xticks(x, ["TTFT p50", "ITL p50"])
    ax.set_ylabel("ms (same requests, paired)")
    agreement = shadow["agreement"]
    ax.set_title(f"shadow: {shadow['verdict']}; {shadow['served']} pairs, {shadow['shadow_errors']} failed copies\n"
                 f"text = reference {agreement['reference']:.0%}, = stable's {agreement['stable_exact']:.0%}",
                 fontsize=9)
    ax.legend()


def plot_steps(left: Any, right: Any, text: Any, report: dict[str, Any]) -> None:
    steps = report["steps"]
    labels = [f"{s['weight']:g}%" + (f" #{s['analysis']}" if s.get("analysis", 1) > 1 else "") for s in steps]
    x = np.arange(len(steps))
    left.bar(x - 0.2, [s["stable"]["requests"] for s in steps], 0.4, label=f"stable v{report['stable']}")
    left.bar(x + 0.2, [s["canary"]["requests"] for s in steps], 0.4, label=f"canary v{report['canary']}")
    left.set_xticks(x, labels)
    left.set_title("requests per version; " + ", ".join(f"{lab} {s.get('verdict', '')}"
                                                        for lab, s in zip(labels, steps, strict=True)), fontsize=9)
    left.legend()
    for who, style in (("stable", "-"), ("canary", "--")):
        right.plot(x, [s[who]["p50_ms"] for s in steps], style, marker="o", label=f"{who} p50")
        right.plot(x, [s[who]["p99_ms"] for s in steps], style, marker="x", label=f"{who} p99")
    right.set_xticks(x, labels)
    right.set_ylabel("ms")
    right.set_title(f"latency; verdict: {report['verdict']}")
    right.legend()
    for who, style in (("stable", "-"), ("canary", "--")):
        text.plot(x, [s.get("text", {}).get(who, {}).get("ttft_p50_ms", math.nan) for s in steps], style, marker="o",
                  label=f"{who} TTFT p50")
        text.plot(x, [s.get("text", {}).get(who, {}).get("itl_p50_ms", math.nan) for s in steps], style, marker="x",
                  label=f"{who} ITL p50")
    text.set_xticks(x, labels)
    text.set_ylabel("ms")
    text.set_title("text endpoint (streamed completions)")
    text.legend()


def sent_span(samples: list[Sample], since: float) -> list[float]:
    """When a stream's first and last requests left, in seconds after ``since``: the report shows
    that a step's streams ran in the same window."""
    sent = [s.sent_s - since for s in samples]
    return [round(min(sent), 2), round(max(sent), 2)] if sent else []
