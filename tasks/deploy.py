"""Deploy an exported version to Triton behind the router: canary, then promote or roll back.

    python -m tasks.deploy canary --model-version N --export URI --output URI
    python -m tasks.deploy finish --model-version N --export URI --held URI --answer JSON --output URI
    python -m tasks.deploy release --held URI
    python -m tasks.deploy rollback --target previous|VERSION
    python -m tasks.deploy stage --model-version N --export URI --repository DIR   (cluster init container)

canary: version N is loaded beside the stable one (both READY, a smoke inference through
Triton and through the router). With ``canary.shadow`` it then shadows stable: the router
mirrors a copy of every ``/v1`` request to N (users get stable's answer only) while a bounded
generator sends the export's reference prompts, and :func:`canary.judge_shadow` compares the
two answers to each request (errors, text, TTFT and inter-token latency, paired). Only then
are the traffic steps of params.yaml ``canary.steps`` walked. At each step the router sends that share of real traffic (a bounded load generator
replaying held-out text) to N, and :mod:`tasks.serving.canary` compares N with stable on the same
window: error rate, finite logits, next-token agreement with the export's reference, latency
(Mann-Whitney U). Each check passes, fails or is inconclusive (too few samples, a latency
between its "clearly fine" and "clearly bad" ratios): an inconclusive step is analysed again on
fresh traffic, up to ``canary.max_analyses``, then fails. All pass at 100%: N becomes the only version served, the old one is unloaded,
and N becomes ``champion`` in the registry. Any check fails: the canary weight goes to 0 and
the router is reloaded FIRST, only then N is unloaded; the champion alias does not move; the
report is saved and the step exits 2 with one line naming the failed check (no retry).

With ``canary.approval.enabled`` (the DAG's approval Param) or ``required`` (a deployment's
setting, which a run cannot switch off) the walk holds before the step of weight
``approval.hold_before``, and at a stage still inconclusive after its analyses: traffic stays
where it is, the step exits 0 with verdict ``held``, and ``finish`` later carries out a
person's answer (Promote: the remaining steps, then promotion; Roll back; Extend: the held stage
analysed once more). ``release`` (the run's teardown) rolls back a hold nobody decided.

The first model ever has no stable to compare with: it is checked on its own at 100%. A version
trained on an older data window than the champion's (a backfill, a late retry) is not deployed
unless ``canary.deploy_older_data`` says so: one line, exit 99 (a gate: the task is skipped).
Idempotent: a retried or restarted deploy finds a leftover canary and rolls it back before
starting again from weight 0, or finds N already serving and only makes sure it is promoted.
Two deploys never run at once (a lock beside the router's configuration, or on the HTTPRoute).
Where versions are served and how traffic is split is :mod:`tasks.serving.platforms`'s concern: one
local Triton behind nginx, or in a cluster a Triton Deployment per track behind a Gateway API
HTTPRoute; this module only walks the rollout.

rollback (the ``llm_rollback`` DAG): loads the target version (an alias or a number) from its
export, moves all traffic to it, unloads the rest and makes it ``champion``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from tasks.config import CanarySettings, ServeSettings
from tasks.contract import DECISIONS, EXTEND, PROMOTE, ROLL_BACK
from tasks.lib import storage, triton
from tasks.lib.errors import GateRejected, StepError, Terminated, absent, first_line, registry_error
from tasks.lib.params import load_settings
from tasks.lib.polling import wait_until
from tasks.lib.registry import CHAMPION, PREVIOUS, alias_version, data_end, promote_version
from tasks.lib.step import log, raise_on_sigterm, run_step, step_parser
from tasks.lib.tracking import find_dag_run
from tasks.serving import canary
from tasks.serving.platforms import PromotionFailed, Serving, serving_platform, stage_version

HELD = "held"  # a rollout waiting for a person's decision


def smoke_test(serving: Serving, version: int, reference: dict[str, Any]) -> None:
    """Every reference input once straight through Triton (a smoke test that also warms the
    new version up: its first inferences of each shape are slow, and a cold canary would be
    judged slower than a warm stable), then one through the router; then each reference prompt
    as a streamed completion straight to the version's text endpoint (its engine warmed too)."""
    (direct, direct_headers), *routed = serving.smoke_targets(version)
    inputs = [np.asarray(ids, dtype=np.int64) for ids in reference["inputs"]]
    calls = [(direct, direct_headers, ids) for ids in inputs] + [(url, headers, inputs[0]) for url, headers in routed]
    for url, headers, ids in calls:
        infer_once(url, headers, ids, version)
    text_url, text_headers = serving.text_target(version)
    for body, _ in canary.text_requests(reference):
        sample = canary.one_stream(text_url, text_headers, body, "", 60.0, version)
        if not sample.ok:
            raise StepError(f"version {version}: smoke completion through {text_url} failed "
                            f"({sample.status} {sample.error})")


