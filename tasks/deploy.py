"""Deploy an exported version to Triton behind the router: canary, then promote or roll back.

    python -m tasks.deploy canary --model-version N --export URI --output URI
    python -m tasks.deploy finish --model-version N --export URI --held URI --answer JSON --output URI
    python -m tasks.deploy release --held URI
    python -m tasks.deploy rollback --target previous|VERSION
    python -m tasks.deploy stage --model-version N --export URI --repository DIR   (cluster init container)

canary: version N is loaded beside the stable one (both READY, a smoke inference through
Triton and through the router), if the two fit ``serve.memory_budget_mb`` (their ONNX files and
KV caches, counted before anything is staged: :mod:`tasks.serving.memory`; over it, one line and
exit 2, nothing moved). With ``canary.shadow`` it then shadows stable: the router
mirrors a copy of every ``/v1`` request to N (users get stable's answer only) while a bounded
generator sends the export's reference prompts, and :func:`analysis.judge_shadow` compares the
two answers to each request (errors, text, TTFT and inter-token latency, paired). Only then
are the traffic steps of params.yaml ``canary.steps`` walked. At each step the router sends that share of real traffic (a bounded load generator
replaying held-out text, :mod:`tasks.serving.traffic`) to N, and :mod:`tasks.serving.analysis` compares N with stable on the same
window: error rate, finite logits, next-token agreement with the export's reference, latency
(Mann-Whitney U). Each check passes, fails or is inconclusive (too few samples, a latency
between its "clearly fine" and "clearly bad" ratios): an inconclusive step is analysed again on
fresh traffic, up to ``canary.max_analyses``, then fails. All pass at 100%: N becomes the only version served, the old one is unloaded,
and N becomes ``champion`` in the registry. Any check fails: the canary weight goes to 0 and
the router is reloaded FIRST, only then N is unloaded; the champion alias does not move; the
report (:class:`tasks.serving.canary.CanaryReport`) is saved and the step exits 2 with one line
naming the failed check (no retry).

The walk is a :class:`Rollout`: its :class:`Plan` says, purely, which :class:`Stage` follows
each stage's verdict (prepare, shadow, each step; held, promote or roll back at the end).

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
Two deploys of one model line never run at once (a lock per line beside the router's configuration, or a
Lease on the HTTPRoute); two lines' deploys run side by side, each moving its own split.
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
import math
import os
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from enum import StrEnum
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from tasks.config import CanarySettings, Settings
from tasks.contract import DECISIONS, EXTEND, PROMOTE, ROLL_BACK, RolloutVerdict, from_json, to_json
from tasks.lib import storage, triton
from tasks.lib.errors import GateRejected, StepError, Terminated, absent, first_line, registry_error
from tasks.lib.params import load_settings
from tasks.lib.polling import wait_until
from tasks.lib.registry import CHAMPION, PREVIOUS, alias_version, data_end, promote_version
from tasks.lib.step import log, raise_on_sigterm, run_step, step_parser
from tasks.lib.tracking import find_dag_run
from tasks.results import ReleaseResult, RollbackResult, StageResult
from tasks.serving import plots
from tasks.serving.analysis import StepScope, judge_shadow, judge_step
from tasks.serving.canary import (
    Analysis,
    Approval,
    CanaryReport,
    RolloutSummary,
    ShadowResult,
    StepResult,
    Verdict,
    why_not,
)
from tasks.serving.platforms import PromotionFailed, Serving, Staging, serving_platform, stage_version
from tasks.serving.traffic import (
    Load,
    LogitsRequests,
    StepTraffic,
    Target,
    TextSample,
    one_stream,
    pair_records,
    send_text_traffic,
    send_traffic,
    sent_span,
    split_rates,
    text_requests,
    with_engine_timings,
)


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
    for body, _ in text_requests(reference):
        sample = one_stream(Target(text_url, text_headers, version), body, "", 60.0)
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
    load = Load(float(params.warmup_streams), 1.0, params.concurrency, params.text_timeout_s)
    samples = send_text_traffic(Target(url, headers, version), text_requests(reference), load)
    return sum(s.ok for s in samples)


RECORD_WAIT_S = 5.0  # the front records an answer just after its last chunk
# how often Triton's counters are read during a step: at 10% (~2.5 canary requests a second) about
# half the quarter-seconds have one, ~15 intervals a window (fewer than min_samples: the step's
# latency is judged as deploy's client received it, and the report says so)
COMPUTE_INTERVAL_S = 0.25


def metrics_delta(before: dict[int, dict[str, float]], after: dict[int, dict[str, float]]) -> dict[str, dict[str, float]]:
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
    series :func:`tasks.serving.analysis.logits_timings` compares."""

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


