"""The run report: what a DAG run did, in a few lines, a JSON file and one HTML page.

    write  (the DAG's last task, an Airflow teardown: it runs whatever happened before it and
           leaves the run's state alone) gathers the steps' results and states into
           ``report.json``, ``summary.txt`` and a self-contained ``report.html`` (loss curve,
           evaluation table and samples, canary chart, links), saved with the run's outputs and
           logged to the DAG run's MLflow run, beside the validation's Data Docs.
    show   prints the summary of the newest run's report (``make pipeline`` ends with it).
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import html
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tasks.config import DEMO, ServeSettings, Settings, current_line
from tasks.contract import REPORTED_STEPS, RolloutVerdict, from_json, to_json
from tasks.lib import metrics, storage
from tasks.lib.errors import StepError
from tasks.lib.params import load_settings
from tasks.lib.step import log, run_step, step_parser
from tasks.lib.tracking import find_dag_run
from tasks.results import DriftRecheck, ReportResult, ReportShown
from tasks.serving.canary import Approval, CanaryReport, RolloutSummary

STEPS = REPORTED_STEPS  # the retrain DAG's, in its order


def rollout_step(results: dict[str, Any]) -> str:
    """The step with the rollout's last word: the finish of a rollout held for approval, where it
    reported, else deploy."""
    return "deploy_finish" if results.get("deploy_finish") else "deploy"


def rollout_result(results: dict[str, Any]) -> RolloutSummary | None:
    """The rollout's last word (:func:`rollout_step`'s result), typed; None where it gave none."""
    found = results.get(rollout_step(results))
    return from_json(RolloutSummary, found) if found else None


# the run report's account of the rollout: these fields of deploy's result
CANARY_FIELDS = ("verdict", "stable", "canary", "aliases", "shadow", "steps", "report_uri", "held_at", "approval")


def parse_results(items: list[str], option: str = "--result") -> dict[str, Any]:
    """``STEP=JSON`` pairs (an upstream task's XCom, ``null`` when it produced none)."""
    results: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or name not in STEPS:
            raise StepError(f"{option} {item[:60]!r}: expected STEP=JSON with STEP one of {', '.join(STEPS)}")
        try:
            results[name] = json.loads(raw) if raw.strip() else None
        except json.JSONDecodeError as exc:
            raise StepError(f"{option} {name}: not JSON ({exc})") from None
    return results


def run_states(raw: str) -> dict[str, str]:
    """Task states of this run (``ti.get_task_states`` for one run id: {run_id: {task: state}})."""
    try:
        by_run = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise StepError(f"--states: not JSON ({exc})") from None
    states: dict[str, str] = next(iter(by_run.values()), {}) if isinstance(by_run, dict) else {}
    return {task: str(state) for task, state in states.items() if task != "report"}


def parse_errors(items: list[str]) -> dict[str, str]:
    """``STEP=JSON`` pairs of a failed step's one-line error (its ``error`` XCom; ``null`` if none)."""
    errors: dict[str, str] = {}
    for name, value in parse_results(items, "--error").items():
        if value is not None and not isinstance(value, str):
            raise StepError(f"--error {name}: expected a JSON string or null, got {type(value).__name__}")
        if value:
            errors[name] = value.splitlines()[0]
    return errors


def outcome(states: dict[str, str], results: dict[str, Any], errors: dict[str, str] | None = None) -> tuple[str, str]:
    """(verdict, one line): success, rejected by the gate, rolled back, or failed at a step (with
    the step's own error line when the launcher recorded it)."""
    failed = [t for t in STEPS if states.get(t) == "failed"] + [
        t for t, s in states.items() if t not in STEPS and s == "failed"]
    deploy = rollout_result(results) or RolloutSummary()
    # a person's "Roll back" ends the rollout as a gate does (skipped); a failed check or no answer fails it
    if states.get(rollout_step(results)) in ("failed", "skipped") and deploy.verdict == RolloutVerdict.ROLLED_BACK:
        where = f"at {deploy.failed_at:g}%" if deploy.failed_at else "before any user reached it"
        return "rolled back", f"the canary was rolled back {where}: {deploy.reason}"
    if failed:
        error = (errors or {}).get(failed[0])
        return "failed", f"failed at {failed[0]}: {error}" if error else f"failed at {failed[0]} (its task log has the ERROR line)"
    evaluation = results.get("evaluate") or {}
    if states.get("evaluate") == "skipped" and evaluation.get("passed") is False:
        return "rejected", "the gate rejected the challenger: " + "; ".join(evaluation.get("reasons", []))
    if deploy.verdict == RolloutVerdict.PROMOTED:
        return "success", f"version {deploy.canary} serves as champion"
    if deploy.verdict == RolloutVerdict.HELD:
        return "held", (f"version {deploy.canary} holds at {deploy.held_at or 0:g}% of traffic, "
                        f"waiting for a person's decision ({deploy.reason})")
    registered = results.get("register") or {}
    if states.get("deploy") == "skipped" and registered.get("version"):
        why = f": {deploy.reason}" if deploy.reason else " (skip_deploy)"
        return "deploy skipped", f"version {registered['version']} registered and exported, not deployed{why}"
    pending = [t for t in STEPS if states.get(t) not in ("success", "skipped")]
    return "incomplete", f"not finished: {', '.join(pending) or 'unknown'}"


def endpoint(serve: ServeSettings) -> str:
    if os.environ.get("ROUTER_URL"):
        return os.environ["ROUTER_URL"].rstrip("/")
    return f"http://{serve.kubernetes.hostname}"


def query_command(url: str, model: str) -> str:
    """A streamed completion through the OpenAI-compatible API (any OpenAI client works too)."""
    body = {"model": model, "prompt": "Return the number of", "max_tokens": 24, "stream": True}
    return f"curl -sN {url}/v1/completions -H 'Content-Type: application/json' -d '{json.dumps(body)}'"


def build_report(args: argparse.Namespace, settings: Settings, states: dict[str, str], results: dict[str, Any],
                 errors: dict[str, str] | None = None) -> dict[str, Any]:
    verdict, line = outcome(states, results, errors)
    snap, val, merged = results.get("snapshot") or {}, results.get("validate") or {}, results.get("tokenize_merge") or {}
    tokenizer = results.get("tokenizer") or {}
    train, evaluation = results.get("train") or {}, results.get("evaluate") or {}
    registered, deploy = results.get("register") or {}, rollout_result(results)
    rollout = to_json(deploy) if deploy else {}
    url = endpoint(settings.serve)
    return {
        "dag_id": args.dag_id,
        "run_id": args.run_id,
        "verdict": verdict,
        "outcome": line,
        "written_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "states": states,
        "errors": errors or {},
        "data": {**(snap.get("data_version") or {}), "duplicates_removed": snap.get("duplicates_removed"),
                 "traffic_records": snap.get("traffic_records") or 0},
        "validation": {k: val.get(k) for k in ("success", "evaluated", "records", "report_uri")},
        "tokens": {**(merged.get("tokens") or {}), "tokens_per_s": merged.get("tokens_per_s"),
                   **{k: tokenizer.get(k) for k in ("vocab_size", "tokenizer_source", "tokenizer_uri")}},
        "training": {k: train.get(k) for k in ("steps", "world_size", "engine", "tokens_per_s", "mfu", "final_loss", "val_loss",
                                               "initialized_from", "resumed_from", "model_uri", "mlflow_run_id")},
        "evaluation": {"passed": evaluation.get("passed"), "reasons": evaluation.get("reasons"),
                       "challenger": evaluation.get("challenger"), "champion": evaluation.get("champion"),
                       "tasks": evaluation.get("tasks"), "samples_uri": evaluation.get("samples_uri"),
                       "drifted": evaluation.get("drifted")},
        "registered": {k: registered.get(k) for k in ("model_name", "version", "challenger", "model_uri")},
        "canary": {k: rollout.get(k) for k in CANARY_FIELDS},
        # what started the run when a drift check did (the raw data Asset's event it emitted), and
        # that check again after the rollout (tasks.drift recheck: did the loop close?)
        "trigger": trigger_of(args),
        "drift_loop": results.get("drift_recheck") or {},
        "serving": {"endpoint": f"{url}/v1", "model": settings.pipeline.model_name,
                    "query": query_command(url, settings.pipeline.model_name),
                    "predict": 'make predict PROMPT="Return the number of"' + (
                        f" LINE={current_line()}" if current_line() != DEMO else "")},
    }


def trigger_of(args: argparse.Namespace) -> dict[str, Any]:
    """The drift check that started this run (``--trigger``: its Asset event's extra, completed
    from the check's report where it still is), or {}."""
    from tasks.drift import completed_from_report, trigger_event

    found = trigger_event(getattr(args, "trigger", ""))
    if not found.get("drift_report"):
        return found
    try:  # the drift_report Param's: the report quotes what it can read of that check's report
        return completed_from_report(found)
    except Exception as exc:  # a teardown: the report is written, whatever it cannot read
        log.warning("--trigger: the drift check's report could not be read (%s): quoted as given", exc)
        return found


def _fmt(value: Any, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec) if isinstance(value, (int, float)) else str(value)


def analyses_note(analyses: int) -> str:
    """" (2 analyses)" for a stage measured again (an inconclusive verdict), else ""."""
    return f" ({analyses} analyses)" if analyses > 1 else ""


def rollout_of(report: dict[str, Any]) -> RolloutSummary:
    """The run report's account of the rollout (its ``canary`` section), typed."""
    return from_json(RolloutSummary, report["canary"])


def rollout_stages(rollout: RolloutSummary) -> list[tuple[str, str, str]]:
    """(stage, verdict, analyses note) for the shadow (its last analysis) and each step."""
    stages = [("shadow", str(rollout.shadow[-1].verdict), analyses_note(rollout.shadow[-1].analysis))] \
        if rollout.shadow else []
    return stages + [(f"{s.weight:g}%", str(s.verdict), analyses_note(s.analyses)) for s in rollout.steps]


def approval_line(rollout: RolloutSummary) -> str:
    """Who decided a held rollout, what and when (or that nobody answered in time)."""
    approval = rollout.approval or Approval()
    where = f"held at {rollout.held_at or 0:g}%"
    if not approval.by:
        return f"{where}: no answer in time, {approval.decision} (the default) at {approval.at}"
    return f"{where}: {approval.decision} by {approval.by} at {approval.at}"


def summary_lines(report: dict[str, Any]) -> list[str]:
    data, val, tok, train = report["data"], report["validation"], report["tokens"], report["training"]
    ev, reg, rollout, serving = report["evaluation"], report["registered"], rollout_of(report), report["serving"]
    lines = [f"{report['dag_id']} {report['run_id']}: {report['verdict'].upper()}: {report['outcome']}"]
    trigger = report.get("trigger") or {}
    if trigger.get("drift_report"):
        lines.append(f"  started by  drift in served traffic ({'; '.join(trigger.get('drift_reasons') or [])}): "
                     f"{trigger['drift_report']} ({trigger.get('drift_run', '')})")
    lines += drift_loop_lines(report.get("drift_loop") or {})
    if data.get("tag"):
        lines.append(f"  data        {data['tag']}: {data.get('records')} records "
                     f"({data.get('duplicates_removed')} duplicates dropped"
                     + (f"; {data['traffic_records']} captured prompts among the records trained on"
                        if data.get("traffic_records") else "")
                     + ")")
    if val.get("success") is not None:
        lines.append(f"  validation  passed {val.get('evaluated')} expectations on {val.get('records')} records "
                     f"(Data Docs: {val.get('report_uri')})")
    if tok.get("train"):
        lines.append(f"  tokens      train {tok['train']:,}, val {tok['val']:,}, vocab {tok['vocab_size']} "
                     f"({tok['tokenizer_source']} tokenizer)")
    if train.get("steps"):
        lines.append(f"  training    {train['steps']} steps, {train['world_size']} processes {train['engine']}, "
                     f"{_fmt(train['tokens_per_s'], ',.0f')} tokens/s (MFU {_fmt(100 * (train.get('mfu') or 0), '.1f')}%), "
                     f"final loss {_fmt(train['final_loss'])}, "
                     f"val loss {_fmt(train['val_loss'])}, from {train.get('initialized_from') or 'scratch'}")
    challenger, champion = ev.get("challenger") or {}, ev.get("champion") or {}
    if challenger:
        versus = (f" vs champion v{champion.get('registry_version')} {_fmt(champion.get('eval_perplexity'))}"
                  if champion else " (first model: absolute bounds)")
        lines.append(f"  evaluation  perplexity {_fmt(challenger.get('eval_perplexity'))}{versus}, "
                     f"accuracy {_fmt(challenger.get('eval_accuracy'), '.3f')}, bits/byte "
                     f"{_fmt(challenger.get('eval_bits_per_byte'), '.3f')}: "
                     f"{'passed' if ev.get('passed') else 'rejected: ' + '; '.join(ev.get('reasons') or [])}")
    drifted = ev.get("drifted") or {}
    if drifted:
        versus = ("" if drifted.get("champion_bits_per_byte") is None else
                  f" vs champion {_fmt(drifted['champion_bits_per_byte'], '.3f')}")
        lines.append(f"  drifted     {drifted['prompts']} prompts of the drift check this run answers: bits/byte "
                     f"{_fmt(drifted['challenger_bits_per_byte'], '.3f')}{versus}")
    for name, task in (ev.get("tasks") or {}).items():
        versus = f" (champion {_fmt(task['champion'], '.3f')})" if task.get("champion") is not None else ""
        lines.append(f"  task        {name} {task['metric']} {_fmt(task['challenger'], '.3f')}{versus}, min {task['min']:g}")
    if reg.get("version"):
        lines.append(f"  registered  {reg['model_uri']} (alias challenger: v{reg.get('challenger')}, the newest data window)")
    if rollout.verdict and rollout.verdict != RolloutVerdict.NOT_DEPLOYED:  # (the outcome line says why not)
        path = " -> ".join(f"{stage}{'' if verdict == 'pass' else f' ({verdict})'}{note}"
                           for stage, verdict, note in rollout_stages(rollout))
        aliases = ", ".join(f"{k} v{v}" for k, v in (rollout.aliases or {}).items() if v)
        lines.append(f"  canary      {rollout.verdict} ({path or 'first model: no canary'}){'; ' + aliases if aliases else ''}")
    if rollout.approval and rollout.approval.decision:
        lines.append(f"  approval    {approval_line(rollout)}")
    if report["verdict"] == "success":
        lines += [f"  serving     {serving['endpoint']} (OpenAI-compatible API, model {serving['model']})",
                  f"  try it      {serving['predict']}",
                  f"              {serving['query']}"]
    return lines


def drift_loop_lines(loop: dict[str, Any]) -> list[str]:
    """The drift check that started the run, again after its rollout: the heading, each bound
    before -> after (and why one is still crossed)."""
    if not loop.get("started_by"):
        return []
    from tasks.drift import moved

    recheck = from_json(DriftRecheck, loop)
    if recheck.closed is None:  # no version promoted: the check was not run again
        return [f"  drift loop  open: {recheck.heading}"]
    return [f"  drift loop  {recheck.heading} (report {recheck.report_uri})",
            *(f"              {moved(b)}" + (f": {b.why}" if b.why else "") for b in recheck.bounds)]


def _img(path: Path | None) -> str:
    if path is None or not path.is_file():
        return "<p><em>not available</em></p>"
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(path.stem)}" src="data:image/png;base64,{data}">'