def infer_once(url: str, headers: dict[str, str], ids: np.ndarray[Any, Any], version: int) -> None:
    """One inference through ``url``: answered, with finite logits, or a StepError naming it."""
    request = urllib.request.Request(url, data=triton.infer_request(ids), method="POST",
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            length = resp.headers.get("Inference-Header-Content-Length")
            logits, _ = triton.parse_infer_response(resp.read(), int(length) if length else None)
    except OSError as exc:
        raise StepError(f"version {version}: smoke inference through {url} failed ({exc})") from None
    if not np.isfinite(logits).all():
        raise StepError(f"version {version}: smoke inference through {url} returned non-finite logits")


def warm_baseline(serving: Serving, stable: int, reference: dict[str, Any], params: CanarySettings) -> int:
    """A fresh baseline (a cluster's pod of stable started with the canary) warmed as the canary
    was, each reference input once and the warm-up streams: the two pods compared are of the
    same age and warm-up. Returns how many streams completed."""
    url, headers = serving.baseline_target(stable)
    for ids in reference["inputs"]:
        infer_once(url, headers, np.asarray(ids, dtype=np.int64), stable)
    return warm_up(serving, stable, reference, params)


def warm_up(serving: Serving, version: int, reference: dict[str, Any], params: CanarySettings) -> int:
    """``warmup_streams`` streamed completions straight to the new version at the canary's
    concurrency, after the smoke test and before any traffic moves: its engine decodes batches of
    every size once and its processes are running when the first step measures it (a canary just
    loaded was judged slower than the warm stable on time to first token). Their figures and
    outcomes are discarded: the steps judge. Returns how many completed."""
    url, headers = serving.text_target(version)
    samples = canary.send_text_traffic(url, headers, canary.text_requests(reference), float(params.warmup_streams), 1.0,
                                       params.concurrency, params.text_timeout_s, version)
    return sum(s.ok for s in samples)


RECORD_WAIT_S = 5.0  # the front records an answer just after its last chunk
# how often Triton's counters are read during a step: at 10% (~2.5 canary requests a second) about
# half the quarter-seconds have one, ~15 intervals a window (fewer than min_samples: the step's
# latency is judged as deploy's client received it, and the report says so)
COMPUTE_INTERVAL_S = 0.25


def metrics_delta(before: dict[int, dict[str, float]], after: dict[int, dict[str, float]]) -> dict[str, Any]:
    delta = {}
    for version, counters in after.items():
        old = before.get(version, {})
        change = {k: v - old.get(k, 0.0) for k, v in counters.items()}
        done = change.get("success", 0.0)
        change["avg_request_ms"] = change.get("duration_us", 0.0) / done / 1000 if done else float("nan")
        delta[str(version)] = change
    return delta


class ComputeSampler:
    """Triton's per-version counters read every ``interval_s`` while a step's traffic runs (a
    thread): per version, its compute time per request in each interval that had requests, the
    series :func:`canary.logits_timings` compares."""

    def __init__(self, serving: Serving, interval_s: float = COMPUTE_INTERVAL_S) -> None:
        self.serving, self.interval_s = serving, interval_s
        self.series: dict[int, list[float]] = {}
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.sample, name="compute-sampler", daemon=True)

    def __enter__(self) -> ComputeSampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join()

    def read(self) -> dict[int, dict[str, float]]:
        try:
            return self.serving.metrics()
        except Exception as exc:  # a missed read merges its interval into the next; the step goes on
            log.debug("Triton's metrics not read (%s)", first_line(exc))
            return {}

    def sample(self) -> None:
        last: dict[int, dict[str, float]] = {}
        while not last and not self.stopping.is_set():  # the first good read is the baseline
            last = self.read()
            if not last:
                self.stopping.wait(self.interval_s)
        while not self.stopping.wait(self.interval_s):
            now = self.read()
            if not now:
                continue
            for version, counters in now.items():
                before = last.get(version)
                done = counters.get("success", 0.0) - (before or {}).get("success", 0.0)
                if before is not None and done > 0:  # (a version first seen now: no baseline of its own)
                    self.series.setdefault(version, []).append(compute_ms(counters, before) / done)
            last = now


def compute_ms(now: dict[str, float], before: dict[str, float]) -> float:
    """Triton's time computing between two reads (ms): the model's input, execution and output."""
    return sum(now.get(k, 0.0) - before.get(k, 0.0) for k in ("compute_input_us", "compute_us", "compute_output_us")) / 1000


@dataclass
class StepTraffic:
    """One canary step's samples: logits requests and streamed completions, routed and direct."""

    samples: list[canary.Sample] = field(default_factory=list)
    direct: list[canary.Sample] = field(default_factory=list)
    text: list[canary.TextSample] = field(default_factory=list)
    text_direct: list[canary.TextSample] = field(default_factory=list)
    compute: dict[int, list[float]] | None = None  # per version, Triton's compute ms per request per interval

    def enough(self, version: int, params: CanarySettings, baseline: int | None = None) -> bool:
        """The canary has its samples and (``baseline``: the version of a fresh baseline, judged
        alone) so has the baseline its direct ones."""
        def has(samples: list[Any], of: int, wanted: int) -> bool:
            return sum(s.version == of for s in samples) >= wanted

        canary_done = has(self.samples, version, params.min_samples) and has(self.text, version, params.text_min_samples)
        return canary_done and (baseline is None or (has(self.direct, baseline, params.min_samples)
                                                     and has(self.text_direct, baseline, params.text_min_samples)))


