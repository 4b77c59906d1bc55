"""Canary analysis: a stage's samples judged, canary against stable. Pure functions over samples.

:func:`judge_step` turns one step's samples (:class:`tasks.serving.traffic.StepTraffic`) into
checks, as Kayenta does: the canary's error rate, finite outputs and next-token agreement
against absolute bounds, and its latency against stable's over the same window with a
one-sided Mann-Whitney U test (is the canary slower?) plus a minimum effect size (median
ratio), so noise alone never fails a canary and a slightly-faster-or-slower model never does
either. The text endpoint's streams (:func:`judge_text`) are judged on time to first token,
inter-token latency, failed or cut streams, and text equal to the export's PyTorch reference
generations.

Each check's verdict is pass, fail or inconclusive (as Argo Rollouts' analysis): too few samples,
or a latency slower than its "clearly fine" ratio but not past its "clearly bad" one, is
inconclusive; the step's verdict is the worst of its checks', and deploy analyses an
inconclusive step again on fresh traffic.

:func:`judge_shadow` judges the shadow stage: the same requests answered by stable (for the
user) and by the new version (a mirrored copy), paired by request id from the OpenAI front's
records, compared per request (errors, text, time to first token and inter-token latency by a
one-sided Wilcoxon signed-rank test on the paired differences).

The results are :mod:`tasks.serving.canary`'s typed report values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tasks.config import CanarySettings
from tasks.serving.canary import (
    Agreement,
    Check,
    Judgement,
    LatencyTest,
    ShadowResult,
    ShadowSide,
    StepResult,
    TextReport,
    TextStats,
    UsersSeen,
    Verdict,
    VersionStats,
)
from tasks.serving.traffic import Sample, StepTraffic, TextSample

PASS, FAIL, INCONCLUSIVE = Verdict.PASS, Verdict.FAIL, Verdict.INCONCLUSIVE
CLIENT_TIMED = "as deploy's client received them"
ENGINE_TIMED, FRONT_TIMED = "as the engines timed them", "as the chunks reached the front"
TRITON_TIMED = "compute time per request as Triton timed it, per interval"
HODGES_LEHMANN_PAIRS = 1_000_000  # the differences a shift is the median of, at most (8 MB)


@dataclass
class Checks:
    """A stage's checks, in the order taken."""

    taken: list[Check] = field(default_factory=list)

    def add(self, name: str, verdict: bool | Verdict, value: float, limit: float, detail: str) -> None:
        """``verdict``: a :class:`Verdict`, or a bool (pass or fail)."""
        if isinstance(verdict, bool | np.bool_):
            verdict = Verdict.of(bool(verdict))
        self.taken.append(Check(name, verdict, value, limit, detail))


def verdict_of(checks: Checks | Sequence[Check]) -> Judgement:
    """The worst of the checks' verdicts, and the reasons of those that did not pass (failed first)."""
    return Judgement.of(list(checks.taken if isinstance(checks, Checks) else checks))


def enough(count: int, wanted: int) -> Verdict:
    """Too few samples tell nothing either way: inconclusive, not failed."""
    return PASS if count >= wanted else INCONCLUSIVE


@dataclass(frozen=True)
class StepScope:
    """What a step's samples are judged as: the versions, the canary's weight, and whether
    stable's side is a fresh baseline beside the canary alone (``baseline_only``)."""

    stable: int | None
    canary: int
    weight: float
    baseline_only: bool = False


@dataclass(frozen=True)
class Timings:
    """The canary's and stable's figures compared for one latency, and how they were measured."""

    canary_ms: list[float]
    baseline_ms: list[float]
    measured: str

    def enough(self, wanted: int) -> bool:
        return len(self.canary_ms) >= wanted and len(self.baseline_ms) >= wanted


def _share(count: int, of: int) -> float:
    return count / of if of else 0.0


