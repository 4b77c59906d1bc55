"""The canary report: what a rollout's stages found, as typed values, and their JSON in one place.

A check (:class:`Check`) passes, fails or is inconclusive (:class:`Verdict`); a stage's analysis
(:class:`StepResult` for a traffic step, :class:`ShadowResult` for the shadow) holds its figures
and checks, its verdict the worst of theirs; :class:`CanaryReport` is the whole rollout
(``report.json`` of ``tasks.deploy``), :class:`RolloutSummary` the step's result (its XCom,
what the run report and the DAG read). They become JSON and are read back by
:func:`tasks.contract.to_json` and :func:`tasks.contract.from_json`, as every step's result is:
the JSON keeps the field names (a field absent before it was known, as ``held_at``, is left out
while it is None).

How the figures are gathered is :mod:`tasks.serving.traffic`'s concern, how they are judged
:mod:`tasks.serving.analysis`'s, their chart :mod:`tasks.serving.plots`'.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import TypeVar

from tasks.contract import EMPTY_IF_NONE, OMIT_IF_NONE, ROLLOUT_VERDICT, RolloutVerdict, omit_unless
from tasks.contract import from_json as from_json  # (re-exported: the report's readers import them from here)
from tasks.contract import to_json as to_json


class Verdict(StrEnum):
    """A check's, an analysis's or a stage's verdict."""

    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"  # too few samples, or between "clearly fine" and "clearly bad": measured again

    @classmethod
    def of(cls, passed: bool) -> Verdict:
        return cls.PASS if passed else cls.FAIL


@dataclass(frozen=True)
class Check:
    check: str
    verdict: Verdict
    value: float
    limit: float
    detail: str
    passed: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "passed", self.verdict == Verdict.PASS)

    def reason(self) -> str:
        """One line: the check, what was measured, its limit (and ": inconclusive" unless failed)."""
        return f"{self.check}: {self.detail} (limit {self.limit:g})" + ("" if self.verdict == Verdict.FAIL else
                                                                        ": inconclusive")


@dataclass(frozen=True)
class Judgement:
    """Checks taken together: the worst of their verdicts, and the reasons of those that did not pass
    (failed first)."""

    verdict: Verdict
    failed: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return self.verdict == Verdict.PASS

    @classmethod
    def of(cls, checks: tuple[Check, ...] | list[Check]) -> Judgement:
        verdicts = {c.verdict for c in checks}
        verdict = (Verdict.FAIL if Verdict.FAIL in verdicts else Verdict.INCONCLUSIVE if Verdict.INCONCLUSIVE in verdicts
                   else Verdict.PASS)
        not_passed = sorted((c for c in checks if c.verdict != Verdict.PASS), key=lambda c: c.verdict != Verdict.FAIL)
        return cls(verdict, tuple(c.reason() for c in not_passed))


@dataclass(frozen=True)
class LatencyTest:
    """A latency comparison: Mann-Whitney U (``u``) on two windows' latencies, or the Wilcoxon
    signed-rank test on paired ones (``median_difference_ms``); ``measured``: how they were timed."""

    p_value: float
    median_ratio: float
    u: float | None = field(default=None, metadata=OMIT_IF_NONE)
    median_difference_ms: float | None = field(default=None, metadata=OMIT_IF_NONE)
    measured: str = ""


@dataclass(frozen=True)
class VersionStats:
    """One version's logits requests in a step's window."""

    version: int | None
    requests: int
    errors: int
    error_rate: float
    non_finite: int
    agreement: float  # next tokens equal to the export's reference
    p50_ms: float
    p90_ms: float
    p99_ms: float


@dataclass(frozen=True)
class TextStats:
    """One version's streamed completions in a step's window."""

    version: int | None
    streams: int
    errors: int
    error_rate: float
    first_error: str
    text_agreement: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    engine_ttft_p50_ms: float
    engine_itl_p50_ms: float


