"""Replay a registered version: train it again from its lineage alone and compare the weights.

Two sub-commands, the first and last tasks of the ``llm_replay`` DAG (between them: the snapshot
restored from its DVC tag, tokenized with the recorded tokenizer, and the train step run with
the recorded settings, starting weights and node/process layout):

    plan     read version N's lineage (data version and content hash, tokenizer by content
             hash, starting weights, the training record of its config.json: settings, layout,
             runtime) and refuse, with one line, when an input is gone (a deleted DVC tag, a
             missing or changed tokenizer, a deleted starting version, a version registered
             before training records) or the layout cannot be had here. Writes the recorded
             settings for the train step.
    compare  the replayed weights against the registered ones, tensor by tensor: identical, or
             the first differing tensor and by how much, with what differs between the two
             trainings (code commit, packages, CPU or GPU, layout). Writes report.json; a
             replay that differs fails the step (exit 2) after writing it.
    show     the newest comparison of version N (``make replay`` ends with it), or the one-line
             error that stopped the replay before it.

A replay registers nothing, moves no alias and serves nothing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tasks.config import Settings, current_line, line_dag_id
from tasks.contract import REPLAY_DAG
from tasks.lib import storage, tokens
from tasks.lib.errors import StepError
from tasks.lib.params import load_settings
from tasks.lib.provenance import differences, git_commit
from tasks.lib.step import log, run_step, step_parser
from tasks.results import ReplayComparison, ReplayPlan, ReplayShown


def version_number(raw: str) -> str:
    if not raw.isdigit() or int(raw) < 1:
        raise StepError(f"--model-version {raw!r}: expected a registered version number (1, 2, ...)")
    return str(int(raw))


def check_data(settings: Settings, tag: str, content_hash: str, uri: str) -> None:
    from tasks.snapshot import registry

    registered = registry(settings.snapshot)
    with registered.locked():
        registered.ensure()
        version = registered.tag_version(tag)
        remote = registered.remote_object(tag) if version is not None else ""
    if version is None:
        raise StepError(f"{uri}: its data version {tag} is gone from the DVC registry (the tag was deleted)")
    if not storage.exists(remote):
        raise StepError(f"{uri}: its data version {tag} is gone from the DVC remote ({remote} is missing)")
    if version.get("content_hash") != content_hash:
        raise StepError(f"{uri}: its data version {tag} now holds content {str(version.get('content_hash'))[:12]}, "
                        f"not the {content_hash[:12]} it was trained on")


def check_tokenizer(tokenizer_uri: str, tokenizer_hash: str, uri: str) -> None:
    if not storage.exists(tokenizer_uri):
        raise StepError(f"{uri}: its tokenizer {tokenizer_uri} is gone (content hash {tokenizer_hash[:12]})")
    found = tokens.stored_hash(tokenizer_uri)
    if found != tokenizer_hash:
        raise StepError(f"{uri}: its tokenizer {tokenizer_uri} now hashes to {found[:12]}, not {tokenizer_hash[:12]}")


def check_start(initialized_from: str, uri: str) -> str:
    """The starting weights' URI for the train step ("" when trained from scratch)."""
    if initialized_from in ("", "scratch"):
        return ""
    if initialized_from.startswith("models:/"):
        from tasks.lib.registry import registered_version

        name, _, number = initialized_from.removeprefix("models:/").rpartition("/")
        try:
            registered_version(name, number)
        except StepError:
            raise StepError(f"{uri}: it started from {initialized_from}, which is gone from the registry") from None
    elif not storage.exists(storage.join(initialized_from, "config.json")):
        raise StepError(f"{uri}: it started from {initialized_from}, which is gone")
    return initialized_from