def read_engine_timings(serving: Serving, samples: list[TextSample], stable: int, version: int) -> None:
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
    with_engine_timings(samples, records)


class Stage(StrEnum):
    """Where a rollout stands."""

    PREPARE = "prepare"  # smoke test and warm-ups: the new version loaded, no traffic moved
    SHADOW = "shadow"  # it answers mirrored copies of stable's requests; users get stable's answers
    STEP = "step"  # it takes ``weight``% of traffic
    HELD = "held"  # its traffic left where it is for a person's decision
    PROMOTE = "promote"  # every stage passed
    ROLL_BACK = "roll back"  # a stage failed (or a person said so)


ENDS = (Stage.HELD, Stage.PROMOTE, Stage.ROLL_BACK)  # where a walk stops


@dataclass(frozen=True)
class Position:
    stage: Stage
    weight: float = 0.0  # the new version's share of traffic
    reason: str = ""  # why it holds or rolls back
    extended: bool = False  # a held stage analysed once more (a person's Extend)


@dataclass(frozen=True)
class Plan:
    """A rollout's path, pure: the stage that follows each stage's verdict."""

    steps: tuple[float, ...]  # the traffic steps' weights, rising to 100
    shadow: bool  # a shadow stage before the first step
    hold: bool  # hold before ``hold_before``, and at a stage still inconclusive (a person decides)
    hold_before: float

    @classmethod
    def of(cls, params: CanarySettings, stable: int | None, hold: bool) -> Plan:
        """The first model has no stable to compare with: one step, 100%, no shadow (held before it)."""
        if stable is None:
            return cls((100.0,), shadow=False, hold=hold, hold_before=100.0)
        return cls(tuple(float(w) for w in params.steps), params.shadow, hold, float(params.approval.hold_before))

    def start(self) -> Position:
        return Position(Stage.PREPARE)

    def after(self, at: Position, verdict: Verdict, why: str = "") -> Position:
        """What follows stage ``at`` that ended with ``verdict`` (``why``: the reason it did not pass).
        Inconclusive holds with ``hold`` (traffic where it is), else fails as a failure does."""
        if verdict == Verdict.PASS:
            return Position(Stage.SHADOW) if at.stage is Stage.PREPARE and self.shadow else self.above(at.weight)
        reason = ("extended: " if at.extended else "shadow: " if at.stage is Stage.SHADOW else "") + why
        if self.hold and verdict == Verdict.INCONCLUSIVE and at.stage is not Stage.PREPARE:
            return Position(Stage.HELD, at.weight, reason)
        return Position(Stage.ROLL_BACK, at.weight, reason)

    def above(self, weight: float) -> Position:
        """The first step above ``weight`` (held before it, at ``weight``, where it is
        ``hold_before``); promotion past the last."""
        for step in self.steps:
            if step > weight:
                if self.hold and step == self.hold_before:
                    return Position(Stage.HELD, weight, f"held before {step:g}% for approval")
                return Position(Stage.STEP, step)
        return Position(Stage.PROMOTE, weight)

    def decided(self, held: Position, approval: Approval, timeout_s: float) -> Position:
        """Where a rollout held at ``held`` goes on a person's decision: rolled back; Extend: the held
        stage analysed once more (the shadow at 0%, where there is one), its verdict deciding;
        Promote: the steps above the held weight."""
        if approval.decision == ROLL_BACK:
            return Position(Stage.ROLL_BACK, held.weight, rollback_reason(approval, timeout_s))
        if approval.decision == EXTEND:
            if held.weight > 0.0:
                return Position(Stage.STEP, held.weight, extended=True)
            if self.shadow:
                return Position(Stage.SHADOW, extended=True)
        return self.above(held.weight)


def rollback_reason(approval: Approval, timeout_s: float) -> str:
    if approval.by:
        return f"rolled back by {approval.by}"
    return f"no decision within {timeout_s:g}s (approval.timeout_s): rolled back"


