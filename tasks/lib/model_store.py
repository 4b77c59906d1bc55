"""Trained models on disk and in the MLflow registry.

A trained model folder (the train step's output) holds ``model.pt`` (state dict) and
``config.json`` (architecture, tokenizer URI and hash). The registry keeps the same model as
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
from tasks.lib.errors import StepError
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
    model = GPT(GPTConfig(**description["config"]))
    model.load_state_dict(torch.load(weights_path, map_location="cpu", weights_only=True))
    return LoadedModel(model.eval(), description)


def load_registered(name: str, alias: str) -> LoadedModel | None:
    """``models:/NAME@ALIAS`` with its description, or None when there is no such alias."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        version = MlflowClient().get_model_version_by_alias(name, alias)
    except MlflowException:
        return None
    model = mlflow.pytorch.load_model(f"models:/{name}@{alias}", map_location="cpu")
    if not isinstance(model, GPT):
        raise StepError(f"models:/{name}@{alias} is a {type(model).__name__}, not this project's GPT")
    description = json.loads(version.tags.get("model_description", "{}"))
    if not description.get("tokenizer_uri"):
        raise StepError(f"models:/{name}@{alias} (version {version.version}) has no model_description tag")
    description["registry_version"] = version.version
    return LoadedModel(model.eval(), description)


def promote_challenger(name: str) -> dict[str, str | None]:
    """After a successful canary: champion -> previous, challenger -> champion.

    Safe to repeat: when the challenger already is the champion nothing moves.
    """
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient()

    def version_of(alias: str) -> str | None:
        try:
            return str(client.get_model_version_by_alias(name, alias).version)
        except MlflowException:
            return None

    challenger, champion = version_of(CHALLENGER), version_of(CHAMPION)
    if challenger is None:
        raise StepError(f"models:/{name}@{CHALLENGER} does not exist: nothing to promote")
    if challenger != champion:
        if champion is not None:
            client.set_registered_model_alias(name, PREVIOUS, champion)
        client.set_registered_model_alias(name, CHAMPION, challenger)
    return {CHAMPION: challenger, PREVIOUS: version_of(PREVIOUS)}