def step_traffic(serving: Serving, serve: ServeSettings, params: CanarySettings, reference: dict[str, Any],
                 stable: int | None, version: int, weight: float) -> StepTraffic:
    """One canary step's traffic: windows through the router (repeated, up to ``max_windows``,
    until the canary has ``min_samples`` logits requests and ``text_min_samples`` streams) and,
    in the same windows, the streams straight to stable that :func:`canary.split_rates` asks
    for. Logits requests and streamed completions run side by side."""
    inputs = [np.asarray(ids, dtype=np.int64) for ids in reference["inputs"]]
    expected = reference["next_tokens"]
    texts = canary.text_requests(reference)
    routed_url, routed_text_url = serving.url + triton.infer_path(serve.triton_model), serving.url + "/v1/completions"
    rate, duration = params.rate_rps, params.step_duration_s
    concurrency, timeout = params.concurrency, params.request_timeout_s
    text_rate, text_timeout = params.text_rps, params.text_timeout_s
    fresh = serving.fresh_baseline
    rate, direct_rps = canary.split_rates(rate, params.min_samples, weight, stable, duration, fresh)
    text_rate, direct_text_rps = canary.split_rates(text_rate, params.text_min_samples, weight, stable, duration,
                                                    fresh)
    baseline_url, baseline_headers = serving.baseline_target(stable) if stable is not None else ("", {})
    text_url, text_headers = serving.text_target(stable) if stable is not None else ("", {})
    traffic = StepTraffic()
    sampler = ComputeSampler(serving) if serving.per_version_metrics else contextlib.nullcontext()
    with ThreadPoolExecutor(max_workers=3) as beside, sampler:
        for _ in range(params.max_windows):  # a small share may need more than one window
            baseline = beside.submit(canary.send_traffic, baseline_url, baseline_headers, inputs, expected,
                                     direct_rps, duration, concurrency, timeout, version=stable) if direct_rps else None
            text_baseline = beside.submit(canary.send_text_traffic, text_url, text_headers, texts, direct_text_rps,
                                          duration, concurrency, text_timeout, stable,
                                          with_ids=True) if direct_text_rps else None
            text = beside.submit(canary.send_text_traffic, routed_text_url, {}, texts, text_rate, duration,
                                 concurrency, text_timeout, with_ids=True)
            traffic.samples += canary.send_traffic(routed_url, {}, inputs, expected, rate, duration, concurrency, timeout)
            traffic.text += text.result()
            traffic.direct += baseline.result() if baseline is not None else []
            traffic.text_direct += text_baseline.result() if text_baseline is not None else []
            if traffic.enough(version, params, stable if fresh else None):
                break
    if isinstance(sampler, ComputeSampler):
        traffic.compute = sampler.series
    if stable is not None and serving.step_records:
        read_engine_timings(serving, traffic.text + traffic.text_direct, stable, version)
    return traffic


def recorded(serving: Serving, ids: list[str], stable: int, version: int, per_id: int,
             timeout_s: float) -> list[dict[str, Any]]:
    """The fronts' records of requests ``ids``, read until each has ``per_id`` of them (the
    shadow: stable's answer and the copy's; a step: the one answer) or ``timeout_s`` passed: what
    was found by then. Each read adds to the last (in a cluster, stable's pods answer in turn)."""
    records: dict[tuple[str, int], dict[str, Any]] = {}

    def all_recorded() -> bool:
        records.update({(r["request_id"], r["version"]): r for r in serving.shadow_records(ids, stable, version)})
        return len(records) >= per_id * len(ids)

    with contextlib.suppress(TimeoutError):
        wait_until(all_recorded, timeout_s, 0.2, lambda: TimeoutError())
    return list(records.values())


def read_engine_timings(serving: Serving, samples: list[canary.TextSample], stable: int, version: int) -> None:
    """Each stream's engine figures from the fronts' records of it (by request id), waited for
    until every answered stream's record is there (at most ``RECORD_WAIT_S``). Streams without a
    record (not kept, or the read failed: logged) keep NaN: the judge then times both sides as
    deploy received them."""
    ids = [s.request_id for s in samples if s.ok and s.request_id]
    try:
        records = recorded(serving, ids, stable, version, 1, RECORD_WAIT_S)
    except (RuntimeError, StepError) as exc:
        log.warning("the fronts' records not read (%s): streams judged as deploy received them", first_line(exc))
        return
    if len(records) < len(ids):
        log.info("%d of %d streams recorded with their engine's timings", len(records), len(ids))
    canary.with_engine_timings(samples, records)


def analyse_step(serving: Serving, serve: ServeSettings, params: CanarySettings, reference: dict[str, Any],
                 stable: int | None, version: int, weight: float) -> dict[str, Any]:
    """One analysis of a step: its traffic, judged, with Triton's counters over the same time."""
    before = serving.metrics()
    started = time.monotonic()
    traffic = step_traffic(serving, serve, params, reference, stable, version, weight)
    result = canary.judge_step(traffic.samples, traffic.direct, stable, version, weight, params,
                               traffic.text, traffic.text_direct, serving.fresh_baseline, traffic.compute)
    result["seconds"] = round(time.monotonic() - started, 2)
    result["sent_s"] = {"routed": canary.sent_span(traffic.samples, started),
                        "direct": canary.sent_span(traffic.direct, started)}
    result["triton"] = metrics_delta(before, serving.metrics())
    text = result["text"]
    judged = {"latency": result["latency_test"].get("measured", ""),
              **{key: test.get("measured", "") for key, test in text.get("tests", {}).items()}}
    log.info("canary %g%%: %d requests (stable %d, %d of them direct; canary %d), canary p50 %.1f ms vs "
             "stable %.1f ms; %d streams (canary %d), TTFT p50 %.1f vs %.1f ms, ITL p50 %.2f vs %.2f ms (as "
             "received; judged: %s): %s",
             weight, len(traffic.samples) + len(traffic.direct), result["stable"]["requests"], len(traffic.direct),
             result["canary"]["requests"], result["canary"]["p50_ms"], result["stable"]["p50_ms"],
             len(traffic.text) + len(traffic.text_direct), text["canary"]["streams"],
             text["canary"]["ttft_p50_ms"], text["stable"]["ttft_p50_ms"], text["canary"]["itl_p50_ms"],
             text["stable"]["itl_p50_ms"], "; ".join(f"{k} {v}" for k, v in judged.items() if v) or "-",
             "pass" if result["passed"] else "; ".join(result["failed"]))
    return result