class Rollout:
    """One rollout of ``report.canary`` beside ``report.stable``: the serving platform, the
    settings, the export's reference, the report so far, and the :class:`Plan` it walks."""

    def __init__(self, serving: Serving, settings: Settings, reference: dict[str, Any], report: CanaryReport,
                 hold: bool) -> None:
        self.serving, self.params, self.serve, self.reference = serving, settings.canary, settings.serve, reference
        self.report = report
        self.stable, self.version = report.stable, report.canary
        self.plan = Plan.of(self.params, self.stable, hold)

    def roll_out(self, start: Position) -> CanaryReport:
        """Walk from ``start``, then promote; or roll back what failed; or leave a hold as it is.
        SIGTERM or an error on the way: traffic back to stable first (:func:`back_to_stable`)."""
        try:
            end = self.walk(start)
            if end.stage is Stage.PROMOTE:
                try:
                    self.serving.promote(self.version)
                except PromotionFailed as exc:
                    if not exc.restored:
                        raise
                    end = Position(Stage.ROLL_BACK, 100.0, str(exc))
            if end.stage is Stage.ROLL_BACK:
                self.serving.roll_back(self.stable)
        except PromotionFailed as exc:  # the canary track is the one serving a whole version: traffic stays there
            raise StepError(f"{exc}: all traffic stays on the canary track (version {self.version}); the "
                            f"llm_rollback DAG puts it back on version {self.stable}") from None
        except BaseException as exc:  # SIGTERM (an evicted pod, a killed task) or an error mid-rollout
            outcome = back_to_stable(self.serving, self.stable, self.version, exc)
            if outcome is exc:
                raise
            raise outcome from exc
        self.report = self.ended(end)
        return self.report

    def walk(self, at: Position) -> Position:
        """Each stage's work from ``at``, then the plan's next, until the rollout holds (its traffic
        left where it is), is to be promoted or rolled back."""
        stages = {Stage.PREPARE: self.prepare, Stage.SHADOW: self.shadow, Stage.STEP: self.step}
        while at.stage not in ENDS:
            verdict, why = stages[at.stage](at)
            at = self.plan.after(at, verdict, why)
        if at.stage is Stage.HELD:
            self.serving.route(self.stable, self.version, at.weight)  # (0: loaded, no user's traffic yet)
        return at

    def ended(self, end: Position) -> CanaryReport:
        if end.stage is Stage.HELD:
            return replace(self.report, verdict=RolloutVerdict.HELD, held_at=end.weight, reason=end.reason)
        if end.stage is Stage.ROLL_BACK:
            return replace(self.report, verdict=RolloutVerdict.ROLLED_BACK, failed_at=end.weight, reason=end.reason)
        return replace(self.report, verdict=RolloutVerdict.PROMOTED)

    def prepare(self, at: Position) -> tuple[Verdict, str]:
        """The smoke test and the warm-ups, before any traffic moves."""
        try:
            smoke_test(self.serving, self.version, self.reference)
        except StepError as exc:
            return Verdict.FAIL, f"smoke test: {exc}"
        self.report = replace(self.report, warmup_streams=warm_up(self.serving, self.version, self.reference,
                                                                  self.params))
        if self.serving.fresh_baseline and self.stable is not None:
            try:
                warmed = warm_baseline(self.serving, self.stable, self.reference, self.params)
            except StepError as exc:  # no fair baseline to judge against; no traffic moved yet
                return Verdict.FAIL, f"fresh baseline: {exc}"
            self.report = replace(self.report, baseline_warmup_streams=warmed)
        return Verdict.PASS, ""

    def shadow(self, at: Position) -> tuple[Verdict, str]:
        """The new version shadows stable (its analyses added to the report); the mirror is off
        again before any split moves (a step's copies would double its load)."""
        stable = self.shadowed()
        self.serving.route(stable, shadow=self.version)
        results = self.analysed(self.analyse_shadow, "shadow")
        self.report = replace(self.report, shadow=self.report.shadow + tuple(results))
        self.serving.route(stable)
        last = results[-1]
        if at.extended and last.passed:
            self.serving.route(stable, self.version, 0.0)
        return last.verdict, "" if last.passed else why_not(last)

    def step(self, at: Position) -> tuple[Verdict, str]:
        """A traffic step: that share routed to the new version (an extended one: already), analysed."""
        if not at.extended:
            self.serving.route(self.stable, self.version, at.weight)
        results = self.analysed(partial(self.analyse_step, at.weight),
                                f"canary {at.weight:g}%" + (" (extended)" if at.extended else ""))
        self.report = replace(self.report, steps=self.report.steps + tuple(results))
        last = results[-1]
        return last.verdict, "" if last.passed else why_not(last)

    def shadowed(self) -> int:
        if self.stable is None:
            raise StepError(f"version {self.version}: no stable version to shadow (the plan has no shadow stage)")
        return self.stable

    def analysed(self, analyse: Callable[[], Analysis], what: str) -> list[Analysis]:
        """A stage's analyses: again on fresh traffic while inconclusive, at most ``max_analyses``."""
        results: list[Analysis] = []
        for analysis in range(1, self.params.max_analyses + 1):
            result = replace(analyse(), analysis=analysis)
            results.append(result)
            if result.verdict != Verdict.INCONCLUSIVE:
                break
            if analysis < self.params.max_analyses:
                log.info("%s inconclusive (analysis %d of %d: %s): measuring again on fresh traffic", what, analysis,
                         self.params.max_analyses, result.failed[0])
        return results

    def step_traffic(self, weight: float) -> StepTraffic:
        """One canary step's traffic: windows through the router (repeated, up to ``max_windows``,
        until the canary has ``min_samples`` logits requests and ``text_min_samples`` streams) and,
        in the same windows, the streams straight to stable that :func:`split_rates` asks
        for. Logits requests and streamed completions run side by side."""
        serving, params, stable = self.serving, self.params, self.stable
        requests, texts = LogitsRequests.of(self.reference), text_requests(self.reference)
        routed = Target(serving.url + triton.infer_path(self.serve.triton_model))
        routed_text = Target(serving.url + "/v1/completions", serving.model_headers)
        duration, fresh = params.step_duration_s, serving.fresh_baseline
        rate, direct_rps = split_rates(params.rate_rps, params.min_samples, weight, stable, duration, fresh)
        text_rate, direct_text_rps = split_rates(params.text_rps, params.text_min_samples, weight, stable, duration,
                                                 fresh)
        baseline = Target(*serving.baseline_target(stable), stable) if stable is not None else Target("")
        text_baseline = Target(*serving.text_target(stable), stable) if stable is not None else Target("")

        def logits_load(rps: float) -> Load:
            return Load(rps, duration, params.concurrency, params.request_timeout_s)

        def text_load(rps: float) -> Load:
            return Load(rps, duration, params.concurrency, params.text_timeout_s)

        text: list[TextSample] = []
        traffic = StepTraffic(text=text)
        sampler = ComputeSampler(serving) if serving.per_version_metrics else contextlib.nullcontext()
        with ThreadPoolExecutor(max_workers=3) as beside, sampler:
            for _ in range(params.max_windows):  # a small share may need more than one window
                direct = beside.submit(send_traffic, baseline, requests, logits_load(direct_rps)) if direct_rps else None
                text_direct = beside.submit(send_text_traffic, text_baseline, texts, text_load(direct_text_rps),
                                            True) if direct_text_rps else None
                routed_texts = beside.submit(send_text_traffic, routed_text, texts, text_load(text_rate), True)
                traffic.samples += send_traffic(routed, requests, logits_load(rate))
                text += routed_texts.result()
                traffic.direct += direct.result() if direct is not None else []
                traffic.text_direct += text_direct.result() if text_direct is not None else []
                if traffic.enough(self.version, params, stable if fresh else None):
                    break
        if isinstance(sampler, ComputeSampler):
            traffic.compute = sampler.series
        if stable is not None and serving.step_records:
            read_engine_timings(serving, text + traffic.text_direct, stable, self.version)
        return traffic

    def analyse_step(self, weight: float) -> StepResult:
        """One analysis of a step: its traffic, judged, with Triton's counters over the same time."""
        before = self.serving.metrics()
        started = time.monotonic()
        traffic = self.step_traffic(weight)
        result = judge_step(traffic, StepScope(self.stable, self.version, weight, self.serving.fresh_baseline),
                            self.params)
        result = replace(result, seconds=round(time.monotonic() - started, 2),
                         sent_s={"routed": sent_span(traffic.samples, started),
                                 "direct": sent_span(traffic.direct, started)},
                         triton=metrics_delta(before, self.serving.metrics()))
        log_step(result, traffic)
        return result

    def shadow_traffic(self) -> list[dict[str, Any]]:
        """One shadow window: streamed completions through the router (stable answers them, the
        router mirrors each to the new version), each with its own request id; then the front's
        records of both answers, waited for until every copy has ended (at most a stream's timeout)."""
        params, stable = self.params, self.shadowed()
        url, headers = self.serving.shadow_target()
        load = Load(params.text_rps, params.step_duration_s, params.concurrency, params.text_timeout_s)
        sent = send_text_traffic(Target(url, headers), text_requests(self.reference), load, with_ids=True)
        # a copy never recorded by then counts as a shadow error
        records = recorded(self.serving, [s.request_id for s in sent if s.ok], stable, self.version, 2,
                           params.text_timeout_s)
        return pair_records(sent, records, stable, self.version)

    def analyse_shadow(self) -> ShadowResult:
        started = time.monotonic()
        result = judge_shadow(self.shadow_traffic(), self.shadowed(), self.version, self.params)
        result = replace(result, seconds=round(time.monotonic() - started, 2))
        log.info("shadow: %d requests answered by stable %d, copied to %d (%d copies failed); text equal to its "
                 "reference %.0f%%, to stable's %.0f%%; TTFT p50 %.1f vs %.1f ms, ITL p50 %.2f vs %.2f ms (paired p %s): %s",
                 result.served, result.stable_version, result.shadow_version, result.shadow_errors,
                 100 * result.agreement.reference, 100 * result.agreement.stable_exact, result.shadow.ttft_p50_ms,
                 result.stable.ttft_p50_ms, result.shadow.itl_p50_ms, result.stable.itl_p50_ms,
                 "/".join(f"{t.p_value:.2g}" for t in result.paired_tests.values()) or "-",
                 result.verdict if result.passed else "; ".join(result.failed))
        return result