def plan(args: argparse.Namespace, settings: Settings) -> ReplayPlan:
    from tasks.lib.registry import registered_version

    name, number = settings.pipeline.model_name, version_number(args.model_version)
    uri = f"models:/{name}/{number}"
    found, description = registered_version(name, number)
    tags = dict(found.tags)
    missing = [k for k in ("data_version", "data_content_hash", "tokenizer_uri", "tokenizer_hash") if not tags.get(k)]
    if missing:
        raise StepError(f"{uri}: registered without lineage ({', '.join(missing)} missing): it cannot be replayed")
    training = description.get("training")
    if not isinstance(training, dict) or "settings" not in training:
        raise StepError(f"{uri}: registered before training records (no settings, layout or runtime in its "
                        "config.json): it cannot be replayed")
    layout, dataset = training.get("layout") or {}, training.get("dataset") or {}
    if not {"nodes", "procs_per_node"} <= set(layout) or dataset.get("val_fraction") is None:
        raise StepError(f"{uri}: its training record has no node/process layout or dataset split: it cannot be replayed")
    if layout["procs_per_node"] != settings.train.procs_per_node:
        raise StepError(f"{uri}: trained with {layout['procs_per_node']} processes per node; this deployment's "
                        f"train.procs_per_node is {settings.train.procs_per_node}: set it to replay the same layout")
    check_data(settings, tags["data_version"], tags["data_content_hash"], uri)
    check_tokenizer(tags["tokenizer_uri"], tags["tokenizer_hash"], uri)
    init_from = check_start(tags.get("initialized_from", "scratch"), uri)
    with storage.staged_output(args.output) as out:
        (out / "settings.json").write_text(json.dumps(training["settings"], indent=1, sort_keys=True))
    log.info("replaying %s: data %s, tokenizer %s, from %s, %d node(s) x %d process(es)", uri, tags["data_version"],
             tags["tokenizer_hash"][:12], init_from or "scratch", layout["nodes"], layout["procs_per_node"])
    return ReplayPlan(model_version=number, data_version=tags["data_version"], tokenizer_uri=tags["tokenizer_uri"],
                      val_fraction=dataset["val_fraction"], init_from=init_from,
                      settings_uri=storage.join(args.output, "settings.json"), nodes=layout["nodes"],
                      procs_per_node=layout["procs_per_node"])


def compare_weights(registered: dict[str, Any], replayed: dict[str, Any]) -> dict[str, Any]:
    """Tensor by tensor, in the registered state dict's order: how many are identical, and the
    first that is not (its largest absolute difference and how many of its elements differ)."""
    import torch

    if list(registered) != list(replayed):
        only = sorted(set(registered) ^ set(replayed))
        return {"tensors": len(registered), "identical": False, "identical_tensors": 0,
                "first_difference": {"tensor": only[0] if only else next(iter(registered)),
                                     "reason": "the two models do not have the same tensors"}}
    first: dict[str, Any] | None = None
    same = 0
    for name, want in registered.items():
        got = replayed[name]
        if want.shape == got.shape and want.dtype == got.dtype and torch.equal(want, got):
            same += 1
            continue
        if first is None:
            if want.shape != got.shape or want.dtype != got.dtype:
                first = {"tensor": name, "reason": f"{tuple(want.shape)} {want.dtype} vs {tuple(got.shape)} {got.dtype}"}
            else:
                diff = (want.double() - got.double()).abs()
                first = {"tensor": name, "max_abs_diff": float(diff.max()), "differing_elements": int((diff > 0).sum()),
                         "elements": want.numel()}
    return {"tensors": len(registered), "identical": first is None, "identical_tensors": same, "first_difference": first}


def compare(args: argparse.Namespace, settings: Settings) -> ReplayComparison:
    from tasks.lib.model_store import load_model_dir, load_version
    from tasks.lib.registry import model_version

    name, number = settings.pipeline.model_name, version_number(args.model_version)
    uri = f"models:/{name}/{number}"
    found = model_version(name, number)  # its tags (the code commit); the model itself once, below
    registered = load_version(name, number)
    with storage.scratch() as scratch:
        replayed = load_model_dir(args.model, scratch)
    weights = compare_weights(registered.model.state_dict(), replayed.model.state_dict())
    reasons = differences(registered.description.get("training") or {}, replayed.description.get("training") or {})
    commit_then, commit_now = found.tags.get("git_commit", "unknown"), git_commit()
    if commit_then != commit_now:
        reasons.insert(0, f"code: {commit_then} -> {commit_now}")
    report = {"model_version": number, "model_uri": uri, "replayed_model": args.model, **weights,
              "differences": reasons, "written_at": dt.datetime.now(dt.UTC).isoformat()}
    with storage.staged_output(args.output) as out:
        (out / "report.json").write_text(json.dumps(report, indent=1, sort_keys=True))
    report_uri = storage.join(args.output, "report.json")
    if not weights["identical"]:
        first = weights["first_difference"]
        by = (f"by up to {first['max_abs_diff']:.3g} in {first['differing_elements']} of {first['elements']} elements"
              if "max_abs_diff" in first else first["reason"])
        why = "; ".join(reasons) or ("the same code, packages, hardware and layout: the training itself is not "
                                      "deterministic here (a GPU kernel, a thread count)")
        raise StepError(f"{uri} not reproduced: {weights['identical_tensors']} of {weights['tensors']} tensors identical, "
                        f"the first differing is {first['tensor']} ({by}); differences: {why}; report {report_uri}")
    log.info("%s reproduced bit for bit: %d of %d tensors identical%s", uri, weights["tensors"], weights["tensors"],
             f" (differences that did not matter: {'; '.join(reasons)})" if reasons else "")
    return ReplayComparison(model_version=number, identical=weights["identical"], tensors=weights["tensors"],
                            differences=tuple(reasons), report_uri=report_uri)


