"""The rollout's path without servers: the :class:`tasks.deploy.Plan`'s transitions (which stage
follows each verdict, where it holds, what a person's decision does) and a :class:`tasks.deploy.Rollout`
walking them against a recording platform (routes, promotion, rollback, the report's ending)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tasks.contract import EXTEND, PROMOTE, ROLL_BACK, RolloutVerdict
from tasks.deploy import Plan, Position, Rollout, Stage
from tasks.lib.params import load_settings
from tasks.serving.canary import Approval, CanaryReport, Verdict

PASS, FAIL, INCONCLUSIVE = Verdict.PASS, Verdict.FAIL, Verdict.INCONCLUSIVE


def settings(*overrides: str) -> Any:
    return load_settings("canary", ["steps=[10, 50, 100]", *overrides])


def plan(stable: int | None = 4, hold: bool = False, *overrides: str) -> Plan:
    return Plan.of(settings(*overrides).canary, stable, hold)


def walk(through: Plan, verdicts: list[Verdict]) -> list[Position]:
    """The positions ``through`` passes when its stages end with ``verdicts`` in turn."""
    at, seen = through.start(), []
    for verdict in verdicts:
        seen.append(at)
        at = through.after(at, verdict, "why")
    return [*seen, at]


def test_a_passing_rollout_walks_prepare_shadow_each_step_then_promotes() -> None:
    shadowed = plan(4, False, "shadow=true")
    assert [(p.stage, p.weight) for p in walk(shadowed, [PASS] * 5)] == [
        (Stage.PREPARE, 0.0), (Stage.SHADOW, 0.0), (Stage.STEP, 10.0), (Stage.STEP, 50.0), (Stage.STEP, 100.0),
        (Stage.PROMOTE, 100.0)]
    unshadowed = plan(4, False, "shadow=false")
    assert [p.stage for p in walk(unshadowed, [PASS] * 4)] == [Stage.PREPARE, Stage.STEP, Stage.STEP, Stage.STEP,
                                                               Stage.PROMOTE]
    # the first model: nothing to compare with, no shadow, one step at 100%
    first = plan(None, False, "shadow=true")
    assert [(p.stage, p.weight) for p in walk(first, [PASS, PASS])] == [
        (Stage.PREPARE, 0.0), (Stage.STEP, 100.0), (Stage.PROMOTE, 100.0)]


def test_a_failure_rolls_back_where_it_happened_and_says_why() -> None:
    shadowed = plan(4, False, "shadow=true")
    assert walk(shadowed, [FAIL])[-1] == Position(Stage.ROLL_BACK, 0.0, "why")  # (smoke test: the reason says so)
    assert walk(shadowed, [PASS, FAIL])[-1] == Position(Stage.ROLL_BACK, 0.0, "shadow: why")
    assert walk(shadowed, [PASS, PASS, PASS, FAIL])[-1] == Position(Stage.ROLL_BACK, 50.0, "why")
    # without a person to ask, inconclusive after every analysis fails as a failure does
    assert walk(shadowed, [PASS, PASS, INCONCLUSIVE])[-1] == Position(Stage.ROLL_BACK, 10.0, "why")
    assert walk(shadowed, [PASS, INCONCLUSIVE])[-1] == Position(Stage.ROLL_BACK, 0.0, "shadow: why")


def test_with_approval_it_holds_before_hold_before_and_where_still_inconclusive() -> None:
    held = plan(4, True, "shadow=true", "approval.hold_before=100")
    assert walk(held, [PASS, PASS, PASS, PASS])[-1] == Position(Stage.HELD, 50.0, "held before 100% for approval")
    assert walk(held, [PASS, PASS, INCONCLUSIVE])[-1] == Position(Stage.HELD, 10.0, "why")
    assert walk(held, [PASS, INCONCLUSIVE])[-1] == Position(Stage.HELD, 0.0, "shadow: why")
    assert walk(held, [PASS, PASS, FAIL])[-1] == Position(Stage.ROLL_BACK, 10.0, "why")  # a failure is no question
    assert walk(held, [INCONCLUSIVE])[-1].stage is Stage.ROLL_BACK  # (a smoke test is never a question either)
    early = plan(4, True, "shadow=false", "approval.hold_before=10")
    assert walk(early, [PASS])[-1] == Position(Stage.HELD, 0.0, "held before 10% for approval")
    first = plan(None, True, "approval.hold_before=50")  # the first model holds before its only step
    assert walk(first, [PASS])[-1] == Position(Stage.HELD, 0.0, "held before 100% for approval")


def test_a_persons_decision_rolls_back_extends_the_held_stage_or_goes_on() -> None:
    decide = plan(4, False, "shadow=true")  # (finish walks without holding again)
    at_50, at_0 = Position(Stage.HELD, 50.0, "held"), Position(Stage.HELD, 0.0, "held")

    def answer(decision: str, by: str | None = "admin") -> Approval:
        return Approval(enabled=True, decision=decision, by=by, at="2026-11-26 04:00:00+00:00")

    assert decide.decided(at_50, answer(ROLL_BACK), 7200) == Position(Stage.ROLL_BACK, 50.0, "rolled back by admin")
    assert decide.decided(at_0, answer(ROLL_BACK, None), 7200) == Position(
        Stage.ROLL_BACK, 0.0, "no decision within 7200s (approval.timeout_s): rolled back")
    assert decide.decided(at_50, answer(PROMOTE), 7200) == Position(Stage.STEP, 100.0)
    extended = decide.decided(at_50, answer(EXTEND), 7200)
    assert extended == Position(Stage.STEP, 50.0, extended=True)
    assert decide.after(extended, PASS) == Position(Stage.STEP, 100.0)
    assert decide.after(extended, INCONCLUSIVE, "why") == Position(Stage.ROLL_BACK, 50.0, "extended: why")
    assert decide.decided(at_0, answer(EXTEND), 7200) == Position(Stage.SHADOW, 0.0, extended=True)
    assert decide.after(Position(Stage.SHADOW, 0.0, extended=True), FAIL, "why") == Position(
        Stage.ROLL_BACK, 0.0, "extended: why")
    assert plan(4, False, "shadow=false").decided(at_0, answer(EXTEND), 7200) == Position(Stage.STEP, 10.0)


class Recording:
    """A serving platform that records what a rollout asks of it."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def route(self, stable: int | None, canary: int | None = None, weight: float = 0.0,
              shadow: int | None = None) -> None:
        self.calls.append(("route", stable, canary, weight, shadow))

    def promote(self, version: int) -> None:
        self.calls.append(("promote", version))

    def roll_back(self, stable: int | None) -> None:
        self.calls.append(("roll_back", stable))


