"""The MLflow Model Registry's side of a model this pipeline registered, without torch: versions,
aliases and lineage tags (the steps that only move aliases or read tags, deploy and tokenize,
start in a fraction of a second; :mod:`tasks.lib.model_store` loads the models themselves).

Aliases say what a version is: ``champion`` (serving), ``challenger`` (passed evaluation,
awaiting its canary), ``previous`` (the champion before the current one, kept for rollback).
Stages are never used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tasks.lib import storage
from tasks.lib.errors import StepError, absent, registry_error

CHAMPION, CHALLENGER, PREVIOUS = "champion", "challenger", "previous"
DESCRIPTION_FILE = "config.json"  # a model folder's description (format, architecture, tokenizer)


def version_by_alias(name: str, alias: str) -> Any | None:
    """``models:/NAME@ALIAS`` as MLflow's ModelVersion, or None when the model or the alias does
    not exist. MLflow's basic-auth app answers a non-admin's alias read of a model that does not
    exist with 403 (it cannot resolve that model's permission) where reading the model itself
    answers 404: that second read tells an absent model from a real refusal."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient()
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        if absent(exc):
            return None
        if getattr(exc, "error_code", "") == "PERMISSION_DENIED":
            try:
                client.get_registered_model(name)
            except MlflowException as again:
                if absent(again):
                    return None
        raise registry_error(f"reading models:/{name}@{alias}", exc) from None


def model_version(name: str, version: str) -> Any:
    """``models:/NAME/VERSION`` as MLflow's ModelVersion; absent is bad input, an outage is not."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        return MlflowClient().get_model_version(name, version)
    except MlflowException as exc:
        if absent(exc):
            raise StepError(f"models:/{name}/{version}: not in the registry ({exc.error_code})") from None
        raise registry_error(f"reading models:/{name}/{version}", exc) from None


def registered_version(name: str, version: str) -> tuple[Any, dict[str, Any]]:
    """``models:/NAME/VERSION``'s ModelVersion (its tags) and its description (config.json alone,
    not the weights); absent is bad input."""
    import mlflow
    from mlflow.exceptions import MlflowException

    uri = f"models:/{name}/{version}"
    found = model_version(name, version)
    with storage.scratch() as scratch:
        try:
            path = mlflow.artifacts.download_artifacts(artifact_uri=f"{uri}/{DESCRIPTION_FILE}", dst_path=str(scratch))
        except MlflowException as exc:
            if absent(exc):  # a version older code registered (a pickle): its description is a tag
                return found, tag_description(found.tags, uri)
            raise registry_error(f"downloading {uri}/{DESCRIPTION_FILE}", exc) from None
        description: dict[str, Any] = json.loads(Path(path).read_text())
    return found, description


def tag_description(tags: dict[str, str], uri: str) -> dict[str, Any]:
    """The ``model_description`` tag older code registered a pickled version with."""
    try:
        description = json.loads(tags.get("model_description") or "{}")
    except json.JSONDecodeError as exc:
        raise StepError(f"{uri}: its model_description tag is not JSON ({exc})") from None
    if not isinstance(description, dict):
        raise StepError(f"{uri}: its model_description tag is not a JSON object")
    return description


def alias_version(name: str, alias: str) -> str | None:
    """The version ``models:/NAME@ALIAS`` points at, or None when the alias is not set."""
    version = version_by_alias(name, alias)
    return None if version is None else str(version.version)


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