def shadow_traffic(serving: Serving, params: CanarySettings, reference: dict[str, Any], stable: int,
                   version: int) -> list[dict[str, Any]]:
    """One shadow window: streamed completions through the router (stable answers them, the
    router mirrors each to ``version``), each with its own request id; then the front's
    records of both answers, waited for until every copy has ended (at most a stream's timeout)."""
    url, headers = serving.shadow_target()
    sent = canary.send_text_traffic(url, headers, canary.text_requests(reference),
                                    params.text_rps, params.step_duration_s, params.concurrency,
                                    params.text_timeout_s, with_ids=True)
    # a copy never recorded by then counts as a shadow error
    records = recorded(serving, [s.request_id for s in sent if s.ok], stable, version, 2, params.text_timeout_s)
    return canary.pair_records(sent, records, stable, version)


def analyse_shadow(serving: Serving, params: CanarySettings, reference: dict[str, Any], stable: int,
                   version: int) -> dict[str, Any]:
    started = time.monotonic()
    result = canary.judge_shadow(shadow_traffic(serving, params, reference, stable, version), stable, version, params)
    result["seconds"] = round(time.monotonic() - started, 2)
    paired = result["paired_tests"]
    log.info("shadow: %d requests answered by stable %d, copied to %d (%d copies failed); text equal to its "
             "reference %.0f%%, to stable's %.0f%%; TTFT p50 %.1f vs %.1f ms, ITL p50 %.2f vs %.2f ms (paired p %s): %s",
             result["served"], stable, version, result["shadow_errors"], 100 * result["agreement"]["reference"],
             100 * result["agreement"]["stable_exact"], result["shadow"]["ttft_p50_ms"], result["stable"]["ttft_p50_ms"],
             result["shadow"]["itl_p50_ms"], result["stable"]["itl_p50_ms"],
             "/".join(f"{t['p_value']:.2g}" for t in paired.values()) or "-",
             result["verdict"] if result["passed"] else "; ".join(result["failed"]))
    return result


def analysed(analyse: Callable[[], dict[str, Any]], what: str, params: CanarySettings) -> list[dict[str, Any]]:
    """A stage's analyses: again on fresh traffic while inconclusive, at most ``max_analyses``."""
    results: list[dict[str, Any]] = []
    for analysis in range(1, params.max_analyses + 1):
        result = analyse()
        result["analysis"] = analysis
        results.append(result)
        if result["verdict"] != canary.INCONCLUSIVE:
            break
        if analysis < params.max_analyses:
            log.info("%s inconclusive (analysis %d of %d: %s): measuring again on fresh traffic", what, analysis,
                     params.max_analyses, result["failed"][0])
    return results


def why_not(result: dict[str, Any]) -> str:
    """A stage's last analysis that did not pass, as one reason."""
    if result["verdict"] == canary.INCONCLUSIVE:
        return f"still inconclusive after {result['analysis']} analyses: {result['failed'][0]}"
    return str(result["failed"][0])


@dataclass(frozen=True)
class Stop:
    """Where a rollout stopped short of promotion: failed (rolled back next), or held for a
    person's decision (its traffic left where it is)."""

    weight: float
    reason: str
    held: bool = False


def run_canary(args: argparse.Namespace, params: CanarySettings, serving: Serving, serve: ServeSettings,
               scratch: Path) -> dict[str, Any]:
    version = int(args.model_version)
    reference = serving.stage(args.export, version, scratch)
    live = serving.live()
    if live.stable == version and live.canary is None:
        log.info("version %d already serves all traffic: nothing to roll out", version)
        serving.promote(version)
        return {"verdict": "promoted", "stable": version, "canary": version, "steps": [], "already_serving": True}
    if live.canary is not None:  # held for approval, or interrupted: a newer rollout supersedes it (as Argo's does)
        log.info("a canary of version %s was left at %g%% (an interrupted deploy, or one held for approval): "
                 "rolling it back first", live.canary, live.canary_weight)
        serving.roll_back(live.stable)
    elif live.shadow is not None:
        log.info("version %s was left shadowing stable (an interrupted deploy): rolling it back first", live.shadow)
        serving.roll_back(live.stable)
    stable = live.stable
    hold = params.approval.active
    report: dict[str, Any] = {"stable": stable, "canary": version, "shadow": [], "steps": [], "verdict": "promoted",
                              "approval": {"enabled": hold, "hold_before": params.approval.hold_before}}
    serving.prepare(stable, version)
    return roll_out(serving, stable, version, report,
                    lambda: walk_steps(serving, serve, params, reference, stable, version, report, hold))


def roll_out(serving: Serving, stable: int | None, version: int, report: dict[str, Any],
             walk: Callable[[], Stop | None]) -> dict[str, Any]:
    """``walk`` the rollout's stages, then promote; or roll back what failed; or leave a hold as
    it is. SIGTERM or an error on the way: traffic back to stable first (:func:`back_to_stable`)."""
    try:
        stop = walk()
        if stop is None:
            try:
                serving.promote(version)
            except PromotionFailed as exc:
                if not exc.restored:
                    raise
                stop = Stop(100.0, str(exc))
        if stop is not None and not stop.held:
            serving.roll_back(stable)
    except PromotionFailed as exc:  # the canary track is the one serving a whole version: traffic stays there
        raise StepError(f"{exc}: all traffic stays on the canary track (version {version}); the "
                        f"llm_rollback DAG puts it back on version {stable}") from None
    except BaseException as exc:  # SIGTERM (an evicted pod, a killed task) or an error mid-rollout
        outcome = back_to_stable(serving, stable, version, exc)
        if outcome is exc:
            raise
        raise outcome from exc
    if stop is not None and stop.held:
        report.update(verdict=HELD, held_at=stop.weight, reason=stop.reason)
    elif stop is not None:
        report.update(verdict="rolled back", failed_at=stop.weight, reason=stop.reason)
    else:
        report["verdict"] = "promoted"
    return report


