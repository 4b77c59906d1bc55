"""Register the evaluated model in the MLflow model registry as ``challenger``.

Logs the model in the registry's form (safetensors weights + config.json under this project's
MLflow flavor, with a signature and a ``python_function`` flavor; no pickle: see
:mod:`tasks.lib.model_store`) into the DAG run's MLflow run, registers a version
whose tags carry the lineage (data version and content hash, tokenizer hash, git commit, DAG id,
run id, logical date, its evaluation metrics and the champion's it was compared with), and sets
the ``challenger`` alias to the version trained on the newest data window (``data_end``; see
:func:`move_challenger`). A retry of the same DAG run finds its version by the ``dag_run`` tag
instead of registering a second one. Promotion to ``champion`` belongs to the canary, which
names its version.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import numpy as np

from tasks.lib import storage
from tasks.lib.errors import StepError
from tasks.lib.model_store import load_model_dir, log_model
from tasks.lib.params import load_settings
from tasks.lib.provenance import git_commit
from tasks.lib.registry import CHALLENGER
from tasks.lib.step import log, run_step, step_parser
from tasks.lib.tracking import find_dag_run
from tasks.results import RegisterResult

LINEAGE_KEYS = ("data_version", "data_content_hash", "data_end", "dag_id", "dag_run_id", "logical_date")
OPTIONAL_LINEAGE_KEYS = ("traffic_records",)  # captured prompts in the data version (snapshot.learn_from_traffic)
MAX_ALIAS_ATTEMPTS = 5


def parse_tags(items: list[str]) -> dict[str, str]:
    tags = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in LINEAGE_KEYS + OPTIONAL_LINEAGE_KEYS:
            raise StepError(f"--lineage {item!r}: expected KEY=VALUE with KEY one of "
                            f"{', '.join(LINEAGE_KEYS + OPTIONAL_LINEAGE_KEYS)}")
        tags[key] = value
    missing = [k for k in LINEAGE_KEYS if not tags.get(k)]
    if missing:
        raise StepError(f"lineage incomplete: missing {', '.join(missing)}")
    return tags


def find_version(client: Any, name: str, dag_run: str) -> Any | None:
    versions = client.search_model_versions(f"name = '{name}' and tags.dag_run = '{dag_run}'")
    return max(versions, key=lambda v: int(v.version)) if versions else None


def model_signature(vocab_size: int) -> Any:
    """Token ids (batch, time) -> logits (batch, time, vocab), batch and time dynamic (-1): a
    signature inferred from the (1, 16) example would refuse any other shape at predict()."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Schema, TensorSpec

    return ModelSignature(inputs=Schema([TensorSpec(np.dtype(np.int64), (-1, -1))]),
                          outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, -1, vocab_size))]))


def newest_candidate(client: Any, name: str) -> str | None:
    """The registered version trained on the newest data window (``data_end``); on a tie the
    later version."""
    dated = [(v.tags.get("data_end", ""), int(v.version)) for v in client.search_model_versions(f"name = '{name}'")]
    dated = [entry for entry in dated if entry[0]]
    return str(max(dated)[1]) if dated else None


def move_challenger(client: Any, name: str) -> str:
    """The rule: ``challenger`` is the registered version trained on the newest data, not the
    one registered last (a late backfill on old data must not replace a newer challenger). Two
    runs registering at once converge: each re-reads after writing and corrects a stale write,
    so the last writer's check always sees every version registered before it."""
    for _ in range(MAX_ALIAS_ATTEMPTS):
        target = newest_candidate(client, name)
        if target is None:
            raise StepError(f"models:/{name}: no version carries a data_end tag")
        client.set_registered_model_alias(name, CHALLENGER, target)
        if newest_candidate(client, name) == target and str(client.get_model_version_by_alias(name, CHALLENGER).version) == target:
            return target
    raise RuntimeError(f"models:/{name}@{CHALLENGER} kept moving under concurrent registrations: retry")


