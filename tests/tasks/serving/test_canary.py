"""The canary report's JSON: written and read back in one place, with the fields report.json,
the step's result, the run report and the DAG have always read."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import numpy as np

from tasks.contract import ROLLOUT_VERDICT, RolloutVerdict
from tasks.lib.params import load_settings
from tasks.serving.analysis import StepScope, judge_shadow, judge_step
from tasks.serving.canary import Approval, CanaryReport, RolloutSummary, StepResult, from_json, to_json
from tasks.serving.traffic import Sample, StepTraffic, TextSample


def judged_step(weight: float, analysis: int = 1) -> StepResult:
    rng = np.random.default_rng(int(weight))
    samples = [Sample(v, True, 200, float(x), True, True, 0.0) for v in (4, 5) for x in rng.lognormal(3, 0.1, 30)]
    text = [TextSample(v, True, 200, float(x), 2.0, 4, True, 0.0) for v in (4, 5) for x in rng.lognormal(2, 0.1, 12)]
    params = load_settings("canary").canary
    result = judge_step(StepTraffic(samples=samples, text=text), StepScope(4, 5, weight), params)
    return replace(result, seconds=8.5, sent_s={"routed": [0.0, 7.9], "direct": []},
                   triton={"5": {"success": 30.0, "avg_request_ms": 3.5}}, analysis=analysis)


def shadow_analysis() -> Any:
    params = load_settings("canary", ["text_min_samples=6"]).canary
    stable = {"ok": True, "status": 200, "ttft_ms": 9.0, "itl_ms": 2.0, "chunks": [" a", " b"], "error": ""}
    pairs = [{"request_id": f"{i:032x}", "expected": " a b", "user": TextSample(4, True, 200, 10.0, 2.0, 2, True, 0.0),
              "stable": stable, "shadow": {**stable, "ttft_ms": 9.0 + i % 3}} for i in range(10)]
    return replace(judge_shadow(pairs, 4, 5, params), seconds=8.0)


def round_trip(value: Any) -> Any:
    return json.loads(json.dumps(to_json(value), default=float))


def test_a_held_report_reads_back_as_it_was_written() -> None:
    report = CanaryReport(stable=4, canary=5, verdict=RolloutVerdict.HELD, shadow=(shadow_analysis(),),
                          steps=(judged_step(10.0), judged_step(50.0), judged_step(50.0, analysis=2)),
                          approval=Approval(enabled=True, hold_before=100), warmup_streams=8, held_at=50.0,
                          reason="held before 100% for approval")
    written = round_trip(report)
    back = from_json(CanaryReport, written)
    assert json.dumps(to_json(back)) == json.dumps(written)  # (NaN figures: compared as written)
    assert back.steps[2].analysis == 2 and back.steps[0].checks == report.steps[0].checks
    assert back.shadow[0].agreement == report.shadow[0].agreement and back.verdict is RolloutVerdict.HELD
    # the fields its readers use, in the shape they always had
    assert written["verdict"] == "held" and written["held_at"] == 50.0 and "failed_at" not in written
    assert written["approval"] == {"enabled": True, "hold_before": 100}  # undecided: no decision, by, at
    step = written["steps"][0]
    assert {"weight", "canary", "stable", "unrouted", "direct_to_stable", "baseline", "text", "latency_test", "checks",
            "verdict", "passed", "failed", "seconds", "sent_s", "triton", "analysis"} == set(step)
    assert set(step["checks"][0]) == {"check", "verdict", "passed", "value", "limit", "detail"}
    assert step["latency_test"]["measured"] and set(step["text"]["tests"]) == {"ttft_ms", "itl_ms"}
    assert step["text"]["canary"]["streams"] == 12 and step["canary"]["requests"] == 30
    shadow = written["shadow"][0]
    assert shadow["stage"] == "shadow" and shadow["weight"] == 0.0 and shadow["verdict"] in ("pass", "fail")
    assert set(shadow["paired_tests"]["ttft_ms"]) == {"p_value", "median_difference_ms", "median_ratio", "measured"}
    # a step judged without streams, or without a latency to compare: {} as before, and read back as None
    bare = replace(judged_step(10.0), text=None, latency_test=None)
    assert round_trip(bare)["text"] == {} and round_trip(bare)["latency_test"] == {}
    assert from_json(StepResult, round_trip(bare)).text is None


def test_the_steps_result_sums_each_stage_up_and_the_dag_reads_its_verdict() -> None:
    report = CanaryReport(stable=4, canary=5, verdict=RolloutVerdict.HELD, shadow=(shadow_analysis(),),
                          steps=(judged_step(10.0), judged_step(50.0), judged_step(50.0, analysis=2)),
                          approval=Approval(enabled=True, hold_before=100, decision="Extend", by=None, at="now"),
                          held_at=50.0, reason="held before 100% for approval")
    summary = round_trip(report.summary("s3://runs/deploy/report.json"))
    assert summary[ROLLOUT_VERDICT] == RolloutVerdict.HELD  # the DAG's approval_gate, as it compares
    assert [(s["weight"], s["analyses"]) for s in summary["steps"]] == [(10.0, 1), (50.0, 2)]
    assert set(summary["steps"][0]) == {"weight", "passed", "verdict", "analyses"}
    assert summary["shadow"] == [{"verdict": report.shadow[0].verdict, "analysis": 1}]
    assert summary["approval"] == {"enabled": True, "hold_before": 100, "decision": "Extend", "by": None, "at": "now"}
    assert summary["report_uri"] == "s3://runs/deploy/report.json" and "aliases" not in summary
    assert from_json(RolloutSummary, summary) == report.summary("s3://runs/deploy/report.json")
    # what another step's result gives (a partial one, a test's): the missing fields take their defaults
    partial = from_json(RolloutSummary, {"verdict": "rolled back", "failed_at": 10.0,
                                         "steps": [{"weight": 10.0, "passed": False}]})
    assert partial.verdict is RolloutVerdict.ROLLED_BACK and partial.canary is None
    assert partial.steps[0].verdict == "fail" and partial.steps[0].analyses == 1