def walk_steps(serving: Serving, serve: ServeSettings, params: CanarySettings, reference: dict[str, Any],
               stable: int | None, version: int, report: dict[str, Any], hold: bool,
               after: float | None = None) -> Stop | None:
    """The smoke test, the warm-up, the shadow stage and the traffic steps (their analyses in
    ``report``), or only the steps above weight ``after`` (a rollout a person let go on): None
    when every stage passed. With ``hold``, the walk stops before the step of weight
    ``approval.hold_before``, and at a stage still inconclusive after its analyses, with its
    traffic where it is (a person decides); else an inconclusive stage fails."""
    if after is None:
        try:
            smoke_test(serving, version, reference)
        except StepError as exc:  # before any traffic moved
            return Stop(0.0, f"smoke test: {exc}")
        report["warmup_streams"] = warm_up(serving, version, reference, params)
        if serving.fresh_baseline and stable is not None:
            try:
                report["baseline_warmup_streams"] = warm_baseline(serving, stable, reference, params)
            except StepError as exc:  # no fair baseline to judge against; no traffic moved yet
                return Stop(0.0, f"fresh baseline: {exc}")
        if params.shadow and stable is not None and not shadow_stage(serving, params, reference, stable, version,
                                                                      report):
            last = report["shadow"][-1]
            held = hold and last["verdict"] == canary.INCONCLUSIVE
            if held:
                serving.route(stable, version, 0.0)
            return Stop(0.0, f"shadow: {why_not(last)}", held=held)
        after = 0.0
    current = after
    for weight in [float(w) for w in params.steps if w > after] if stable is not None else [100.0]:
        if hold and (weight == params.approval.hold_before or stable is None):  # (the first model: its only step)
            serving.route(stable, version, current)  # 0: the new version loaded, no user's traffic yet
            return Stop(current, f"held before {weight:g}% for approval", held=True)
        serving.route(stable, version, weight)
        results = analysed(partial(analyse_step, serving, serve, params, reference, stable, version, weight),
                           f"canary {weight:g}%", params)
        report["steps"] += results
        if not results[-1]["passed"]:
            return Stop(weight, why_not(results[-1]), held=hold and results[-1]["verdict"] == canary.INCONCLUSIVE)
        current = weight
    return None


def shadow_stage(serving: Serving, params: CanarySettings, reference: dict[str, Any], stable: int, version: int,
                 report: dict[str, Any]) -> bool:
    """The new version shadows stable (its analyses added to ``report``); the mirror is off again
    before any split moves (a step's copies would double its load). Whether it passed."""
    serving.route(stable, shadow=version)
    report["shadow"] += analysed(lambda: analyse_shadow(serving, params, reference, stable, version), "shadow",
                                 params)
    serving.route(stable)
    return bool(report["shadow"][-1]["passed"])


def back_to_stable(serving: Serving, stable: int | None, version: int, exc: BaseException) -> BaseException:
    """A rollout interrupted (SIGTERM, an error): traffic back to stable and the canary removed
    before the step goes, rather than left at its weight unanalysed until a retry. Returns what
    the step raises: ``exc``, or :class:`Terminated` when SIGTERM came while it put things back
    (then once more, not waiting). Not when the promotion had already moved all traffic to the
    new version (it stays promoted); a failure here is logged, and the retry (or the next
    deploy) finds the leftover canary and rolls it back."""
    why = "terminated by SIGTERM" if isinstance(exc, Terminated) else f"failed ({first_line(exc)})"
    for attempt in range(2):
        try:
            live = serving.live()
            if live.stable == version and live.canary is None:
                log.error("deploy of version %d %s after its promotion moved all traffic to it: left promoted",
                          version, why)
                return exc
            log.error("canary of version %d %s: traffic back to stable version %s first", version, why, stable)
            serving.roll_back(stable)
            break
        except Terminated as again:  # SIGTERM while putting things back: once more (stopping: no waits)
            if attempt == 1:
                log.error("rolling back to version %s was interrupted twice: the next deploy rolls the canary back",
                          stable)
                return again
            exc, why = again, "terminated by SIGTERM"
        except Exception as undo:
            log.error("rolling back to version %s failed too (%s): the next deploy rolls the canary back",
                      stable, first_line(undo))
            return exc
    if isinstance(exc, Terminated):
        exc.args = (f"terminated by SIGTERM during the canary of version {version}: traffic is back on "
                    f"stable version {stable}",)
    return exc


def save_report(report: dict[str, Any], output: str, dag_run_tag: str, experiment: str) -> None:
    with storage.staged_output(output) as out:
        (out / "report.json").write_text(json.dumps(report, indent=1, default=float))
        if report["steps"] or report.get("shadow"):
            canary.plot_report(report, out / "canary.png")
        if dag_run_tag and os.environ.get("MLFLOW_TRACKING_URI"):
            import mlflow

            run_id = find_dag_run(experiment, dag_run_tag)
            if run_id is not None:
                with mlflow.start_run(run_id=run_id):
                    mlflow.log_artifacts(str(out), "canary")
                    mlflow.set_tag("canary.verdict", report["verdict"])


def older_than_champion(name: str, version: str) -> str | None:
    """Why ``version`` must not replace the champion: it was trained on an older data window (a
    backfill, a late retry of an old run). None when it is not older, or a window is unknown."""
    champion = alias_version(name, CHAMPION)
    if champion is None or champion == version:
        return None
    ours, theirs = data_end(name, version), data_end(name, champion)
    if not (ours and theirs):
        log.warning("version %s or champion v%s has no data_end tag (registered outside the pipeline): "
                    "their data windows are not compared", version, champion)
        return None
    if ours < theirs:  # ISO dates: the strings sort as the days
        return f"version {version}'s data ends {ours}, before champion v{champion}'s ({theirs})"
    return None