@dataclass(frozen=True)
class TextReport:
    canary: TextStats
    stable: TextStats
    direct_to_stable: int
    tests: dict[str, LatencyTest]  # by figure (ttft_ms, itl_ms)


@dataclass(frozen=True)
class StepResult:
    """One analysis of a traffic step: the canary's and stable's figures in one window, the checks."""

    weight: float
    canary: VersionStats
    stable: VersionStats
    unrouted: int
    direct_to_stable: int
    baseline: str  # "fresh": judged against a baseline of stable beside the canary alone; "stable"
    text: TextReport | None = field(metadata=EMPTY_IF_NONE)
    latency_test: LatencyTest | None = field(metadata=EMPTY_IF_NONE)
    checks: tuple[Check, ...]
    verdict: Verdict = field(init=False)
    passed: bool = field(init=False)
    failed: tuple[str, ...] = field(init=False)
    # set by deploy around the judging: its time, when each stream was sent, Triton's counters
    seconds: float | None = field(default=None, metadata=OMIT_IF_NONE)
    sent_s: dict[str, list[float]] | None = field(default=None, metadata=OMIT_IF_NONE)
    triton: dict[str, dict[str, float]] | None = field(default=None, metadata=OMIT_IF_NONE)
    analysis: int = 1  # the stage's how-manieth analysis (again while inconclusive)

    def __post_init__(self) -> None:
        _judged(self, self.checks)


@dataclass(frozen=True)
class ShadowSide:
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    engine_ttft_p50_ms: float
    engine_itl_p50_ms: float


@dataclass(frozen=True)
class Agreement:
    reference: float  # the shadow's text equal to its export's reference
    stable_exact: float  # equal to stable's answer to the same request
    stable_tokens: float  # the share of tokens in the two answers' common prefix
    first_divergence_median: float


@dataclass(frozen=True)
class UsersSeen:
    """What the users of the shadow stage got (stable's answers)."""

    requests: int
    errors: int
    ttft_p50_ms: float


@dataclass(frozen=True)
class ShadowResult:
    """One analysis of the shadow stage: the same requests answered by stable and by the new
    version (a mirrored copy), compared request by request."""

    stable_version: int
    shadow_version: int
    requests: int
    served: int
    copies_ok: int
    shadow_errors: int
    copies_dropped: int
    stable: ShadowSide
    shadow: ShadowSide
    agreement: Agreement
    users: UsersSeen
    paired_tests: dict[str, LatencyTest]
    checks: tuple[Check, ...]
    verdict: Verdict = field(init=False)
    passed: bool = field(init=False)
    failed: tuple[str, ...] = field(init=False)
    stage: str = "shadow"
    weight: float = 0.0
    seconds: float | None = field(default=None, metadata=OMIT_IF_NONE)
    analysis: int = 1

    def __post_init__(self) -> None:
        _judged(self, self.checks)


Analysis = TypeVar("Analysis", StepResult, ShadowResult)


def _judged(result: StepResult | ShadowResult, checks: tuple[Check, ...]) -> None:
    judged = Judgement.of(checks)
    object.__setattr__(result, "verdict", judged.verdict)
    object.__setattr__(result, "passed", judged.passed)
    object.__setattr__(result, "failed", judged.failed)


def why_not(result: StepResult | ShadowResult) -> str:
    """A stage's last analysis that did not pass, as one reason."""
    if result.verdict == Verdict.INCONCLUSIVE:
        return f"still inconclusive after {result.analysis} analyses: {result.failed[0]}"
    return result.failed[0]


@dataclass(frozen=True)
class Approval:
    """A person's part: whether the rollout holds for one, before which step, and (once
    decided) the decision, who made it (None: the timeout chose the default) and when."""

    enabled: bool = False
    hold_before: float = 100.0
    decision: str | None = field(default=None, metadata=OMIT_IF_NONE)
    by: str | None = field(default=None, metadata=omit_unless("decision"))
    at: str | None = field(default=None, metadata=omit_unless("decision"))