def _percentile(values: Any, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else math.nan


def _finite(samples: list[TextSample], name: str) -> list[float]:
    return [v for s in samples if math.isfinite(v := getattr(s, name))]


def summarize(samples: list[Sample], version: int | None) -> VersionStats:
    mine = [s for s in samples if s.version == version]
    latencies = np.asarray([s.latency_ms for s in mine if s.ok]) if mine else np.asarray([])
    ok = [s for s in mine if s.ok]
    return VersionStats(version=version, requests=len(mine), errors=len(mine) - len(ok),
                        error_rate=_share(len(mine) - len(ok), len(mine)),
                        non_finite=sum(not s.finite for s in ok), agreement=_share(sum(s.agrees for s in ok), len(ok)),
                        p50_ms=_percentile(latencies, 50), p90_ms=_percentile(latencies, 90),
                        p99_ms=_percentile(latencies, 99))


def summarize_text(samples: list[TextSample], version: int | None) -> TextStats:
    mine = [s for s in samples if s.version == version]
    ok = [s for s in mine if s.ok]
    ttft, itl = np.asarray(_finite(ok, "ttft_ms")), np.asarray(_finite(ok, "itl_ms"))
    errors = [s.error or str(s.status) for s in mine if not s.ok]
    return TextStats(version=version, streams=len(mine), errors=len(errors),
                     error_rate=_share(len(errors), len(mine)), first_error=errors[0] if errors else "",
                     text_agreement=_share(sum(s.matches for s in ok), len(ok)),
                     ttft_p50_ms=_percentile(ttft, 50), ttft_p99_ms=_percentile(ttft, 99),
                     itl_p50_ms=_percentile(itl, 50), itl_p99_ms=_percentile(itl, 99),
                     engine_ttft_p50_ms=_percentile(_finite(ok, "engine_ttft_ms"), 50),
                     engine_itl_p50_ms=_percentile(_finite(ok, "engine_itl_ms"), 50))


def latency_test(canary_ms: list[float], baseline_ms: list[float]) -> LatencyTest:
    """One-sided Mann-Whitney U: small p means the canary's latencies are stochastically larger.
    ``median_difference_ms``: the Hodges-Lehmann shift, the median of every canary-minus-stable
    difference (the effect size that goes with the U test)."""
    from scipy.stats import mannwhitneyu

    test = mannwhitneyu(canary_ms, baseline_ms, alternative="greater")
    canary, baseline = np.asarray(canary_ms), np.asarray(baseline_ms)
    if canary.size * baseline.size > HODGES_LEHMANN_PAIRS:  # every n1 x n2 difference: thin both evenly
        step = math.ceil(math.sqrt(canary.size * baseline.size / HODGES_LEHMANN_PAIRS))
        canary, baseline = np.sort(canary)[::step], np.sort(baseline)[::step]
    shift = float(np.median(np.subtract.outer(canary, baseline)))
    return LatencyTest(u=float(test.statistic), p_value=float(test.pvalue), median_difference_ms=shift,
                       median_ratio=float(np.median(canary_ms)) / max(float(np.median(baseline_ms)), 1e-9))


def latency_verdict(test: LatencyTest, max_ratio: float, params: CanarySettings, min_slowdown_ms: float = 0.0
                    ) -> Verdict:
    """Pass unless slower (p < alpha) by more than ``max_ratio`` and by at least
    ``min_slowdown_ms`` (the test's median difference; 0: no floor); fail past ``max_ratio`` times
    ``clearly_slower_factor``; inconclusive between the two."""
    if test.p_value >= params.latency_alpha or test.median_ratio <= max_ratio:
        return PASS
    if min_slowdown_ms > 0 and test.median_difference_ms is not None and test.median_difference_ms < min_slowdown_ms:
        return PASS
    return FAIL if test.median_ratio > max_ratio * params.clearly_slower_factor else INCONCLUSIVE


def min_slowdown_ms(figure: str, params: CanarySettings) -> float:
    """The milliseconds a latency (``latency``, ``ttft``, ``itl``) must grow by, besides its
    ratio, to count as slower: ``canary.ttft_min_slowdown_ms`` for the time to first token."""
    return params.ttft_min_slowdown_ms if figure == "ttft" else 0.0


def floor_note(slowdown_ms: float) -> str:
    """A latency check's detail names its floor, where it has one."""
    return f"; slower only past +{slowdown_ms:g} ms" if slowdown_ms else ""


def judge_latency(checks: Checks, name: str, label: str, timings: Timings, max_ratio: float,
                  params: CanarySettings) -> LatencyTest:
    """``name``'s verdict (:func:`latency_verdict`, with its floor: :func:`min_slowdown_ms`) on
    the canary's latencies against stable's (Mann-Whitney U; ``timings.measured``: how they were
    timed, for the detail); returns the test."""
    test = latency_test(timings.canary_ms, timings.baseline_ms)
    measured, slowdown_ms = timings.measured, min_slowdown_ms(name, params)
    checks.add(name, latency_verdict(test, max_ratio, params, slowdown_ms), test.median_ratio, max_ratio,
               f"median {label} {test.median_ratio:.2f}x stable's ({test.median_difference_ms:+.2f} ms)"
               f"{', ' + measured if measured else ''} (Mann-Whitney U p={test.p_value:.2g}, alpha "
               f"{params.latency_alpha}{floor_note(slowdown_ms)})")
    return LatencyTest(test.p_value, test.median_ratio, u=test.u, median_difference_ms=test.median_difference_ms,
                       measured=measured)


def step_timings(mine: list[TextSample], theirs: list[TextSample], key: str, wanted: int) -> Timings:
    """The canary's and stable's figures of ``key`` (``ttft_ms``, ``itl_ms``) at a step, and how
    they were measured: by the engines themselves where both sides have ``wanted`` of them (what
    the versions did: at 100% the canary's engine holds every routed stream, users' included,
    while stable's holds deploy's baseline alone, and an identical copy's time to first token as
    deploy received it read 10.9x stable's: the two engines' queues for a slot), else as deploy's
    client received the chunks (an engine that does not time itself; a platform whose split
    keeps no records)."""
    engine = _finite(mine, f"engine_{key}"), _finite(theirs, f"engine_{key}")
    if min(len(engine[0]), len(engine[1])) >= wanted:
        return Timings(engine[0], engine[1], ENGINE_TIMED)
    return Timings(_finite(mine, key), _finite(theirs, key), CLIENT_TIMED)


def logits_timings(samples: list[Sample], stable_side: list[Sample], scope: StepScope,
                   compute: dict[int, list[float]] | None, wanted: int) -> Timings:
    """The canary's and stable's logits figures, and how they were measured: each version's
    compute time per request as Triton timed it over the step's intervals (``compute``: Kayenta
    compares metric series so), where both have ``wanted`` intervals; else the latencies as
    deploy's client received them. On 2 busy cores the latency is mostly the wait in each
    version's queue: an identical copy read 3.2x stable's latency with equal compute times (queue
    271 vs 171 ms, compute 34.9 vs 32.7 ms per request)."""
    series, stable, canary = compute or {}, scope.stable, scope.canary
    if stable is not None and min(len(series.get(canary, [])), len(series.get(stable, []))) >= wanted:
        return Timings(series[canary], series[stable], TRITON_TIMED)
    return Timings([s.latency_ms for s in samples if s.version == canary and s.ok],
                   [s.latency_ms for s in stable_side if s.version == stable and s.ok], CLIENT_TIMED)


def judge_text(traffic: StepTraffic, scope: StepScope, params: CanarySettings) -> tuple[TextReport, list[Check]]:
    """The text endpoint's checks for one step (``traffic.text``: through the router;
    ``traffic.text_direct``: straight to stable): enough streams, their error rate, text equal to
    the reference, and time to first token and inter-token latency against stable's (the same
    Mann-Whitney rule as the logits latency, on the engines' own figures where recorded:
    :func:`step_timings`); ``scope.baseline_only``: stable's side is the streams sent straight to
    the fresh baseline, not those the route gave the long-running stable pods."""
    samples, direct, stable = traffic.text or [], traffic.text_direct, scope.stable
    stable_side = direct if scope.baseline_only else samples + direct
    canary_stats, stable_stats = summarize_text(samples, scope.canary), summarize_text(stable_side, stable)
    checks = Checks()
    n, wanted, weight = canary_stats.streams, params.text_min_samples, scope.weight
    checks.add("text_samples", enough(n, wanted), n, wanted, f"{n} canary streams at {weight:g}%")
    checks.add("stream_error_rate", canary_stats.error_rate <= params.max_error_rate, canary_stats.error_rate,
               params.max_error_rate, f"{canary_stats.errors} of {n} canary streams failed or were cut"
               + (f" (first: {canary_stats.first_error})" if canary_stats.first_error else ""))
    checks.add("text_agreement", canary_stats.text_agreement >= params.min_text_agreement,
               canary_stats.text_agreement, params.min_text_agreement,
               f"{canary_stats.text_agreement:.0%} of canary greedy completions equal the export's PyTorch reference")
    tests: dict[str, LatencyTest] = {}
    canary_ok = [s for s in samples if s.version == scope.canary and s.ok]
    stable_ok = [s for s in stable_side if s.version == stable and s.ok]
    for key, label in (("ttft_ms", "time to first token"), ("itl_ms", "inter-token latency")):
        timings = step_timings(canary_ok, stable_ok, key, wanted)
        if timings.enough(wanted):
            tests[key] = judge_latency(checks, key.removesuffix("_ms"), label, timings,
                                       params.text_max_latency_ratio, params)
        elif stable is not None and len(timings.baseline_ms) < wanted:  # (a canary short of samples: text_samples)
            checks.add(f"stable_{key.removesuffix('_ms')}_samples", INCONCLUSIVE, len(timings.baseline_ms), wanted,
                       f"{len(timings.baseline_ms)} stable streams with a {label} at {weight:g}%: no baseline to "
                       "compare with")
    return TextReport(canary_stats, stable_stats, len(direct), tests), checks.taken


def judge_step(traffic: StepTraffic, scope: StepScope, params: CanarySettings) -> StepResult:
    """One step's summary and checks (``passed`` False when any failed): ``traffic.samples`` came
    through the router, ``traffic.direct`` went straight to stable in the same window (see
    :func:`tasks.serving.traffic.split_rates`); the canary's latencies are compared with all of
    stable's, or (``scope.baseline_only``: a fresh baseline of stable beside the canary) with the
    baseline's alone; ``traffic.compute``: per version, Triton's compute time per request in each
    interval of the window (:func:`logits_timings`). ``traffic.text``/``text_direct``: the
    streamed completions of the same window (:func:`judge_text`; None: none judged)."""
    samples, direct, stable, weight = traffic.samples, traffic.direct, scope.stable, scope.weight
    stable_side = direct if scope.baseline_only else samples + direct
    canary_stats, stable_stats = summarize(samples, scope.canary), summarize(stable_side, stable)
    unrouted = [s for s in samples if s.version is None]
    timings = logits_timings(samples, stable_side, scope, traffic.compute, params.min_samples)
    checks = Checks()
    n = canary_stats.requests
    checks.add("canary_samples", enough(n, params.min_samples), n, params.min_samples,
               f"{n} canary requests at {weight:g}%")
    checks.add("error_rate", canary_stats.error_rate <= params.max_error_rate, canary_stats.error_rate,
               params.max_error_rate, f"{canary_stats.errors} of {n} canary requests failed")
    checks.add("finite_logits", canary_stats.non_finite == 0, canary_stats.non_finite, 0,
               f"{canary_stats.non_finite} canary responses had NaN/inf logits")
    checks.add("next_token_agreement", canary_stats.agreement >= params.min_agreement, canary_stats.agreement,
               params.min_agreement, f"{canary_stats.agreement:.1%} of canary next tokens equal the export reference")
    latency: LatencyTest | None = None
    if timings.enough(params.min_samples):
        latency = judge_latency(checks, "latency", "latency", timings, params.max_latency_ratio, params)
    elif stable is not None:
        checks.add("stable_samples", INCONCLUSIVE, len(timings.baseline_ms), params.min_samples,
                   f"{len(timings.baseline_ms)} stable latencies at {weight:g}%: no baseline to compare the canary with")
    text_report: TextReport | None = None
    if traffic.text is not None:
        text_report, text_checks = judge_text(traffic, scope, params)
        checks.taken += text_checks
    return StepResult(weight=weight, canary=canary_stats, stable=stable_stats, unrouted=len(unrouted),
                      direct_to_stable=len(direct), baseline="fresh" if scope.baseline_only else "stable",
                      text=text_report, latency_test=latency, checks=tuple(checks.taken))


def paired_test(shadow_ms: list[float], stable_ms: list[float]) -> LatencyTest:
    """One-sided Wilcoxon signed-rank on the per-request differences (shadow - stable): small p
    means the shadow is slower on the same requests. ``median_ratio``: of the two medians."""
    from scipy.stats import wilcoxon

    differences = np.asarray(shadow_ms) - np.asarray(stable_ms)
    p_value = 1.0 if not np.any(differences) else float(wilcoxon(differences, alternative="greater").pvalue)
    return LatencyTest(p_value=p_value, median_difference_ms=float(np.median(differences)),
                       median_ratio=float(np.median(shadow_ms)) / max(float(np.median(stable_ms)), 1e-9))


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


def shadow_side(records: list[dict[str, Any]]) -> ShadowSide:
    """One side's figures of the shadow stage, from the front's records of its answers."""
    def finite(key: str) -> np.ndarray[Any, Any]:
        return np.asarray([v for r in records if math.isfinite(v := r.get(key, math.nan))])

    ttft, itl = finite("ttft_ms"), finite("itl_ms")
    return ShadowSide(ttft_p50_ms=_percentile(ttft, 50), ttft_p99_ms=_percentile(ttft, 99),
                      itl_p50_ms=_percentile(itl, 50), itl_p99_ms=_percentile(itl, 99),
                      engine_ttft_p50_ms=_percentile(finite("engine_ttft_ms"), 50),
                      engine_itl_p50_ms=_percentile(finite("engine_itl_ms"), 50))


def judge_shadow(pairs: list[dict[str, Any]], stable: int, shadow: int, params: CanarySettings) -> ShadowResult:
    """The shadow stage's checks on requests whose user got stable's answer (``pairs``:
    :func:`tasks.serving.traffic.pair_records`): the copies' errors (a copy never recorded
    counts as one), their text against the new version's own reference, agreement with
    stable's answer (exact and token by token), and time to first token and inter-token latency
    compared request by request (:func:`paired_test`)."""
    served = [p for p in pairs if p["stable"] is not None and p["stable"]["ok"]]
    dropped = [p for p in served if p["shadow"] is not None and p["shadow"]["error"].startswith("dropped")]
    judged = [p for p in served if p not in dropped]  # a copy the front never ran tells nothing of the shadow
    copies = [p["shadow"] for p in judged if p["shadow"] is not None and p["shadow"]["ok"]]
    failures = [p["shadow"]["error"] or str(p["shadow"]["status"]) if p["shadow"] else "no answer recorded"
                for p in judged if p["shadow"] is None or not p["shadow"]["ok"]]
    both = [p for p in judged if p["shadow"] is not None and p["shadow"]["ok"]]
    texts = ["".join(c["chunks"]) for c in copies]
    same = [token_agreement(p["shadow"]["chunks"], p["stable"]["chunks"]) for p in both]
    checks = Checks()
    wanted = params.text_min_samples
    unrecorded = sum(p["stable"] is None for p in pairs)
    checks.add("shadow_samples", enough(len(judged), wanted), len(judged), wanted,
               f"{len(judged)} requests answered by stable and copied to the shadow"
               + (f" ({unrecorded} of {len(pairs)} sent have no record of stable's answer)" if unrecorded else "")
               + (f" ({len(dropped)} copies dropped by the front: too many in flight)" if dropped else ""))
    error_rate = _share(len(failures), len(judged))
    checks.add("shadow_error_rate", error_rate <= params.max_error_rate, error_rate, params.max_error_rate,
               f"{len(failures)} of {len(judged)} shadow copies failed" + (f" (first: {failures[0]})" if failures else ""))
    # without answers to compare, agreement is unknown: inconclusive, not 0%
    reference = _share(sum(t == p["expected"] for t, p in zip(texts, both, strict=True)), len(both))
    checks.add("shadow_text_agreement", reference >= params.min_text_agreement if both else INCONCLUSIVE, reference,
               params.min_text_agreement,
               f"{reference:.0%} of the shadow's {len(both)} greedy completions equal its export's PyTorch reference")
    exact = _share(sum("".join(p["shadow"]["chunks"]) == "".join(p["stable"]["chunks"]) for p in both), len(both))
    checks.add("shadow_stable_agreement", exact >= params.shadow_min_stable_agreement if both else INCONCLUSIVE, exact,
               params.shadow_min_stable_agreement,
               f"{exact:.0%} of the shadow's answers equal stable's to the same request")
    tests: dict[str, LatencyTest] = {}
    for key, label in (("ttft_ms", "time to first token"), ("itl_ms", "inter-token latency")):
        paired, measured = paired_timings(both, key, wanted)
        name = f"shadow_{key.removesuffix('_ms')}"
        if len(paired) < wanted:
            checks.add(name, INCONCLUSIVE, len(paired), wanted, f"{len(paired)} paired {label}s: too few to compare")
            continue
        found = paired_test([a for a, _ in paired], [b for _, b in paired])
        test = tests[key] = LatencyTest(found.p_value, found.median_ratio,
                                        median_difference_ms=found.median_difference_ms, measured=measured)
        slowdown_ms = min_slowdown_ms(key.removesuffix("_ms"), params)
        checks.add(name, latency_verdict(test, params.text_max_latency_ratio, params, slowdown_ms), test.median_ratio,
                   params.text_max_latency_ratio,
                   f"median {label} {test.median_ratio:.2f}x stable's on the same {len(paired)} requests "
                   f"(per request {found.median_difference_ms:+.2f} ms), {measured} (Wilcoxon signed-rank "
                   f"p={test.p_value:.2g}, alpha {params.latency_alpha}{floor_note(slowdown_ms)})")
    users: list[TextSample] = [p["user"] for p in pairs]
    users_ttft = np.asarray([u.ttft_ms for u in users if u.ok and math.isfinite(u.ttft_ms)])
    agreement = Agreement(reference=reference, stable_exact=exact,
                          stable_tokens=float(np.mean([a for a, _ in same])) if same else math.nan,
                          first_divergence_median=float(np.median([i for _, i in same])) if same else math.nan)
    return ShadowResult(stable_version=stable, shadow_version=shadow, requests=len(pairs), served=len(judged),
                        copies_ok=len(copies), shadow_errors=len(failures), copies_dropped=len(dropped),
                        stable=shadow_side([p["stable"] for p in both]), shadow=shadow_side([p["shadow"] for p in both]),
                        agreement=agreement,
                        users=UsersSeen(requests=len(users), errors=sum(not u.ok for u in users),
                                        ttft_p50_ms=_percentile(users_ttft, 50)),
                        paired_tests=tests, checks=tuple(checks.taken))