def first_error(log_path: str) -> str | None:
    """The first step's one-line error in a DAG run's log (``make replay`` keeps it)."""
    if not log_path:
        return None
    try:
        lines = Path(log_path).read_text(errors="replace").splitlines()
    except OSError:
        return None
    marker = re.compile(r"ERROR python -m (tasks\.[\w.]+): (.*?)(?:\s+\[airflow\.[^\]]*\]\s+loc=\S+)?$")
    for line in lines:
        found = marker.search(line)
        if found:
            return f"{found[1]} said: {found[2]}"
    return None


def show(args: argparse.Namespace, settings: Settings) -> ReplayShown:
    number = version_number(args.model_version)
    runs = storage.join(settings.pipeline.artifact_root, line_dag_id(REPLAY_DAG, current_line()))  # the line's replay DAG
    newest = storage.newest_json(runs, "/compare/report.json",
                                 lambda r: r.get("model_version") == number and r.get("written_at", "") >= args.since)
    if newest is None:
        why = first_error(args.log) or "no comparison was written (see the run's log)"
        raise StepError(f"the replay of version {number} stopped before comparing; {why}")
    uri, report = newest
    if report["identical"]:
        print(f"REPRODUCED: {report['model_uri']} retrained from its lineage is identical, "
              f"{report['tensors']} of {report['tensors']} tensors bit for bit")
    else:
        first = report["first_difference"]
        print(f"NOT REPRODUCED: {report['model_uri']}: {report['identical_tensors']} of {report['tensors']} tensors "
              f"identical; first difference {first['tensor']} "
              + (f"(max abs diff {first['max_abs_diff']:.3g})" if "max_abs_diff" in first else f"({first['reason']})"))
    for reason in report["differences"]:
        print(f"  differs     {reason}")
    print(f"  report      {uri}")
    if not report["identical"]:
        raise StepError(f"models:/{settings.pipeline.model_name}/{number} not reproduced")
    return ReplayShown(report_uri=uri, identical=True)


def main(args: argparse.Namespace) -> ReplayPlan | ReplayComparison | ReplayShown:
    settings = load_settings()
    if args.overrides:
        raise StepError(f"--set {' '.join(args.overrides)}: the replay takes its settings from the version")
    commands: dict[str, Callable[[argparse.Namespace, Settings], ReplayPlan | ReplayComparison | ReplayShown]] = {
        "plan": plan, "compare": compare, "show": show}
    return commands[args.command](args, settings)


def parser() -> argparse.ArgumentParser:
    p = step_parser("replay", (__doc__ or "").splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    planned = sub.add_parser("plan", help="check version N's inputs and write its training settings")
    planned.add_argument("--model-version", required=True)
    planned.add_argument("--output", required=True, help="run-scoped output URI (settings.json)")
    compared = sub.add_parser("compare", help="the replayed weights against the registered ones")
    compared.add_argument("--model-version", required=True)
    compared.add_argument("--model", required=True, help="URI of the replay's train step model folder")
    compared.add_argument("--output", required=True, help="run-scoped output URI (report.json)")
    shown = sub.add_parser("show", help="the newest replay's outcome")
    shown.add_argument("--model-version", required=True)
    shown.add_argument("--since", default="", help="only a comparison written at or after this time (ISO, UTC)")
    shown.add_argument("--log", default="", help="the run's log: its first step error, when no comparison was written")
    return p


if __name__ == "__main__":
    run_step(parser(), main)