@dataclass(frozen=True)
class StepSummary:
    """A traffic step in the step's result: its last analysis's verdict, how many it took."""

    weight: float = 0.0
    passed: bool = False
    verdict: Verdict | None = None  # (None when read: from ``passed``)
    analyses: int = 1

    def __post_init__(self) -> None:
        if self.verdict is None:
            object.__setattr__(self, "verdict", Verdict.of(self.passed))


@dataclass(frozen=True)
class ShadowSummary:
    verdict: Verdict = Verdict.PASS
    analysis: int = 1


@dataclass(frozen=True)
class RolloutSummary:
    """``tasks.deploy``'s result (its XCom): how the rollout ended, where, why, each stage's
    verdict, the report's URI; ``approval_text`` for the person deciding a held one. Every field
    may be absent when read (a rollout that never started has no stages)."""

    verdict: RolloutVerdict | None = None
    stable: int | None = None
    canary: int | None = None
    aliases: dict[str, str | None] | None = field(default=None, metadata=OMIT_IF_NONE)
    held_at: float | None = field(default=None, metadata=OMIT_IF_NONE)
    failed_at: float | None = field(default=None, metadata=OMIT_IF_NONE)
    reason: str | None = field(default=None, metadata=OMIT_IF_NONE)
    approval: Approval | None = field(default=None, metadata=OMIT_IF_NONE)
    report_uri: str | None = field(default=None, metadata=OMIT_IF_NONE)
    steps: tuple[StepSummary, ...] = ()
    shadow: tuple[ShadowSummary, ...] = ()
    approval_text: str | None = field(default=None, metadata=OMIT_IF_NONE)


@dataclass(frozen=True)
class CanaryReport:
    """The whole rollout (``report.json``): versions, every analysis of each stage, the warm-ups,
    how it ended and where."""

    stable: int | None
    canary: int
    verdict: RolloutVerdict = RolloutVerdict.PROMOTED
    shadow: tuple[ShadowResult, ...] = ()
    steps: tuple[StepResult, ...] = ()
    approval: Approval | None = field(default=None, metadata=OMIT_IF_NONE)
    warmup_streams: int | None = field(default=None, metadata=OMIT_IF_NONE)
    baseline_warmup_streams: int | None = field(default=None, metadata=OMIT_IF_NONE)
    held_at: float | None = field(default=None, metadata=OMIT_IF_NONE)
    failed_at: float | None = field(default=None, metadata=OMIT_IF_NONE)
    reason: str | None = field(default=None, metadata=OMIT_IF_NONE)
    aliases: dict[str, str | None] | None = field(default=None, metadata=OMIT_IF_NONE)
    already_serving: bool | None = field(default=None, metadata=OMIT_IF_NONE)

    def summary(self, report_uri: str) -> RolloutSummary:
        """The step's result: per weight, its last analysis (how many it took); each shadow analysis."""
        last: dict[float, StepSummary] = {}
        for step in self.steps:
            last[step.weight] = StepSummary(step.weight, step.passed, step.verdict, step.analysis)
        return RolloutSummary(verdict=self.verdict, stable=self.stable, canary=self.canary, aliases=self.aliases,
                              held_at=self.held_at, failed_at=self.failed_at, reason=self.reason,
                              approval=self.approval, report_uri=report_uri, steps=tuple(last.values()),
                              shadow=tuple(ShadowSummary(s.verdict, s.analysis) for s in self.shadow))


for _typed in (CanaryReport, RolloutSummary):  # the DAG reads the verdict by this name: a rename fails here
    if ROLLOUT_VERDICT not in {f.name for f in fields(_typed)}:
        raise TypeError(f"{_typed.__name__} has no field {ROLLOUT_VERDICT!r} (tasks.contract.ROLLOUT_VERDICT)")