def log_step(result: StepResult, traffic: StepTraffic) -> None:
    """One line: the step's requests and streams, each side's figures, how they were judged, the verdict."""
    text, latency = result.text, result.latency_test
    judged = {"latency": latency.measured if latency else "",
              **{key: test.measured for key, test in (text.tests if text else {}).items()}}
    streams = len(traffic.text or []) + len(traffic.text_direct)
    figures = ((text.canary.streams, text.canary.ttft_p50_ms, text.stable.ttft_p50_ms, text.canary.itl_p50_ms,
                text.stable.itl_p50_ms) if text else (0, math.nan, math.nan, math.nan, math.nan))
    log.info("canary %g%%: %d requests (stable %d, %d of them direct; canary %d), canary p50 %.1f ms vs "
             "stable %.1f ms; %d streams (canary %d), TTFT p50 %.1f vs %.1f ms, ITL p50 %.2f vs %.2f ms (as "
             "received; judged: %s): %s",
             result.weight, len(traffic.samples) + len(traffic.direct), result.stable.requests, len(traffic.direct),
             result.canary.requests, result.canary.p50_ms, result.stable.p50_ms, streams, *figures,
             "; ".join(f"{k} {v}" for k, v in judged.items() if v) or "-",
             "pass" if result.passed else "; ".join(result.failed))