def training_run(dag_run: str, experiment: str) -> str:
    """The DAG run's MLflow run (the train step opened it), or a new one."""
    import mlflow

    existing = find_dag_run(experiment, dag_run)
    if existing is not None:
        return existing
    run_id: str = mlflow.start_run(run_name=f"register {dag_run}", tags={"dag_run": dag_run}).info.run_id
    mlflow.end_run()
    return run_id


def version_tags(
    lineage: dict[str, str], dag_run: str, description: dict[str, Any], report: dict[str, Any]
) -> dict[str, str]:
    champion = report.get("champion") or {}
    return {
        **lineage,
        "dag_run": dag_run,
        "git_commit": git_commit(),
        "tokenizer_uri": str(description["tokenizer_uri"]),
        "tokenizer_hash": str(description["tokenizer_hash"]),
        "initialized_from": str(description.get("initialized_from") or "scratch"),
        # the training record (settings, packages) stays in the model's config.json: a tag holds 8000 characters
        "model_description": json.dumps({k: v for k, v in description.items() if k != "training"}, sort_keys=True),
        **training_tags(description.get("training") or {}),
        "eval_set_sha256": str(report["eval_set_sha256"]),
        **{f"metric.{k}": f"{v:.6g}" for k, v in report["challenger"].items() if isinstance(v, float)},
        **{f"champion.{k}": f"{v:.6g}" if isinstance(v, float) else str(v) for k, v in champion.items()},
    }


def training_tags(training: dict[str, Any]) -> dict[str, str]:
    """How the version was trained, searchable in the registry (the whole record: config.json)."""
    layout, runtime = training.get("layout") or {}, training.get("runtime") or {}
    return {**{f"train.{k}": str(v) for k, v in layout.items()},
            **{f"runtime.{k}": str(runtime[k]) for k in ("torch", "packages_sha256", "cpu", "accelerator") if k in runtime}}


def main(args: argparse.Namespace) -> RegisterResult:
    if args.overrides:
        raise StepError(f"--set {' '.join(args.overrides)}: the register step has no settings")
    settings = load_settings()
    name = settings.pipeline.model_name
    lineage = parse_tags(args.lineage)
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        raise StepError("MLFLOW_TRACKING_URI is not set: the registry is an MLflow server")
    import mlflow
    from mlflow import MlflowClient

    client = MlflowClient()
    existing = find_version(client, name, args.mlflow_run_tag)
    if existing is not None:
        log.info("models:/%s version %s is already registered for %s: reusing it", name, existing.version, args.mlflow_run_tag)
        return RegisterResult(model_name=name, version=str(existing.version), challenger=move_challenger(client, name),
                              new=False, model_uri=f"models:/{name}/{existing.version}")

    report = storage.read_json(args.evaluation)
    if not report.get("passed"):
        raise StepError(f"{args.evaluation}: the evaluation gate did not pass; refusing to register")
    with storage.scratch() as scratch:
        loaded = load_model_dir(args.model, scratch)
        run_id = training_run(args.mlflow_run_tag, settings.train.experiment)
        with mlflow.start_run(run_id=run_id):
            model_uri = log_model(loaded.model, loaded.description, model_signature(loaded.model.config.vocab_size))
        version = mlflow.register_model(model_uri, name, tags=version_tags(lineage, args.mlflow_run_tag, loaded.description, report))
    challenger = move_challenger(client, name)
    log.info("registered models:/%s version %s (run %s); %s: version %s", name, version.version, run_id,
             CHALLENGER, challenger)
    return RegisterResult(model_name=name, version=str(version.version), challenger=challenger, new=True,
                          model_uri=f"models:/{name}/{version.version}", run_id=run_id)


def parser() -> argparse.ArgumentParser:
    p = step_parser("register", __doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="URI of the train step's model folder")
    p.add_argument("--evaluation", required=True, help="URI of the evaluate step's report.json")
    p.add_argument("--mlflow-run-tag", required=True, help="dag_run tag of this DAG run (finds its MLflow run and version)")
    p.add_argument("--lineage", action="append", default=[], metavar="KEY=VALUE",
                   help=f"lineage tag, repeated for each of: {', '.join(LINEAGE_KEYS)}")
    return p


if __name__ == "__main__":
    run_step(parser(), main)