def canary_main(args: argparse.Namespace) -> dict[str, Any]:
    # canary.steps (rising, ending at 100: promotion follows the last one), deploy_older_data and
    # max_analyses are checked as the settings are read, before any traffic moves
    settings = load_settings("canary", args.overrides)
    params, serve, name = settings.canary, settings.serve, settings.pipeline.model_name
    if not str(args.model_version).isdigit():
        raise StepError(f"--model-version {args.model_version!r}: expected a registry version number")
    if params.approval.required and not params.approval.enabled:
        # Airflow refuses to create a run with approval false where it is required; a run created
        # before the setting was turned on still carries it: not weakened, overridden
        log.warning("canary.approval.required: this deployment requires a person's approval; the run's "
                    "approval false is overridden: the rollout holds for one")
    serving = serving_platform(settings)
    with serving.lock(), storage.scratch() as scratch:
        # read under the lock: a deploy that held it may just have promoted a newer champion
        why = None if params.deploy_older_data else older_than_champion(name, str(args.model_version))
        if why:
            raise GateRejected(f"{why}: not deployed (the run's deploy_older_data Param deploys it)",
                               {"verdict": "not deployed", "canary": int(args.model_version), "reason": why})
        report = run_canary(args, params, serving, serve, scratch)
        try:
            return conclude(report, args, name, settings.train.experiment)
        except BaseException as exc:  # a hold nobody could answer (no report, no result): not left behind
            if report["verdict"] != HELD:
                raise
            outcome = back_to_stable(serving, report["stable"], int(args.model_version), exc)
            if outcome is exc:
                raise
            raise outcome from exc


def conclude(report: dict[str, Any], args: argparse.Namespace, name: str, experiment: str) -> dict[str, Any]:
    """Promote in the registry, save the report; the step's result, or its one-line error."""
    if report["verdict"] == "promoted":
        report["aliases"] = promote_version(name, str(args.model_version)) if args.promote else {}
    if report.get("approval", {}).get("decision"):
        tag_decision(name, str(args.model_version), report["approval"])
    save_report(report, args.output, args.mlflow_run_tag, experiment)
    summary: dict[str, Any] = {k: report[k] for k in ("verdict", "stable", "canary", "aliases", "held_at", "failed_at",
                                                       "reason", "approval") if k in report}
    summary.update(report_uri=storage.join(args.output, "report.json"), steps=step_summary(report["steps"]),
                   shadow=[{"verdict": s["verdict"], "analysis": s["analysis"]} for s in report.get("shadow", [])])
    if report["verdict"] == HELD:
        log.info("version %s holds at %g%% (%s): waiting for a person's decision", args.model_version,
                 report["held_at"], report["reason"])
        return {**summary, "approval_text": approval_text(report, summary["report_uri"])}
    if report["verdict"] != "promoted":
        decision = report.get("approval", {})
        where = f"at {report['failed_at']:g}%" if report["failed_at"] else "before any user reached it"
        stays = (f"stable version {report['stable']} keeps all traffic" if report["stable"] is not None
                 else "nothing serves (it was the first model)")
        line = f"canary of version {args.model_version} rolled back {where}: {report['reason']}; {stays}"
        if decision.get("decision") == ROLL_BACK and decision.get("by"):
            raise GateRejected(line, summary)  # a person's choice: the run ends cleanly, the report says who
        raise StepError(line)
    return summary


def approval_text(report: dict[str, Any], report_uri: str) -> str:
    """What the person deciding reads (Markdown): where the rollout holds and why, each stage's
    figures so far, and the report."""
    stable = f"version {report['stable']}" if report["stable"] is not None else "none: the first model"
    lines = [f"Version **{report['canary']}** holds at **{report['held_at']:g}%** of traffic "
             f"(stable: {stable}): {report['reason']}.", ""]
    for shadow in report.get("shadow", []):
        agreement, text = shadow["agreement"], (shadow["shadow"], shadow["stable"])
        lines.append(f"- shadow (analysis {shadow['analysis']}): **{shadow['verdict']}**; {shadow['served']} requests "
                     f"copied, {shadow['shadow_errors']} copies failed; text equal to its reference "
                     f"{agreement['reference']:.0%}, to stable's {agreement['stable_exact']:.0%}; TTFT p50 "
                     f"{text[0]['ttft_p50_ms']:.1f} vs {text[1]['ttft_p50_ms']:.1f} ms, ITL p50 "
                     f"{text[0]['itl_p50_ms']:.2f} vs {text[1]['itl_p50_ms']:.2f} ms")
    for step in report["steps"]:
        text = step["text"]
        lines.append(f"- {step['weight']:g}% (analysis {step.get('analysis', 1)}): **{step['verdict']}**"
                     f"{': ' + '; '.join(step['failed']) if step['failed'] else ''}; canary p50 "
                     f"{step['canary']['p50_ms']:.1f} vs stable {step['stable']['p50_ms']:.1f} ms, TTFT p50 "
                     f"{text['canary']['ttft_p50_ms']:.1f} vs {text['stable']['ttft_p50_ms']:.1f} ms, "
                     f"{text['canary']['streams']} canary streams")
    lines += ["", f"Report: `{report_uri}` (and canary.png in the run's MLflow run, canary/).", "",
              f"**{PROMOTE}**: walk the remaining steps and promote. **{ROLL_BACK}**: stable keeps all traffic. "
              f"**{EXTEND}**: analyse the held stage once more on fresh traffic and let its verdict decide."]
    return "\n".join(lines)