def covered_inputs(reference: dict[str, Any], first_new_id: int) -> tuple[list[Any], list[list[int]]]:
    """The reference's logits inputs cut before their first id of ``first_new_id`` or above (a
    causal model's next tokens before it do not change), with their next tokens; a window that
    starts with such an id is left out."""
    inputs, next_tokens = [], []
    for ids, expected in zip(reference["inputs"], reference["next_tokens"], strict=True):
        window = np.asarray(ids, dtype=np.int64)
        new = np.flatnonzero(window.reshape(-1) >= first_new_id)
        cut = int(new[0]) if len(new) else window.shape[-1]
        if cut:
            inputs.append(window[..., :cut].tolist())
            next_tokens.append(list(expected)[:cut])
    return inputs, next_tokens


def covered_reference(reference: dict[str, Any], first_new_id: int) -> dict[str, Any]:
    """The export's reference within the ids below ``first_new_id`` (a version of the older
    vocabulary reads and writes it token for token the same way): its logits inputs cut before a
    new id (stable is sent them too: it has no row for one), and only the text prompts whose
    prompt and continuation lie within (all of them when none does, logged: the text is judged
    against the new version's own reference either way)."""
    inputs, next_tokens = covered_inputs(reference, first_new_id)
    if not inputs:
        raise StepError(f"every logits input of the export's reference starts with a token id of {first_new_id} or "
                        "above, which stable's vocabulary lacks: the canary cannot send both versions the same "
                        "requests (export with held-out text the old vocabulary covers)")
    generations = reference.get("generations", [])
    covered = [g for g in generations if max([*g["prompt_ids"], *g["tokens"]], default=0) < first_new_id]
    if not covered:
        log.warning("none of the %d reference prompts lies within stable's vocabulary: the canary compares text "
                    "on all of them", len(generations))
    log.info("the vocabulary grew from stable's: the canary compares the versions on %d of %d reference prompts "
             "and %d logits inputs within the old vocabulary", len(covered or generations), len(generations),
             len(inputs))
    return {**reference, "inputs": inputs, "next_tokens": next_tokens, "generations": covered or generations}


def comparable_text(reference: dict[str, Any], name: str, stable: int, version: int) -> dict[str, Any]:
    """The reference the rollout compares ``version`` to ``stable`` on: when its tokenizer grew
    from stable's (tasks/lib/vocabulary_growth.py), what the old vocabulary covers
    (:func:`covered_reference`); else all of it."""
    from tasks.lib.registry import model_version
    from tasks.lib.vocabulary_growth import growth_of

    new, old = model_version(name, str(version)).tags, model_version(name, str(stable)).tags
    if not new.get("tokenizer_uri") or new.get("tokenizer_hash") == old.get("tokenizer_hash"):
        return reference
    growth = growth_of(new["tokenizer_uri"])
    if growth is None or growth.parent_hash != old.get("tokenizer_hash"):
        return reference
    return covered_reference(reference, growth.first_id)


