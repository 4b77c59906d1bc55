"""Train the GPT on the tokenized dataset: FSDP2 (default) / DDP / DeepSpeed / single process, launched by
``torchrun`` (c10d rendezvous), with sharded, resumable checkpoints and MLflow tracking.

    python -m tasks.lib.torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:PORT -m tasks.train --dataset URI --checkpoints URI --output URI \\
        [--set engine=ddp ...]

Every start (first run, torchrun restart after a worker died, Airflow retry) resumes from the
newest complete checkpoint under ``--checkpoints`` (model, optimizer, step, data position).
Rank 0 logs to the MLflow run of the DAG run (found by tag, so retries reuse it) and writes the
consolidated model: ``model.safetensors`` (state dict) + ``config.json`` (architecture, tokenizer).
A retrain starts from ``--init-from`` (the version the tokenizer step pinned) when it has this
run's architecture and vocabulary and ``train.init_from`` is ``champion``.
"""

from __future__ import annotations

import argparse

from tasks.config import SettingsError, TrainSettings, apply_overrides, build
from tasks.lib import storage
from tasks.lib.errors import StepError
from tasks.lib.params import load_settings
from tasks.lib.step import run_step, step_parser
from tasks.results import TrainResult
from tasks.train.trainer import TrainRun, train


def recorded_settings(uri: str, overrides: list[str]) -> TrainSettings:
    """The train settings a model recorded (its description's ``training.settings``, a JSON
    file at ``uri``: a replay), ``--set`` applied on top, checked as params.yaml's are."""
    try:
        return build(TrainSettings, apply_overrides(storage.read_json(uri), overrides, "train"), "train")
    except SettingsError as exc:
        raise StepError(f"--settings {uri}: {exc}") from None


def main(args: argparse.Namespace) -> TrainResult:
    if args.settings:
        settings = recorded_settings(args.settings, args.overrides)
    else:
        settings = load_settings("train", args.overrides).train
    return train(settings, TrainRun(args.dataset, args.checkpoints, args.output, args.init_from, args.mlflow_run_tag))


def parser() -> argparse.ArgumentParser:
    p = step_parser("train", (__doc__ or "").splitlines()[0])
    p.add_argument("--dataset", required=True, help="URI of the tokenize step's dataset folder")
    p.add_argument("--checkpoints", required=True, help="run-scoped URI for DCP checkpoints (resumed from)")
    p.add_argument("--output", required=True, help="run-scoped URI for the consolidated model")
    p.add_argument("--mlflow-run-tag", default="", help="tag value (dag_run) that names this DAG run's MLflow run")
    p.add_argument("--init-from", default="", help="models:/NAME/VERSION or a model folder URI to start from "
                   "(train.init_from: champion); empty: a random initialization")
    p.add_argument("--settings", default="", help="URI of a JSON train section to use instead of params.yaml's "
                   "(a replay: the settings the model recorded)")
    return p


if __name__ == "__main__":
    run_step(parser(), main)