class Scripted(Rollout):
    """A rollout whose stages end with the given verdicts (no traffic, no analysis)."""

    def __init__(self, verdicts: list[Verdict], hold: bool, *overrides: str) -> None:
        report = CanaryReport(stable=4, canary=5, approval=Approval(enabled=hold))
        super().__init__(Recording(), settings(*overrides), {}, report, hold)  # type: ignore[arg-type]
        self.verdicts, self.ran = list(verdicts), []

    def run(self, at: Position) -> tuple[Verdict, str]:
        self.ran.append((at.stage, at.weight))
        return self.verdicts.pop(0), f"{at.stage} {at.weight:g}"

    prepare = shadow = step = run


@pytest.mark.parametrize(("verdicts", "hold", "verdict", "calls"), [
    ([PASS] * 5, False, RolloutVerdict.PROMOTED, [("promote", 5)]),
    ([PASS, PASS, FAIL], False, RolloutVerdict.ROLLED_BACK, [("roll_back", 4)]),
    ([PASS, PASS, PASS, PASS], True, RolloutVerdict.HELD, [("route", 4, 5, 50.0, None)]),
    ([PASS, INCONCLUSIVE], True, RolloutVerdict.HELD, [("route", 4, 5, 0.0, None)]),
], ids=["promoted", "rolled-back", "held-before-100", "held-in-shadow"])
def test_a_rollout_ends_promoted_rolled_back_or_held_with_its_traffic_where_it_is(
        verdicts: list[Verdict], hold: bool, verdict: RolloutVerdict, calls: list[tuple[Any, ...]]) -> None:
    rollout = Scripted(verdicts, hold, "shadow=true", "approval.hold_before=100")
    report = rollout.roll_out(rollout.plan.start())
    assert report.verdict == verdict and rollout.serving.calls == calls  # type: ignore[attr-defined]
    assert rollout.ran[0] == (Stage.PREPARE, 0.0) and not rollout.verdicts
    ended = json.loads(json.dumps(report_json(report)))
    if verdict == RolloutVerdict.HELD:
        assert ended["held_at"] == rollout.ran[-1][1] and "failed_at" not in ended
    elif verdict == RolloutVerdict.ROLLED_BACK:
        assert (ended["failed_at"], ended["reason"]) == (10.0, "step 10") and "held_at" not in ended
    else:
        assert "failed_at" not in ended and "reason" not in ended


def report_json(report: CanaryReport) -> Any:
    from tasks.serving.canary import to_json

    return to_json(report)