def run_canary(args: argparse.Namespace, settings: Settings, serving: Serving, scratch: Path) -> CanaryReport:
    version = int(args.model_version)
    reference = serving.stage(args.export, version, scratch)
    live = serving.live()
    if live.stable == version and live.canary is None:
        log.info("version %d already serves all traffic: nothing to roll out", version)
        serving.promote(version)
        return CanaryReport(stable=version, canary=version, already_serving=True)
    if live.canary is not None:  # held for approval, or interrupted: a newer rollout supersedes it (as Argo's does)
        log.info("a canary of version %s was left at %g%% (an interrupted deploy, or one held for approval): "
                 "rolling it back first", live.canary, live.canary_weight)
        serving.roll_back(live.stable)
    elif live.shadow is not None:
        log.info("version %s was left shadowing stable (an interrupted deploy): rolling it back first", live.shadow)
        serving.roll_back(live.stable)
    approval = settings.canary.approval
    report = CanaryReport(stable=live.stable, canary=version,
                          approval=Approval(enabled=approval.active, hold_before=approval.hold_before))
    if live.stable is not None:  # before any pod or model is started: a failure here leaves nothing behind
        reference = comparable_text(reference, settings.pipeline.model_name, live.stable, version)
    serving.prepare(live.stable, version)
    rollout = Rollout(serving, settings, reference, report, hold=approval.active)
    return rollout.roll_out(rollout.plan.start())


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


def save_report(report: CanaryReport, output: str, dag_run_tag: str, experiment: str) -> None:
    with storage.staged_output(output) as out:
        (out / "report.json").write_text(json.dumps(to_json(report), indent=1, default=float))
        if report.steps or report.shadow:
            plots.plot_report(report, out / "canary.png")
        if dag_run_tag and os.environ.get("MLFLOW_TRACKING_URI"):
            import mlflow

            run_id = find_dag_run(experiment, dag_run_tag)
            if run_id is not None:
                with mlflow.start_run(run_id=run_id):
                    mlflow.log_artifacts(str(out), "canary")
                    mlflow.set_tag("canary.verdict", report.verdict.value)


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


def canary_main(args: argparse.Namespace) -> RolloutSummary:
    # canary.steps (rising, ending at 100: promotion follows the last one), deploy_older_data and
    # max_analyses are checked as the settings are read, before any traffic moves
    settings = load_settings("canary", args.overrides)
    params, name = settings.canary, settings.pipeline.model_name
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
                               RolloutSummary(verdict=RolloutVerdict.NOT_DEPLOYED, canary=int(args.model_version),
                                              reason=why))
        report = run_canary(args, settings, serving, scratch)
        try:
            return conclude(report, args, name, settings.train.experiment)
        except BaseException as exc:  # a hold nobody could answer (no report, no result): not left behind
            if report.verdict != RolloutVerdict.HELD:
                raise
            outcome = back_to_stable(serving, report.stable, int(args.model_version), exc)
            if outcome is exc:
                raise
            raise outcome from exc


def conclude(report: CanaryReport, args: argparse.Namespace, name: str, experiment: str) -> RolloutSummary:
    """Promote in the registry, save the report; the step's result, or its one-line error."""
    if report.verdict == RolloutVerdict.PROMOTED:
        report = replace(report, aliases=promote_version(name, str(args.model_version)) if args.promote else {})
    if report.approval is not None and report.approval.decision:
        tag_decision(name, str(args.model_version), report.approval)
    save_report(report, args.output, args.mlflow_run_tag, experiment)
    summary = report.summary(storage.join(args.output, "report.json"))
    if report.verdict == RolloutVerdict.HELD:
        log.info("version %s holds at %g%% (%s): waiting for a person's decision", args.model_version,
                 report.held_at, report.reason)
        return replace(summary, approval_text=approval_text(report, str(summary.report_uri)))
    if report.verdict != RolloutVerdict.PROMOTED:
        decision = report.approval or Approval()
        where = f"at {report.failed_at:g}%" if report.failed_at else "before any user reached it"
        stays = (f"stable version {report.stable} keeps all traffic" if report.stable is not None
                 else "nothing serves (it was the first model)")
        line = f"canary of version {args.model_version} rolled back {where}: {report.reason}; {stays}"
        if decision.decision == ROLL_BACK and decision.by:
            raise GateRejected(line, summary)  # a person's choice: the run ends cleanly, the report says who
        raise StepError(line)
    return summary