def _table(rows: Sequence[Sequence[str]], head: Sequence[str]) -> str:
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + f"</tr>{cells}</table>"


def render_html(report: dict[str, Any], lines: list[str], loss_png: Path | None, canary_png: Path | None,
                samples: dict[str, Any] | None, mlflow_url: str | None) -> str:
    ev = report["evaluation"]
    challenger, champion = ev.get("challenger") or {}, ev.get("champion") or {}
    metrics = sorted({k for k in challenger if isinstance(challenger[k], float)})
    eval_rows = [(m, _fmt(challenger.get(m)), _fmt(champion.get(m)) if champion else "-") for m in metrics]
    task_rows = [(name, t["metric"], _fmt(t["challenger"], ".3f"), "-" if t.get("champion") is None else
                  _fmt(t["champion"], ".3f"), "-" if not t.get("difference") else
                  f"{t['difference']['mean']:+.3f} [{t['difference']['low']:+.3f}, {t['difference']['high']:+.3f}]",
                  f"{t['min']:g}", str(t["examples"])) for name, t in (ev.get("tasks") or {}).items()]
    sample_rows = [(s["prompt"], s["completion"], next((c["completion"] for c in (samples or {}).get("champion") or []
                                                         if c["prompt"] == s["prompt"]), "-"))
                   for s in (samples or {}).get("challenger") or []]
    rollout = rollout_of(report)
    canary_rows = [(stage, verdict + note) for stage, verdict, note in rollout_stages(rollout)]
    if rollout.approval and rollout.approval.decision:
        canary_rows.append(("approval", approval_line(rollout)))
    links = [f'<li>MLflow run: <a href="{html.escape(mlflow_url)}">{html.escape(mlflow_url)}</a> '
             "(artifacts: validation/ holds the Great Expectations Data Docs, report/ this page)</li>"] if mlflow_url else []
    links += [f"<li>{html.escape(k)}: <code>{html.escape(str(v))}</code></li>" for k, v in (
        ("drift report (what started this run)", (report.get("trigger") or {}).get("drift_report")),
        ("drift report after the rollout (did the loop close?)", (report.get("drift_loop") or {}).get("report_uri")),
        ("validation report", report["validation"].get("report_uri")), ("model", report["training"].get("model_uri")),
        ("canary report", report["canary"].get("report_uri"))) if v]
    states = _table([(t, s) for t, s in report["states"].items()], ("task", "state"))
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(report['dag_id'])} {html.escape(report['run_id'])}</title>
<style>body{{font-family:sans-serif;max-width:1000px;margin:2em auto;color:#222}}table{{border-collapse:collapse;margin:.5em 0}}
td,th{{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}}pre{{background:#f4f4f4;padding:1em;
overflow-x:auto}}img{{max-width:100%}}.verdict{{font-size:1.3em;font-weight:bold}}</style></head><body>
<h1>{html.escape(report['dag_id'])} · {html.escape(report['run_id'])}</h1>
<p class="verdict">{html.escape(report['verdict'].upper())}: {html.escape(report['outcome'])}</p>
<pre>{html.escape(chr(10).join(lines))}</pre>
<h2>Training loss</h2>{_img(loss_png)}
<h2>Evaluation (held-out text)</h2>{_table(eval_rows, ("metric", "challenger", "champion"))}
<h3>Task suites (lm-evaluation-harness)</h3>{_table(task_rows, ("task", "metric", "challenger", "champion",
    "difference [interval]", "min", "examples")) if task_rows else "<p>none configured</p>"}
<h3>Samples (greedy)</h3>{_table(sample_rows, ("prompt", "challenger", "champion"))}
<h2>Canary</h2>{_table(canary_rows, ("stage", "verdict"))}{_img(canary_png) if canary_rows else ""}
<h2>Links</h2><ul>{''.join(links)}</ul>
<h2>Tasks</h2>{states}
</body></html>
"""


def mlflow_artifacts(run_id: str | None, scratch: Path) -> Path | None:
    """The training loss curve the train step logged (None without MLflow or a run)."""
    if not run_id:
        return None
    import mlflow
    from mlflow.exceptions import MlflowException

    try:
        return Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="loss_curve.png", dst_path=str(scratch)))
    except (MlflowException, OSError) as exc:
        log.warning("no loss curve from MLflow run %s: %s", run_id, exc)
        return None


def optional_file(uri: str | None, scratch: Path, name: str) -> Path | None:
    if not uri or not storage.exists(uri):
        return None
    return storage.download(uri, scratch / name)


def write(args: argparse.Namespace, settings: Settings) -> ReportResult:
    states, results, errors = run_states(args.states), parse_results(args.result), parse_errors(args.error)
    # a rolled-back canary fails its task (no XCom): its report is in the step's output, summed up as its result is
    outputs = {"deploy": args.deploy_output, "deploy_finish": args.finish_output}
    for step, output in outputs.items():
        step_report = storage.join(output, "report.json") if output else ""
        ended = states.get(step) in ("success", "failed", "skipped")  # (a cleared step's earlier report: not this try's)
        if results.get(step) is None and ended and step_report and storage.exists(step_report):
            results[step] = to_json(from_json(CanaryReport, storage.read_json(step_report)).summary(step_report))
    report = build_report(args, settings, states, results, errors)
    lines = summary_lines(report)
    mlflow_on = bool(args.mlflow_run_tag and os.environ.get("MLFLOW_TRACKING_URI"))
    run_id = find_dag_run(settings.train.experiment, args.mlflow_run_tag) if mlflow_on else None
    mlflow_url = None
    if run_id:
        import mlflow

        experiment = mlflow.get_run(run_id).info.experiment_id
        mlflow_url = f"{os.environ['MLFLOW_TRACKING_URI'].rstrip('/')}/#/experiments/{experiment}/runs/{run_id}"
    report["mlflow_run"] = mlflow_url
    with storage.staged_output(args.output) as out, storage.scratch() as scratch:
        samples_path = optional_file(report["evaluation"].get("samples_uri"), scratch, "samples.json")
        samples = json.loads(samples_path.read_text()) if samples_path else None
        canary_png = optional_file(storage.join(outputs[rollout_step(results)], "canary.png"), scratch, "canary.png")
        page = render_html(report, lines, mlflow_artifacts(run_id, scratch), canary_png, samples, mlflow_url)
        (out / "report.json").write_text(json.dumps(report, indent=1, sort_keys=True))
        (out / "summary.txt").write_text("\n".join(lines) + "\n")
        (out / "report.html").write_text(page, encoding="utf-8")
        if run_id:
            log_to_mlflow(run_id, out, report, scratch)
    grouping = {"line": metrics.line_label(), "dag_id": args.dag_id, "run_id": args.run_id}
    if metrics.push(grouping, run_figures(report), FIGURE_HELP):
        log.info("run figures pushed to %s", os.environ["PUSHGATEWAY_URL"])
    for line in lines:
        log.info("%s", line)
    log.info("run report: %s", storage.join(args.output, "report.html"))
    return ReportResult(verdict=report["verdict"], outcome=report["outcome"],
                        report_uri=storage.join(args.output, "report.html"),
                        summary_uri=storage.join(args.output, "summary.txt"), mlflow_run=mlflow_url)


# what Prometheus gets of a run (observability/alerts.yml and the Grafana dashboard read these)
FIGURE_HELP = {
    "llm_pipeline_run_success": "1 when the run trained, registered and (unless skipped) deployed its model",
    "llm_pipeline_run_failed": "1 when a step of the run failed (not a gate rejection, not a rollback)",
    "llm_pipeline_run_rejected": "1 when the evaluation gate rejected the challenger",
    "llm_pipeline_canary_rolled_back": "1 when the canary was rolled back",
    "llm_pipeline_train_tokens_per_second": "training throughput over the whole loop, all processes",
    "llm_pipeline_train_mfu_ratio": "model FLOPs utilization of one training process",
    "llm_pipeline_train_final_loss": "training loss of the last step",
    "llm_pipeline_train_val_loss": "validation loss at the end of training",
    "llm_pipeline_registered_version": "the model version the run registered",
    "llm_pipeline_report_timestamp_seconds": "when the run report was written",
}


def run_figures(report: dict[str, Any]) -> dict[str, float | None]:
    verdict, train = report["verdict"], report["training"]
    version = report["registered"].get("version")
    return {
        "llm_pipeline_run_success": float(verdict in ("success", "deploy skipped")),
        "llm_pipeline_run_failed": float(verdict == "failed"),
        "llm_pipeline_run_rejected": float(verdict == "rejected"),
        "llm_pipeline_canary_rolled_back": float(verdict == "rolled back"),
        "llm_pipeline_train_tokens_per_second": train.get("tokens_per_s"),
        "llm_pipeline_train_mfu_ratio": train.get("mfu"),
        "llm_pipeline_train_final_loss": train.get("final_loss"),
        "llm_pipeline_train_val_loss": train.get("val_loss"),
        "llm_pipeline_registered_version": float(version) if str(version or "").isdigit() else None,
        "llm_pipeline_report_timestamp_seconds": dt.datetime.fromisoformat(report["written_at"]).timestamp(),
    }


def log_to_mlflow(run_id: str, out: Path, report: dict[str, Any], scratch: Path) -> None:
    """The report beside the run's metrics, and the validation's Data Docs (the MLflow UI shows
    HTML artifacts), so one place holds what a person wants to look at."""
    import mlflow

    with mlflow.start_run(run_id=run_id):
        mlflow.log_artifacts(str(out), "report")
        mlflow.set_tag("run.verdict", report["verdict"])
        docs = report["validation"].get("report_uri")
        if docs:
            folder = docs.rsplit("/", 1)[0]
            local = scratch / "data-docs"
            for uri in storage.list_files(folder):
                storage.download(uri, local / uri[len(folder) + 1:])
            if local.is_dir():
                mlflow.log_artifacts(str(local), "validation")


def show(args: argparse.Namespace, settings: Settings) -> ReportShown:
    pipeline = settings.pipeline
    root = args.root or storage.join(pipeline.artifact_root, pipeline.dag_id)
    newest = storage.newest_json(root, "/report/report.json")
    if newest is None:
        raise StepError(f"{root}: no run report yet (run the DAG first)")
    uri, report = newest
    print(storage.read_bytes(storage.sibling(uri, "summary.txt")).decode(), end="")
    print(f"  report      {storage.sibling(uri, 'report.html')}")
    if report.get("mlflow_run"):
        print(f"  MLflow      {report['mlflow_run']}")
    return ReportShown(report_uri=uri, verdict=report["verdict"])


def main(args: argparse.Namespace) -> ReportResult | ReportShown:
    settings = load_settings()
    return write(args, settings) if args.command == "write" else show(args, settings)


def parser() -> argparse.ArgumentParser:
    p = step_parser("report", __doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="gather a DAG run's results into its report")
    w.add_argument("--dag-id", required=True)
    w.add_argument("--run-id", required=True)
    w.add_argument("--states", required=True, help="JSON of ti.get_task_states for this run")
    w.add_argument("--result", action="append", default=[], metavar="STEP=JSON", help="a step's XCom result")
    w.add_argument("--error", action="append", default=[], metavar="STEP=JSON",
                   help="a failed step's one-line error (its 'error' XCom, pushed by the launcher)")
    w.add_argument("--deploy-output", required=True, help="the deploy step's output URI (its report.json)")
    w.add_argument("--finish-output", default="",
                   help="the output URI of the step finishing a rollout held for approval (its report.json)")
    w.add_argument("--output", required=True, help="run-scoped URI for report.json, summary.txt, report.html")
    w.add_argument("--mlflow-run-tag", default="", help="dag_run tag of the MLflow run to log the report into")
    w.add_argument("--trigger", default="", help="JSON: the drift check that started the run (its Asset event's "
                   "extra: drift_report, drift_reasons, drift_run), or {}")
    s = sub.add_parser("show", help="print the newest run's summary")
    s.add_argument("--root", default="", help="where the runs' outputs are (default: artifact_root/dag_id)")
    return p


if __name__ == "__main__":
    run_step(parser(), main)