def tag_decision(name: str, version: str, approval: dict[str, Any]) -> None:
    """Who decided the rollout, when and what, as tags of the registered version."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        for key in ("decision", "by", "at"):
            MlflowClient().set_model_version_tag(name, version, f"approval.{key}", str(approval.get(key) or "timeout"))
    except MlflowException as exc:
        raise registry_error(f"tagging models:/{name}/{version}", exc) from None


def parse_answer(text: str) -> dict[str, Any]:
    """The human-in-the-loop task's answer (``--answer``): ``{"chosen_options": [...],
    "responded_by": NAME or null (the timeout chose the default), "responded_at": TIME}``."""
    try:
        answer = json.loads(text)
        chosen = answer["chosen_options"]
    except (ValueError, KeyError, TypeError):
        raise StepError(f"--answer {text[:80]!r}: expected JSON with chosen_options, responded_by, responded_at") from None
    if not isinstance(chosen, list) or len(chosen) != 1 or chosen[0] not in DECISIONS:
        raise StepError(f"--answer: chosen_options {chosen!r}: expected one of {', '.join(DECISIONS)}")
    return {"decision": chosen[0], "by": answer.get("responded_by") or None, "at": answer.get("responded_at")}


def finish_main(args: argparse.Namespace) -> dict[str, Any]:
    """Carry out a person's decision on a rollout that ``canary`` left held."""
    settings = load_settings("canary", args.overrides)
    params, serve, name = settings.canary, settings.serve, settings.pipeline.model_name
    if not str(args.model_version).isdigit():
        raise StepError(f"--model-version {args.model_version!r}: expected a registry version number")
    answer = parse_answer(args.answer)
    held_uri = storage.join(args.held, "report.json")
    try:
        report = storage.read_json(held_uri)
    except StepError as exc:
        raise StepError(f"--held {args.held}: no canary report ({first_line(exc)})") from None
    version = int(args.model_version)
    if report.get("verdict") != HELD or report.get("canary") != version:
        raise StepError(f"--held {args.held}: the rollout of version {version} was not held "
                        f"(its report says {report.get('verdict')!r} for version {report.get('canary')})")
    report["approval"].update(answer)
    log.info("version %d: %s (%s)", version, answer["decision"],
             f"answered by {answer['by']} at {answer['at']}" if answer["by"] else
             f"no answer within {params.approval.timeout_s:g}s: the default")
    serving = serving_platform(settings)
    with serving.lock(), storage.scratch() as scratch:
        reference = serving.stage(args.export, version, scratch)
        live = serving.live()
        back = live.stable == report["stable"] and live.canary is None and live.shadow is None
        if live.stable == version and live.canary is None:  # a retried finish: promoted already
            report.update(verdict="promoted", already_serving=True)
        elif answer["decision"] == ROLL_BACK and back:  # a retried finish: rolled back already
            report.update(verdict="rolled back", failed_at=report.pop("held_at"),
                          reason=rollback_reason(report["approval"], params))
        elif live.canary != version or live.stable != report["stable"]:
            raise StepError(f"version {version} no longer holds at {report['held_at']:g}% (the route serves "
                            f"stable {live.stable}, canary {live.canary}): superseded by a later deploy or rolled "
                            "back meanwhile; nothing changed")
        else:
            stable, weight = report["stable"], float(report["held_at"])
            report.pop("reason")
            report = roll_out(serving, stable, version, report,
                              lambda: decided(serving, serve, params, reference, stable, version, weight, report))
        return conclude(report, args, name, settings.train.experiment)


def rollback_reason(approval: dict[str, Any], params: CanarySettings) -> str:
    if approval["by"]:
        return f"rolled back by {approval['by']}"
    return f"no decision within {params.approval.timeout_s:g}s (approval.timeout_s): rolled back"


def release_main(args: argparse.Namespace) -> dict[str, Any]:
    """The run's clean-up (a teardown), however its approval ended: a rollout this run's deploy
    left held and still holding (no decision was carried out: the approval task failed or was
    marked failed) is rolled back; anything else is left as it is (a finish always moves the
    route: promoted, rolled back, or it found the hold gone)."""
    settings = load_settings("canary", args.overrides)
    held_uri = storage.join(args.held, "report.json")
    if not storage.exists(held_uri):
        return {"released": None}
    held = storage.read_json(held_uri)
    if held.get("verdict") != HELD:
        return {"released": None}
    serving = serving_platform(settings)
    with serving.lock():
        live = serving.live()
        if live.canary != held["canary"] or live.stable != held["stable"]:
            return {"released": None}  # superseded, rolled back or promoted meanwhile
        log.warning("the run ends with version %s held at %g%% and no decision carried out: rolled back to %s",
                    held["canary"], live.canary_weight, held["stable"])
        serving.roll_back(held["stable"])
    return {"released": held["canary"], "stable": held["stable"]}


def decided(serving: Serving, serve: ServeSettings, params: CanarySettings, reference: dict[str, Any],
            stable: int | None, version: int, weight: float, report: dict[str, Any]) -> Stop | None:
    """The rollout after a person's decision: rolled back; or (Extend) the held stage analysed
    once more, its verdict deciding; then the steps above the held weight."""
    approval = report["approval"]
    if approval["decision"] == ROLL_BACK:
        return Stop(weight, rollback_reason(approval, params))
    if approval["decision"] == EXTEND:
        if weight == 0.0:
            passed = (not params.shadow or stable is None
                      or shadow_stage(serving, params, reference, stable, version, report))
            last = report["shadow"][-1] if report["shadow"] else {}
            serving.route(stable, version, 0.0)
        else:
            results = analysed(partial(analyse_step, serving, serve, params, reference, stable, version, weight),
                               f"canary {weight:g}% (extended)", params)
            report["steps"] += results
            passed, last = results[-1]["passed"], results[-1]
        if not passed:
            return Stop(weight, f"extended: {why_not(last)}")
    return walk_steps(serving, serve, params, reference, stable, version, report, hold=False, after=weight)