def approval_text(report: CanaryReport, report_uri: str) -> str:
    """What the person deciding reads (Markdown): where the rollout holds and why, each stage's
    figures so far, and the report."""
    stable = f"version {report.stable}" if report.stable is not None else "none: the first model"
    lines = [f"Version **{report.canary}** holds at **{report.held_at or 0:g}%** of traffic "
             f"(stable: {stable}): {report.reason}.", ""]
    for shadow in report.shadow:
        agreement, text = shadow.agreement, (shadow.shadow, shadow.stable)
        lines.append(f"- shadow (analysis {shadow.analysis}): **{shadow.verdict}**; {shadow.served} requests "
                     f"copied, {shadow.shadow_errors} copies failed; text equal to its reference "
                     f"{agreement.reference:.0%}, to stable's {agreement.stable_exact:.0%}; TTFT p50 "
                     f"{text[0].ttft_p50_ms:.1f} vs {text[1].ttft_p50_ms:.1f} ms, ITL p50 "
                     f"{text[0].itl_p50_ms:.2f} vs {text[1].itl_p50_ms:.2f} ms")
    for step in report.steps:
        streams = step.text
        lines.append(f"- {step.weight:g}% (analysis {step.analysis}): **{step.verdict}**"
                     f"{': ' + '; '.join(step.failed) if step.failed else ''}; canary p50 "
                     f"{step.canary.p50_ms:.1f} vs stable {step.stable.p50_ms:.1f} ms, TTFT p50 "
                     f"{streams.canary.ttft_p50_ms if streams else math.nan:.1f} vs "
                     f"{streams.stable.ttft_p50_ms if streams else math.nan:.1f} ms, "
                     f"{streams.canary.streams if streams else 0} canary streams")
    lines += ["", f"Report: `{report_uri}` (and canary.png in the run's MLflow run, canary/).", "",
              f"**{PROMOTE}**: walk the remaining steps and promote. **{ROLL_BACK}**: stable keeps all traffic. "
              f"**{EXTEND}**: analyse the held stage once more on fresh traffic and let its verdict decide."]
    return "\n".join(lines)


def tag_decision(name: str, version: str, approval: Approval) -> None:
    """Who decided the rollout, when and what, as tags of the registered version."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        for key, value in (("decision", approval.decision), ("by", approval.by), ("at", approval.at)):
            MlflowClient().set_model_version_tag(name, version, f"approval.{key}", str(value or "timeout"))
    except MlflowException as exc:
        raise registry_error(f"tagging models:/{name}/{version}", exc) from None


def parse_answer(text: str) -> Approval:
    """The human-in-the-loop task's answer (``--answer``): ``{"chosen_options": [...],
    "responded_by": NAME or null (the timeout chose the default), "responded_at": TIME}``, as
    the decision's part of an :class:`Approval`."""
    try:
        answer = json.loads(text)
        chosen = answer["chosen_options"]
    except (ValueError, KeyError, TypeError):
        raise StepError(f"--answer {text[:80]!r}: expected JSON with chosen_options, responded_by, responded_at") from None
    if not isinstance(chosen, list) or len(chosen) != 1 or chosen[0] not in DECISIONS:
        raise StepError(f"--answer: chosen_options {chosen!r}: expected one of {', '.join(DECISIONS)}")
    return Approval(decision=chosen[0], by=answer.get("responded_by") or None, at=answer.get("responded_at"))


def read_held(held: str) -> CanaryReport:
    """The canary report a ``canary`` step left in ``held`` (its output)."""
    try:
        return from_json(CanaryReport, storage.read_json(storage.join(held, "report.json")))
    except StepError as exc:
        raise StepError(f"--held {held}: no canary report ({first_line(exc)})") from None
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        raise StepError(f"--held {held}: not a canary report ({first_line(exc)})") from None


