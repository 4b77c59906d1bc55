"""The run report: its verdict from task states and results, the summary lines, the HTML page.
(The DAG tests run it for real: a promoted run, a rejected challenger, a failed snapshot.)"""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from tasks import report
from tasks.config import load
from tasks.lib.errors import StepError

DONE = {t: "success" for t in report.STEPS}
RESULTS: dict[str, Any] = {
    "snapshot": {"data_version": {"tag": "data-2026-11-22-7d-abc", "records": 15000}, "duplicates_removed": 12},
    "validate": {"success": True, "evaluated": 20, "records": 15000, "report_uri": "s3://p/r/validate/report/index.html"},
    "tokenizer": {"vocab_size": 8192, "tokenizer_source": "champion"},
    "tokenize_merge": {"tokens": {"train": 1_200_000, "val": 60_000}},
    "train": {"steps": 300, "world_size": 2, "engine": "fsdp2", "tokens_per_s": 9000.0, "final_loss": 5.6,
              "val_loss": 5.7, "initialized_from": "models:/llm-retrain/1"},
    "evaluate": {"passed": True, "reasons": [], "challenger": {"eval_perplexity": 350.0, "eval_accuracy": 0.2},
                 "champion": {"eval_perplexity": 380.0, "registry_version": "1"}},
    "register": {"version": "2", "challenger": "2", "model_uri": "models:/llm-retrain/2"},
    "deploy": {"verdict": "promoted", "canary": 2, "aliases": {"champion": "2", "previous": "1"},
               "steps": [{"weight": 10.0, "passed": True}, {"weight": 100.0, "passed": True}]},
}


def build(states: dict[str, str], results: dict[str, Any], errors: dict[str, str] | None = None) -> dict[str, Any]:
    args = argparse.Namespace(dag_id="llm_retrain", run_id="manual__2026-11-22")
    return report.build_report(args, load(), states, results, errors)


def test_a_promoted_run_says_what_serves_and_how_to_query_it() -> None:
    built = build(DONE, RESULTS)
    assert (built["verdict"], built["outcome"]) == ("success", "version 2 serves as champion")
    lines = report.summary_lines(built)
    text = "\n".join(lines)
    assert "data-2026-11-22-7d-abc: 15000 records" in text and "1,200,000" in text
    assert "from models:/llm-retrain/1" in text and "vs champion v1 380" in text
    assert "promoted (10% -> 100%); champion v2, previous v1" in text
    assert "make predict" in text and "/v1/completions" in text


@pytest.mark.parametrize(
    ("states", "results", "verdict", "words"),
    [
        ({**DONE, "evaluate": "skipped", "register": "skipped", "export": "skipped", "deploy": "skipped"},
         {**RESULTS, "evaluate": {"passed": False, "reasons": ["eval perplexity 9e3 > max 2000"]}, "deploy": None},
         "rejected", "gate rejected the challenger: eval perplexity 9e3 > max 2000"),
        ({**DONE, "deploy": "failed"},
         {**RESULTS, "deploy": {"verdict": "rolled back", "failed_at": 10.0, "reason": "error rate 5% > 1%"}},
         "rolled back", "rolled back at 10%: error rate 5% > 1%"),
        ({**DONE, "deploy_gate": "success", "deploy": "skipped"}, {**RESULTS, "deploy": None},
         "deploy skipped", "version 2 registered and exported, not deployed"),
        ({**DONE, "deploy_gate": "success", "deploy": "skipped"},
         {**RESULTS, "deploy": {"verdict": "not deployed", "canary": 2,
                                "reason": "version 2's data ends 2026-11-15, before champion v3's (2026-11-22)"}},
         "deploy skipped", "not deployed: version 2's data ends 2026-11-15, before champion v3's (2026-11-22)"),
        ({**DONE, "snapshot": "failed", **{t: "upstream_failed" for t in report.STEPS[1:]}}, {},
         "failed", "failed at snapshot"),
        ({**DONE, "deploy_finish": "skipped"},  # a person's roll back: a gate
         {**RESULTS, "deploy": {"verdict": "held", "held_at": 50.0, "reason": "held before 100% for approval"},
          "deploy_finish": {"verdict": "rolled back", "failed_at": 50.0, "reason": "rolled back by admin",
                            "approval": {"decision": "Roll back", "by": "admin", "at": "2026-11-26 04:00"}}},
         "rolled back", "rolled back at 50%: rolled back by admin"),
        ({**DONE, "approve_rollout": "awaiting_input"},
         {**RESULTS, "deploy": {"verdict": "held", "canary": 2, "held_at": 50.0,
                                "reason": "held before 100% for approval"}},
         "held", "version 2 holds at 50% of traffic, waiting for a person's decision"),
    ],
    ids=["rejected", "rolled-back", "skip-deploy", "older-data", "failed", "rolled-back-by-a-person", "held"],
)
def test_verdict_follows_the_steps(states: dict[str, str], results: dict[str, Any], verdict: str, words: str) -> None:
    built = build(states, results)
    assert built["verdict"] == verdict and words in built["outcome"]
    assert "try it" not in "\n".join(report.summary_lines(built))  # nothing new serves