def step_summary(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per weight, its last analysis's verdict and how many analyses it took (XCom, run report)."""
    summary: dict[float, dict[str, Any]] = {}
    for step in steps:
        summary[step["weight"]] = {"weight": step["weight"], "passed": step["passed"],
                                   "verdict": step.get("verdict", "pass" if step["passed"] else "fail"),
                                   "analyses": step.get("analysis", 1)}
    return list(summary.values())


def rollback_main(args: argparse.Namespace) -> dict[str, Any]:
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    settings = load_settings("canary", args.overrides)
    name = settings.pipeline.model_name
    target = args.target if args.target.isdigit() else alias_version(name, args.target)
    if target is None:
        raise StepError(f"--target {args.target!r}: models:/{name}@{args.target} does not exist")
    try:
        export_uri = MlflowClient().get_model_version(name, target).tags.get("export.uri")
    except MlflowException as exc:
        if not absent(exc):
            raise registry_error(f"reading models:/{name}/{target}", exc) from None
        raise StepError(f"--target {args.target!r}: models:/{name}/{target} does not exist") from None
    if not export_uri:
        raise StepError(f"models:/{name}/{target} was never exported (no export.uri tag): nothing to serve")
    serving = serving_platform(settings)
    version = int(target)
    with serving.lock(), storage.scratch() as scratch:
        serving.stage(export_uri, version, scratch)
        live = serving.live()
        if live.versions() != [version]:
            if (live.canary is not None and live.canary != version) or live.shadow is not None:
                serving.roll_back(live.stable)  # an interrupted canary or shadow: its traffic goes first
            serving.prepare(live.stable, version, analysed=False)  # the target ready before any traffic moves
            serving.route(live.stable, version, 100.0)
        serving.promote(version)
        aliases = promote_version(name, str(version))
    log.info("rolled back: version %d serves all traffic and is %s", version, "champion")
    return {"serving": version, "replaced": live.versions(), "aliases": aliases, "export_uri": export_uri}


def stage_main(args: argparse.Namespace) -> dict[str, Any]:
    """The init container of a cluster track: one exported version into the pod's repository."""
    if not str(args.model_version).isdigit():
        raise StepError(f"--model-version {args.model_version!r}: expected a registry version number "
                        "(an empty one: the track's Deployment was never given a version)")
    serve = load_settings("canary", args.overrides).serve
    with storage.scratch() as scratch:
        stage_version(args.export, int(args.model_version), Path(args.repository), serve, scratch,
                      args.config_variant)
    return {"staged": int(args.model_version), "repository": args.repository, "config_variant": args.config_variant}


def parser() -> argparse.ArgumentParser:
    p = step_parser("canary", __doc__.splitlines()[0])
    p.prog = "python -m tasks.deploy"
    sub = p.add_subparsers(dest="command", required=True)
    roll = sub.add_parser("canary", help="canary rollout of a new version")
    roll.add_argument("--model-version", required=True, help="registry version to roll out")
    roll.add_argument("--export", required=True, help="the export step's output URI for that version")
    roll.add_argument("--output", required=True, help="run-scoped folder for the canary report")
    roll.add_argument("--mlflow-run-tag", default="", help="dag_run tag of this DAG run (its MLflow run gets the report)")
    roll.add_argument("--no-promote", dest="promote", action="store_false", help="leave the registry aliases alone")
    finish = sub.add_parser("finish", help="carry out a person's decision on a rollout held for approval")
    finish.add_argument("--model-version", required=True, help="the version the canary step held")
    finish.add_argument("--export", required=True, help="the export step's output URI for that version")
    finish.add_argument("--held", required=True, help="the canary step's output (its report of the held rollout)")
    finish.add_argument("--answer", required=True,
                        help='the decision: {"chosen_options": ["Promote" | "Roll back" | "Extend"], '
                             '"responded_by": NAME or null (timed out), "responded_at": TIME}')
    finish.add_argument("--output", required=True, help="run-scoped folder for the final canary report")
    finish.add_argument("--mlflow-run-tag", default="", help="dag_run tag of this DAG run")
    finish.add_argument("--no-promote", dest="promote", action="store_false", help="leave the registry aliases alone")
    release = sub.add_parser("release", help="roll back a rollout this run left held and nobody decided")
    release.add_argument("--held", required=True, help="the canary step's output (its report of the held rollout)")
    back = sub.add_parser("rollback", help="serve an earlier version again and make it champion")
    back.add_argument("--target", default=PREVIOUS, help="an alias (default: previous) or a version number")
    stage = sub.add_parser("stage", help="copy one exported version into a Triton model repository (cluster init container)")
    stage.add_argument("--model-version", required=True, help="registry version number")
    stage.add_argument("--export", required=True, help="the export step's output URI for that version")
    stage.add_argument("--repository", required=True, help="the model repository folder")
    stage.add_argument("--config-variant", default="", help="one of the export's configs/llm.<variant>.pbtxt")
    return p


def main(args: argparse.Namespace) -> dict[str, Any]:
    commands = {"canary": canary_main, "finish": finish_main, "release": release_main, "rollback": rollback_main,
                "stage": stage_main}
    if args.command != "stage":
        raise_on_sigterm()  # a killed deploy moves traffic back to stable before it goes
    return commands[args.command](args)


if __name__ == "__main__":
    run_step(parser(), main)