def finish_main(args: argparse.Namespace) -> RolloutSummary:
    """Carry out a person's decision on a rollout that ``canary`` left held."""
    settings = load_settings("canary", args.overrides)
    params, name = settings.canary, settings.pipeline.model_name
    if not str(args.model_version).isdigit():
        raise StepError(f"--model-version {args.model_version!r}: expected a registry version number")
    answer = parse_answer(args.answer)
    report = read_held(args.held)
    version = int(args.model_version)
    if report.verdict != RolloutVerdict.HELD or report.canary != version:
        raise StepError(f"--held {args.held}: the rollout of version {version} was not held "
                        f"(its report says {report.verdict.value!r} for version {report.canary})")
    approval = replace(report.approval or Approval(), decision=answer.decision, by=answer.by, at=answer.at)
    report = replace(report, approval=approval)
    log.info("version %d: %s (%s)", version, approval.decision,
             f"answered by {approval.by} at {approval.at}" if approval.by else
             f"no answer within {params.approval.timeout_s:g}s: the default")
    serving = serving_platform(settings)
    with serving.lock(), storage.scratch() as scratch:
        reference = serving.stage(args.export, version, scratch)
        live = serving.live()
        back = live.stable == report.stable and live.canary is None and live.shadow is None
        held_at = report.held_at or 0.0
        if live.stable == version and live.canary is None:  # a retried finish: promoted already
            report = replace(report, verdict=RolloutVerdict.PROMOTED, already_serving=True)
        elif approval.decision == ROLL_BACK and back:  # a retried finish: rolled back already
            report = replace(report, verdict=RolloutVerdict.ROLLED_BACK, failed_at=held_at, held_at=None,
                             reason=rollback_reason(approval, params.approval.timeout_s))
        elif live.canary != version or live.stable != report.stable:
            raise StepError(f"version {version} no longer holds at {held_at:g}% (the route serves "
                            f"stable {live.stable}, canary {live.canary}): superseded by a later deploy or rolled "
                            "back meanwhile; nothing changed")
        else:
            if report.stable is not None:
                reference = comparable_text(reference, name, report.stable, version)
            rollout = Rollout(serving, settings, reference, replace(report, reason=None), hold=False)
            held = Position(Stage.HELD, float(held_at))
            report = rollout.roll_out(rollout.plan.decided(held, approval, params.approval.timeout_s))
        return conclude(report, args, name, settings.train.experiment)


def release_main(args: argparse.Namespace) -> ReleaseResult:
    """The run's clean-up (a teardown), however its approval ended: a rollout this run's deploy
    left held and still holding (no decision was carried out: the approval task failed or was
    marked failed) is rolled back; anything else is left as it is (a finish always moves the
    route: promoted, rolled back, or it found the hold gone)."""
    settings = load_settings("canary", args.overrides)
    if not storage.exists(storage.join(args.held, "report.json")):
        return ReleaseResult(released=None)
    held = read_held(args.held)
    if held.verdict != RolloutVerdict.HELD:
        return ReleaseResult(released=None)
    serving = serving_platform(settings)
    with serving.lock():
        live = serving.live()
        if live.canary != held.canary or live.stable != held.stable:
            return ReleaseResult(released=None)  # superseded, rolled back or promoted meanwhile
        log.warning("the run ends with version %s held at %g%% and no decision carried out: rolled back to %s",
                    held.canary, live.canary_weight, held.stable)
        serving.roll_back(held.stable)
    return ReleaseResult(released=held.canary, stable=held.stable)


def rollback_main(args: argparse.Namespace) -> RollbackResult:
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
        serving.stage(export_uri, version, scratch, enforce_budget=False)
        live = serving.live()
        if live.versions() != [version]:
            if (live.canary is not None and live.canary != version) or live.shadow is not None:
                serving.roll_back(live.stable)  # an interrupted canary or shadow: its traffic goes first
            serving.prepare(live.stable, version, analysed=False)  # the target ready before any traffic moves
            serving.route(live.stable, version, 100.0)
        serving.promote(version)
        aliases = promote_version(name, str(version))
    log.info("rolled back: version %d serves all traffic and is %s", version, "champion")
    return RollbackResult(serving=version, replaced=tuple(live.versions()), aliases=aliases, export_uri=export_uri)


def stage_main(args: argparse.Namespace) -> StageResult:
    """The init container of a cluster track: one exported version into the pod's repository."""
    if not str(args.model_version).isdigit():
        raise StepError(f"--model-version {args.model_version!r}: expected a registry version number "
                        "(an empty one: the track's Deployment was never given a version)")
    serve = load_settings("canary", args.overrides).serve
    with storage.scratch() as scratch:
        stage_version(args.export, int(args.model_version), Path(args.repository), serve, scratch,
                      Staging(config_variant=args.config_variant))
    return StageResult(staged=int(args.model_version), repository=args.repository, config_variant=args.config_variant)


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


def main(args: argparse.Namespace) -> RolloutSummary | ReleaseResult | RollbackResult | StageResult:
    commands: dict[str, Callable[[argparse.Namespace], RolloutSummary | ReleaseResult | RollbackResult | StageResult]] = {"canary": canary_main, "finish": finish_main, "release": release_main, "rollback": rollback_main,
                "stage": stage_main}
    if args.command != "stage":
        raise_on_sigterm()  # a killed deploy moves traffic back to stable before it goes
    return commands[args.command](args)


if __name__ == "__main__":
    run_step(parser(), main)