def test_an_approved_rollout_says_who_decided_what_and_when() -> None:
    finished = {**RESULTS["deploy"], "held_at": 50.0,
                "approval": {"enabled": True, "decision": "Promote", "by": "admin", "at": "2026-11-26 04:00:00+00:00"}}
    built = build({**DONE, "deploy_finish": "success"}, {**RESULTS, "deploy_finish": finished})
    assert built["verdict"] == "success"
    assert "  approval    held at 50%: Promote by admin at 2026-11-26 04:00:00+00:00" in report.summary_lines(built)
    timed_out = {**finished, "verdict": "rolled back", "failed_at": 50.0, "reason": "no decision within 7200s",
                 "approval": {**finished["approval"], "decision": "Roll back", "by": None}}
    built = build({**DONE, "deploy_finish": "failed"}, {**RESULTS, "deploy_finish": timed_out})
    assert built["verdict"] == "rolled back" and "no answer in time, Roll back (the default)" in \
        "\n".join(report.summary_lines(built))


def test_a_run_drift_started_links_the_drift_report_above_its_chain() -> None:
    """One chain top to bottom: what started the run, the data version, the registered version, the canary."""
    extra = {"drift_report": "s3://pipeline/runs/llm_drift/r1/drift/report.html", "drift_run": "llm_drift/r1",
             "drift_reasons": ["byte fallback: 64.0% of tokens"], "champion": "1"}
    args = argparse.Namespace(dag_id="llm_retrain", run_id="asset_triggered__2026-11-26", trigger=json.dumps(extra))
    built = report.build_report(args, load(), DONE, RESULTS)
    lines = report.summary_lines(built)
    assert built["trigger"] == extra
    assert lines[1] == ("  started by  drift in served traffic (byte fallback: 64.0% of tokens): "
                        "s3://pipeline/runs/llm_drift/r1/drift/report.html (llm_drift/r1)")
    assert [line.split()[0] for line in lines[2:4]] == ["data", "validation"] and "champion v2" in "\n".join(lines)
    assert "drift report (what started this run)" in report.render_html(built, lines, None, None, None, None)
    assert "started by" not in "\n".join(report.summary_lines(build(DONE, RESULTS)))  # no --trigger: not drift


def test_html_page_escapes_what_the_model_wrote(tmp_path: Any) -> None:
    built = build(DONE, RESULTS)
    samples = {"challenger": [{"prompt": "p", "completion": "<script>alert(1)</script>"}], "champion": None}
    page = report.render_html(built, report.summary_lines(built), None, None, samples, "http://mlflow/#/x")
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert '<a href="http://mlflow/#/x">' in page and "<td>eval_perplexity</td><td>350</td><td>380</td>" in page


def test_a_failed_run_quotes_its_steps_error_line(tmp_path: Any) -> None:
    states = {**DONE, "validate": "failed", **{t: "upstream_failed" for t in report.STEPS[2:]}}
    line = "ERROR python -m tasks.validate: 3 of 20 expectations failed (text_not_empty: 41 records)"
    errors = report.parse_errors([f"snapshot={json.dumps(None)}", f"validate={json.dumps(line)}"])
    built = build(states, RESULTS, errors)
    assert built["outcome"] == f"failed at validate: {line}" and built["errors"] == {"validate": line}
    assert report.summary_lines(built)[0].endswith(f"FAILED: failed at validate: {line}")
    page = report.render_html(built, report.summary_lines(built), None, None, None, None)
    assert "failed at validate: ERROR python -m tasks.validate: 3 of 20 expectations failed" in page
    # no line recorded (an older launcher, a pod killed before it logged): where to look instead
    assert build(states, RESULTS)["outcome"] == "failed at validate (its task log has the ERROR line)"


def test_bad_arguments_are_one_clear_error() -> None:
    with pytest.raises(StepError, match="expected STEP=JSON"):
        report.parse_results(["nope={}"])
    with pytest.raises(StepError, match="--result train: not JSON"):
        report.parse_results(["train={oops"])
    assert report.parse_results(["deploy=null"]) == {"deploy": None}
    with pytest.raises(StepError, match="--error train: expected a JSON string or null, got dict"):
        report.parse_errors(["train={}"])
    assert report.run_states(json.dumps({"run": {"snapshot": "success", "report": "running"}})) == {"snapshot": "success"}
