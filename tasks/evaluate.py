"""Evaluation gate: the challenger (this run's model) against the champion (production).

Both are measured in this step on the same data: the dataset's val split and the fixed held-out
evaluation text (``evaluate.eval_set_uri``, never trained on, identical across runs): mean
next-token loss, perplexity, next-token accuracy, and bits per byte on the evaluation text
(independent of the tokenizer). A few greedy generations from fixed prompts are saved.

Task suites (``evaluate.suite``): lm-eval task YAML over local files, run by EleutherAI's
lm-evaluation-harness on each model's Hugging Face form (:mod:`tasks.lib.harness`).

Gate (params.yaml ``evaluate``): absolute bounds, and at most ``max_regression`` relative
perplexity increase over the champion; each task's lowest score, and no task worse than the
champion's beyond the noise (a paired bootstrap over its examples); the first model ever is
judged on absolute bounds only.

A run the drift check started (``--trigger``) is judged on the drift too: both models read the
distinct prompts of that check's window (captured traffic, never training data), and the
challenger must be less surprised by them than the champion (bits per byte): a retrain that
did not learn what the drift check found is rejected.

A rejection writes the report, then exits 99: the DAG skips everything downstream.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tasks.config import DriftSettings, EvaluateSettings, SuiteSettings
from tasks.contract import to_json
from tasks.lib import storage, tokens
from tasks.lib.data import TokenSplit, open_split
from tasks.lib.errors import GateRejected, StepError
from tasks.lib.harness import TaskScore, paired_difference, run_suite, task_manager
from tasks.lib.hf_checkpoint import NotLlama, write_checkpoint
from tasks.lib.model import GPT
from tasks.lib.model_store import LoadedModel, load_model_dir, load_registered
from tasks.lib.params import load_settings
from tasks.lib.registry import CHAMPION
from tasks.lib.step import log, run_step, step_parser
from tasks.lib.tracking import find_dag_run
from tasks.results import (
    DriftedFigures,
    EvaluateResult,
    GateBounds,
    ModelFigures,
    PairedDifferenceFigures,
    TaskFigures,
)


@torch.no_grad()
def stream_metrics(model: GPT, stream: np.ndarray[Any, Any], max_tokens: int, batch: int) -> dict[str, float]:
    """Loss, perplexity and next-token accuracy over non-overlapping windows of ``stream``."""
    seq = model.config.seq_len
    usable = min(len(stream) - 1, max_tokens) // seq * seq
    if usable < seq:
        raise StepError(f"only {len(stream)} tokens to evaluate: fewer than one sequence of {seq}")
    windows = torch.from_numpy(np.asarray(stream[: usable + 1], dtype=np.int64))
    inputs = windows[:-1].view(-1, seq)
    targets = windows[1:].view(-1, seq)
    total_loss, correct = 0.0, 0
    for start in range(0, len(inputs), batch):
        logits = model(inputs[start : start + batch]).float()
        y = targets[start : start + batch]
        total_loss += torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1), reduction="sum").item()
        correct += int((logits.argmax(-1) == y).sum())
    loss = total_loss / usable
    return {"loss": loss, "perplexity": math.exp(loss), "accuracy": correct / usable, "tokens": float(usable),
            "nats": total_loss}


def eval_set_stream(eval_set: Path, vocabulary: tokens.Vocabulary) -> tuple[np.ndarray[Any, Any], int]:
    """The held-out texts as one token stream, each framed as training framed its documents (the
    model's BOS where it wants one, EOS after), and their UTF-8 byte count."""
    texts = [json.loads(line)["text"] for line in eval_set.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not texts:
        raise StepError(f"{eval_set}: evaluation set is empty")
    ids: list[int] = []
    for enc in vocabulary.tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(vocabulary.special.frame(enc.ids))
    return np.asarray(ids, dtype=np.int64), sum(len(t.encode("utf-8")) + 1 for t in texts)


@torch.no_grad()
def generate(model: GPT, vocabulary: tokens.Vocabulary, prompt: str, new_tokens: int) -> str:
    """Greedy continuation (deterministic, so runs compare), to any of the model's EOS ids."""
    special = vocabulary.special
    ids = torch.tensor([special.prefix + vocabulary.tokenizer.encode(prompt, add_special_tokens=False).ids],
                       dtype=torch.long)
    for _ in range(new_tokens):
        next_id = int(model(ids[:, -model.config.seq_len :])[0, -1].argmax())
        if next_id in special.eos_ids:
            break
        ids = torch.cat([ids, torch.tensor([[next_id]])], dim=1)
    text: str = vocabulary.tokenizer.decode(ids[0].tolist())  # special tokens (a BOS) skipped
    return text


def measure(loaded: LoadedModel, val: np.ndarray[Any, Any] | None, eval_set: Path, params: EvaluateSettings,
            scratch: Path) -> dict[str, Any]:
    folder = scratch / f"tok-{loaded.description['tokenizer_hash'][:12]}"
    vocabulary = tokens.load_vocabulary(loaded.tokenizer_uri, folder)
    stream, n_bytes = eval_set_stream(eval_set, vocabulary)
    held_out = stream_metrics(loaded.model, stream, params.max_eval_tokens, params.batch)
    # bits per byte over the measured windows' share of the text: comparable across tokenizers
    held_out["bits_per_byte"] = held_out.pop("nats") / math.log(2) / (n_bytes * held_out["tokens"] / len(stream))
    out: dict[str, Any] = {f"eval_{k}": v for k, v in held_out.items()}
    out["tokenizer_hash"] = loaded.description["tokenizer_hash"]
    if val is not None:
        val_metrics = stream_metrics(loaded.model, val, params.max_eval_tokens, params.batch)
        val_metrics.pop("nats")
        out.update({f"val_{k}": v for k, v in val_metrics.items()})
    out["samples"] = [
        {"prompt": p, "completion": generate(loaded.model, vocabulary, p, params.sample_tokens)}
        for p in params.prompts
    ]
    return out


def model_figures(measured: dict[str, Any]) -> ModelFigures:
    """:func:`measure`'s figures (by name: one it does not know fails here), less the samples."""
    return ModelFigures(**{k: v for k, v in measured.items() if k != "samples"})


def judge(challenger: dict[str, Any], champion: dict[str, Any] | None, params: EvaluateSettings) -> list[str]:
    """Reasons to reject the challenger (empty: it passes). A non-finite figure is a reason by
    itself: every comparison with NaN is false, so it would pass every bound."""
    broken = [f"eval {key.removeprefix('eval_')} is {challenger[key]}: not a finite number"
              for key in ("eval_perplexity", "eval_accuracy") if not math.isfinite(challenger[key])]
    if broken:
        return broken
    reasons = []
    # :g: a bound of 2000 reads "2000", not "2000.0"
    if challenger["eval_perplexity"] > params.max_eval_perplexity:
        reasons.append(f"eval perplexity {challenger['eval_perplexity']:.1f} > max {params.max_eval_perplexity:g}")
    if challenger["eval_accuracy"] < params.min_eval_accuracy:
        reasons.append(f"eval next-token accuracy {challenger['eval_accuracy']:.3f} < min {params.min_eval_accuracy:g}")
    if champion is None:
        return reasons
    # per-token perplexity compares models of one vocabulary only; across tokenizers (the
    # tokenizer_uri Param, a champion of another vocabulary) bits per byte of the same text does
    metric, label = ("eval_perplexity", "eval perplexity")
    if champion.get("tokenizer_hash") != challenger.get("tokenizer_hash"):
        metric, label = ("eval_bits_per_byte", "eval bits per byte (tokenizers differ)")
    baseline = champion.get(metric, float("nan"))
    if not math.isfinite(baseline):
        reasons.append(f"the champion's {label} is {baseline}: no baseline to compare with "
                       "(fix or re-evaluate the champion)")
    elif not math.isfinite(challenger.get(metric, float("nan"))):
        reasons.append(f"{label} is {challenger.get(metric)}: not a finite number")
    elif challenger[metric] > baseline * (1 + params.max_regression):
        reasons.append(f"{label} {challenger[metric]:.4g} regresses more than {params.max_regression:.0%} "
                       f"on the champion's {baseline:.4g}")
    return reasons


def drifted_prompts(drift_report: str, most: int, heldout_fraction: float) -> list[str]:
    """The distinct prompts of the drift check's window (its report.json: window, captured
    traffic) in its held-out slice (``heldout_fraction``: a retrain that learns from captured
    traffic never trains on them; 1: every prompt): at most ``most``, sampled as the check samples."""
    from tasks.drift import checked_prompts, held_out, sampled

    every, end = checked_prompts(drift_report)
    texts = [t for t in every if held_out(t, heldout_fraction)]
    return [texts[i] for i in sampled(len(texts), most, end)]


def prompt_bits_per_byte(loaded: LoadedModel, texts: list[str], max_tokens: int, scratch: Path) -> float:
    """The mean over ``texts`` of each one's bits per byte after its first token (of its first
    ``max_tokens`` tokens, read in the model's context): how surprised the model is by them, in a
    unit that does not depend on its tokenizer (to the character: where the first token is a
    byte of a character the vocabulary did not merge, the whole character's bytes count)."""
    from tasks.drift import mean_losses

    vocabulary = tokens.load_vocabulary(loaded.tokenizer_uri, scratch / f"tok-{loaded.description['tokenizer_hash'][:12]}")
    context = loaded.model.config.seq_len
    windows, predicted_bytes = [], []
    for text, encoding in zip(texts, vocabulary.tokenizer.encode_batch(texts, add_special_tokens=False), strict=True):
        ids = encoding.ids[:max_tokens]
        first = max(len(ids) - context, 0) + 1  # the first token predicted: the window's second
        if len(ids) - first < 1:
            continue
        windows.append(np.asarray(ids[first - 1:], dtype=np.int64))
        predicted_bytes.append(len(text[encoding.offsets[first][0]:encoding.offsets[len(ids) - 1][1]].encode()))
    losses = mean_losses(loaded.model, windows, context)  # nats per predicted token
    bits = [loss * (len(w) - 1) / math.log(2) / max(n, 1)
            for loss, w, n in zip(losses, windows, predicted_bytes, strict=True)]
    return float(np.mean(bits)) if bits else math.nan


def judge_drifted(figures: DriftedFigures) -> list[str]:
    """A drift-started challenger must be less surprised by the drifted prompts than the champion."""
    champion, challenger = figures.champion_bits_per_byte, figures.challenger_bits_per_byte
    where = f"the drifted traffic ({figures.prompts} prompts of {figures.drift_report})"
    if champion is not None and not math.isfinite(champion):
        return [f"{where}: the champion's bits per byte is {champion}: no baseline to compare with"]
    if champion is None or (math.isfinite(challenger) and challenger < champion):
        return []
    return [f"{where}: {challenger:.3f} bits per byte, no better than the champion's {champion:.3f}: the retrain "
            "did not learn what the drift check found"]


def drift_slice(drift: DriftSettings, val: TokenSplit) -> DriftSettings:
    """The drift settings the gate judges on: when the run's snapshot trained on captured prompts
    (its stats.json's ``traffic``, snapshot.learn_from_traffic), the window's held-out slice
    alone (``drift.heldout_fraction``); else every prompt of the window (fraction 1)."""
    snapshot = val.index.get("snapshot_uri")
    stats = storage.sibling(snapshot, "stats.json") if snapshot else ""
    trained = bool(stats and storage.exists(stats) and (storage.read_json(stats).get("traffic") or {}).get("trained"))
    return drift if trained else replace(drift, heldout_fraction=1.0)


def measure_drifted(drift_report: str, challenger: LoadedModel, champion: LoadedModel | None, drift: DriftSettings,
                    scratch: Path) -> DriftedFigures:
    """Both models on the prompts of the drift check that started the run."""
    texts = drifted_prompts(drift_report, drift.max_prompts, drift.heldout_fraction)
    if not texts:
        where = "" if drift.heldout_fraction >= 1 else f" in its held-out slice (drift.heldout_fraction {drift.heldout_fraction:g})"
        raise StepError(f"--trigger: the window of {drift_report} holds no captured prompt{where} any more: nothing "
                        "to judge the drift on")

    def surprise(model: LoadedModel) -> float:
        return prompt_bits_per_byte(model, texts, drift.max_prompt_tokens, scratch)

    return DriftedFigures(drift_report=drift_report, prompts=len(texts), challenger_bits_per_byte=surprise(challenger),
                          champion_bits_per_byte=None if champion is None else surprise(champion))


def suite_scores(loaded: LoadedModel, suite: SuiteSettings, manager: Any, folder: Path) -> dict[str, TaskScore] | None:
    """The model's task scores, run in its Hugging Face form; None for a model that has none (format 1)."""
    vocabulary = tokens.load_vocabulary(loaded.tokenizer_uri, folder / "tokenizer")
    try:
        write_checkpoint(loaded.model, vocabulary, folder / "hf")
    except NotLlama as exc:
        log.warning("task suite: %s", exc)
        return None
    return run_suite(folder / "hf", vocabulary.special.add_bos, suite, manager)


def judge_tasks(challenger: dict[str, TaskScore], champion: dict[str, TaskScore] | None,
                suite: SuiteSettings) -> tuple[list[str], dict[str, TaskFigures]]:
    """Reasons to reject the challenger on its tasks (below a task's min; worse than the champion
    beyond the noise), and each task's figures for the report."""
    reasons: list[str] = []
    figures: dict[str, TaskFigures] = {}
    for name, gate in suite.tasks.items():
        mine, theirs = challenger[name], champion[name] if champion else None
        difference = paired_difference(mine.per_example, theirs.per_example, suite.bootstrap_samples,
                                       suite.confidence) if theirs else None
        if mine.score < gate.min:
            reasons.append(f"task {name}: {gate.metric} {mine.score:.3f} < min {gate.min:g}")
        if theirs is not None and difference is not None and difference.high < -suite.max_drop:
            reasons.append(f"task {name}: {gate.metric} {mine.score:.3f} is below the champion's {theirs.score:.3f} "
                           f"beyond the noise ({suite.confidence:.0%} paired bootstrap interval of the difference "
                           f"[{difference.low:+.3f}, {difference.high:+.3f}] over {difference.examples} examples)")
        figures[name] = TaskFigures(
            metric=gate.metric, min=gate.min, challenger=mine.score, examples=len(mine.per_example),
            champion=theirs.score if theirs else None,
            difference=PairedDifferenceFigures(difference.mean, difference.low, difference.high, difference.examples)
            if difference else None)
    return reasons, figures


def checked_suite(suite: SuiteSettings, scratch: Path) -> Any:
    """lm-eval's index of the suite's tasks, each checked to load (None: no suite configured):
    before anything is measured, so a suite that cannot run fails at once."""
    return None if suite.folder is None else task_manager(suite, scratch)


def evaluate_tasks(challenger: LoadedModel, champion: LoadedModel | None, suite: SuiteSettings, manager: Any,
                   scratch: Path) -> tuple[list[str], dict[str, TaskFigures] | None]:
    """The task suite's reasons and figures (None: no suite configured)."""
    if manager is None:
        return [], None
    mine = suite_scores(challenger, suite, manager, scratch / "suite-challenger")
    if mine is None:
        raise StepError(f"{challenger.description.get('dataset_uri', 'the challenger')}: a model without a Hugging "
                        "Face form cannot run the task suite")
    theirs = suite_scores(champion, suite, manager, scratch / "suite-champion") if champion is not None else None
    reasons, figures = judge_tasks(mine, theirs, suite)
    log.info("task suite: %s", "; ".join(
        f"{name} {f.metric} {f.challenger:.3f}" + (f" (champion {f.champion:.3f})" if f.champion is not None
                                                    else "") for name, f in figures.items()))
    return reasons, figures


def log_to_mlflow(dag_run_tag: str, report: dict[str, Any], output: str, experiment: str) -> None:
    """Metrics, report and samples into the DAG run's MLflow run (the one training opened)."""
    if not dag_run_tag or not os.environ.get("MLFLOW_TRACKING_URI"):
        return
    import mlflow

    run_id = find_dag_run(experiment, dag_run_tag)
    if run_id is None:
        log.warning("no MLflow run tagged dag_run=%s: evaluation logged to storage only", dag_run_tag)
        return
    with tempfile.TemporaryDirectory(prefix="evaluate-") as tmp, mlflow.start_run(run_id=run_id):
        for name in ("report.json", "samples.json"):
            mlflow.log_artifact(str(storage.download(storage.join(output, name), Path(tmp) / name)), "evaluation")
        mlflow.log_metrics({f"eval.{k}": v for k, v in report["challenger"].items() if isinstance(v, float)})
        mlflow.log_metrics({f"eval.task.{name}": figures["challenger"] for name, figures in (report["tasks"] or {}).items()})
        mlflow.set_tag("evaluation.passed", str(report["passed"]).lower())


def main(args: argparse.Namespace) -> EvaluateResult:
    settings = load_settings("evaluate", args.overrides)
    params, model_name = settings.evaluate, settings.pipeline.model_name
    eval_uri = args.eval_set or params.eval_set_uri
    from tasks.drift import started_by

    trigger = started_by(args.trigger)  # before anything is measured: bad input fails at once
    with storage.staged_output(args.output) as out, storage.scratch() as scratch:
        tasks_index = checked_suite(params.suite, scratch)
        eval_set = storage.download(eval_uri, scratch / "eval.jsonl")
        eval_sha = storage.sha256_file(Path(eval_set))
        challenger_model = load_model_dir(args.model, scratch / "challenger")
        dataset = storage.download_tree(args.dataset, scratch / "dataset")
        val = open_split(dataset, "val")
        if val.tokenizer_hash != challenger_model.description["tokenizer_hash"]:
            raise StepError(f"{args.dataset}: tokenized with {val.tokenizer_hash[:12]}, the model with "
                            f"{challenger_model.description['tokenizer_hash'][:12]}")
        challenger = measure(challenger_model, val.tokens, Path(eval_set), params, scratch)
        champion_model = load_registered(model_name, CHAMPION) if not args.no_champion else None
        champion = None
        if champion_model is not None:
            same_vocab = champion_model.description["tokenizer_hash"] == val.tokenizer_hash
            champion = measure(champion_model, val.tokens if same_vocab else None, Path(eval_set), params, scratch)
            champion["registry_version"] = champion_model.description["registry_version"]
        reasons = judge(challenger, champion, params)
        task_reasons, task_figures = evaluate_tasks(challenger_model, champion_model, params.suite, tasks_index, scratch)
        reasons += task_reasons
        drifted = None if not trigger else measure_drifted(str(trigger["drift_report"]), challenger_model,
                                                            champion_model, drift_slice(settings.drift, val), scratch)
        reasons += judge_drifted(drifted) if drifted else []
        judged = EvaluateResult(
            passed=not reasons,
            reasons=tuple(reasons),
            model_uri=args.model,
            eval_set_uri=eval_uri,
            eval_set_sha256=eval_sha,
            challenger=model_figures(challenger),
            champion=None if champion is None else model_figures(champion),
            tasks=task_figures,
            gate=GateBounds(params.max_eval_perplexity, params.min_eval_accuracy, params.max_regression),
            drifted=drifted,
        )
        report = to_json(judged)  # report.json: the result less its URIs
        (out / "report.json").write_text(json.dumps(report, indent=1, sort_keys=True))
        samples = {"challenger": challenger["samples"], "champion": champion["samples"] if champion else None}
        (out / "samples.json").write_text(json.dumps(samples, indent=1, ensure_ascii=False))
    result = replace(judged, report_uri=storage.join(args.output, "report.json"),
                     samples_uri=storage.join(args.output, "samples.json"))
    log_to_mlflow(args.mlflow_run_tag, report, args.output, settings.train.experiment)
    log.info("challenger %s; champion %s", json.dumps(report["challenger"]), json.dumps(report["champion"]))
    if reasons:
        raise GateRejected("; ".join(reasons), result)
    log.info("gate passed%s", " (first model: absolute bounds only)" if champion is None else " against the champion")
    return result


def parser() -> argparse.ArgumentParser:
    p = step_parser("evaluate", __doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="URI of the train step's model folder")
    p.add_argument("--dataset", required=True, help="URI of the tokenized dataset (its val split is measured)")
    p.add_argument("--eval-set", help="held-out evaluation text (default: evaluate.eval_set_uri)")
    p.add_argument("--output", required=True, help="run-scoped URI for report.json and samples.json")
    p.add_argument("--no-champion", action="store_true", help="judge on absolute bounds only")
    p.add_argument("--mlflow-run-tag", default="", help="dag_run tag of the MLflow run to log the evaluation into")
    p.add_argument("--trigger", default="", help="JSON: the drift check that started the run (its Asset event's extra, "
                                                "or {\"drift_report\": URI}): the models are judged on its prompts too")
    return p


if __name__ == "__main__":
    run_step(parser(), main)
