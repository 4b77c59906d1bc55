"""Trained models on disk and in the MLflow registry.

A trained model folder (the train step's output) holds ``model.pt`` (state dict) and
``config.json`` (format version, architecture, tokenizer URI and hash). Every reader builds the
module from the recorded configuration and format (:meth:`GPTConfig.from_saved`) and loads only
the weights into it, so a model saved by older code (format 1, the gpt-v1 layout) still loads. The registry keeps the same model as
an MLflow pytorch-flavor model whose version tags carry the lineage; aliases say what it is:
``champion`` (serving), ``challenger`` (passed evaluation, awaiting its canary), ``previous``
(the champion before the current one, kept for rollback). Stages are never used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tasks.lib import storage
from tasks.lib.errors import StepError, absent, registry_error
from tasks.lib.model import GPT, GPTConfig

CHAMPION, CHALLENGER, PREVIOUS = "champion", "challenger", "previous"


@dataclass
class LoadedModel:
    model: GPT
    description: dict[str, Any]  # config.json: config, tokenizer_uri, tokenizer_hash, eos_id, ...

    @property
    def tokenizer_uri(self) -> str:
        return str(self.description["tokenizer_uri"])


def load_model_dir(uri: str, scratch: Path) -> LoadedModel:
    """The train step's output as an eval-mode GPT on CPU."""
    storage.require_complete(uri)
    config_path = storage.download(storage.join(uri, "config.json"), scratch / "config.json")
    weights_path = storage.download(storage.join(uri, "model.pt"), scratch / "model.pt")
    description = json.loads(Path(config_path).read_text())
    model = build_model(description, uri)
    model.load_state_dict(torch.load(weights_path, map_location="cpu", weights_only=True))
    return LoadedModel(model.eval(), description)


def build_model(description: dict[str, Any], source: str) -> GPT:
    """An untrained module of the architecture ``description`` records (any known format)."""
    try:
        config = GPTConfig.from_saved(description["config"], int(description.get("format_version", 1)))
    except (KeyError, TypeError, ValueError) as exc:
        raise StepError(f"{source}: its model description cannot be read by this code ({exc})") from None
    return GPT(config)


def load_registered(name: str, alias: str) -> LoadedModel | None:
    """``models:/NAME@ALIAS`` with its description, or None when there is no such alias."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        version = MlflowClient().get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        if absent(exc):
            return None
        raise registry_error(f"reading models:/{name}@{alias}", exc) from None
    return load_version(name, str(version.version))


def load_version(name: str, version: str) -> LoadedModel:
    """``models:/NAME/VERSION`` as an eval-mode GPT with its description (config, tokenizer)."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        found = MlflowClient().get_model_version(name, version)
    except MlflowException as exc:
        if absent(exc):
            raise StepError(f"models:/{name}/{version}: not in the registry ({exc.error_code})") from None
        raise registry_error(f"reading models:/{name}/{version}", exc) from None
    description = json.loads(found.tags.get("model_description", "{}"))
    if not description.get("tokenizer_uri"):
        raise StepError(f"models:/{name}/{version} has no model_description tag")
    logged = mlflow.pytorch.load_model(f"models:/{name}/{version}", map_location="cpu")
    if not isinstance(logged, torch.nn.Module) or type(logged).__name__ != "GPT":
        raise StepError(f"models:/{name}/{version} is a {type(logged).__name__}, not this project's GPT")
    # the weights go into a module of today's code: a pickled module of older code has older methods
    model = build_model(description, f"models:/{name}/{version}")
    model.load_state_dict(logged.state_dict())
    description["registry_version"] = str(found.version)
    return LoadedModel(model.eval(), description)


def alias_version(name: str, alias: str) -> str | None:
    """The version ``models:/NAME@ALIAS`` points at, or None when the alias is not set."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        return str(MlflowClient().get_model_version_by_alias(name, alias).version)
    except MlflowException as exc:
        if absent(exc):
            return None
        raise registry_error(f"reading models:/{name}@{alias}", exc) from None


def data_end(name: str, version: str) -> str | None:
    """The last day of the data window ``version`` was trained on (its ``data_end`` lineage tag,
    ISO date), or None when it carries none (registered outside the pipeline)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        return MlflowClient().get_model_version(name, version).tags.get("data_end") or None
    except MlflowException as exc:
        if absent(exc):
            return None
        raise registry_error(f"reading models:/{name}/{version}", exc) from None


def promote_version(name: str, version: str) -> dict[str, str | None]:
    """Make ``version`` the champion: the champion it replaces becomes ``previous``.

    Safe to repeat: when ``version`` already is the champion nothing moves. The version is named
    explicitly (not read from ``challenger``), so a later run that registered a newer
    challenger meanwhile cannot have its model promoted by this run's canary.
    """
    from mlflow import MlflowClient

    client = MlflowClient()
    champion = alias_version(name, CHAMPION)
    if champion != version:
        if champion is not None:
            client.set_registered_model_alias(name, PREVIOUS, champion)
        client.set_registered_model_alias(name, CHAMPION, version)
    return {CHAMPION: version, PREVIOUS: alias_version(name, PREVIOUS)}


def promote_challenger(name: str) -> dict[str, str | None]:
    """champion -> previous, challenger -> champion (see :func:`promote_version`)."""
    challenger = alias_version(name, CHALLENGER)
    if challenger is None:
        raise StepError(f"models:/{name}@{CHALLENGER} does not exist: nothing to promote")
    return promote_version(name, challenger)
