"""Trained models on disk and in the MLflow registry, read without unpickling anything.

A trained model folder (the train step's output) holds ``model.safetensors`` (the state dict)
and ``config.json`` (format version, architecture, tokenizer URI and hash). Every reader builds
the module from the recorded configuration and format (:meth:`GPTConfig.from_saved`) and loads
only the weights into it, so a model saved by older code (format 1, the gpt-v1 layout) still
loads; a folder of older code's ``model.pt`` is read with ``torch.load(weights_only=True)``,
which rebuilds tensors and nothing else.

The registry keeps the same two files as an MLflow model of this project's own flavor
(:data:`REGISTRY_FLAVOR`, plus a ``python_function`` flavor whose loader is this module, imported
from the reader's installed code, never from the registry). Nothing is unpickled the ordinary
way: unpickling runs whatever code the pickle names, and anyone who can write to the registry
could put it there. A version older code registered (a GPT pickled by MLflow's ``pytorch``
flavor) is read by torch's weights-only unpickler, allowed to build this project's model classes
and tensors only (:func:`load_pickled_gpt`); any other flavor is refused. Version tags carry the
lineage and aliases say what a version is: the registry's torch-free half (aliases, versions,
tags) is :mod:`tasks.lib.registry`.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tasks.lib import storage
from tasks.lib.errors import StepError, first_line, registry_error
from tasks.lib.model import GPT, GPTConfig
from tasks.lib.registry import DESCRIPTION_FILE, model_version, tag_description, version_by_alias

WEIGHTS_FILE, LEGACY_WEIGHTS_FILE = "model.safetensors", "model.pt"
# the registered model's MLflow flavor (MLmodel), and the version of its folder's form
REGISTRY_FLAVOR, REGISTRY_FORMAT = "llm_retrain_gpt", 1


@dataclass
class LoadedModel:
    model: GPT
    description: dict[str, Any]  # config.json: config, tokenizer_uri, tokenizer_hash, eos_id, ...

    @property
    def tokenizer_uri(self) -> str:
        return str(self.description["tokenizer_uri"])


def save_model_files(weights: dict[str, torch.Tensor], description: dict[str, Any], folder: Path) -> None:
    """``model.safetensors`` + ``config.json`` in ``folder``: the form every reader here loads.
    A tied parameter (the head shares the embedding) is stored once, under its first name."""
    from safetensors.torch import save_file

    # (from the config, not a module built on the meta device: that imports torch's compiler, ~2 s)
    second_names = GPT.second_names(build_config(description, str(folder)))
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in weights.items() if k not in second_names},
              str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / DESCRIPTION_FILE).write_text(json.dumps(description, indent=1, sort_keys=True))


def load_model_files(description_path: Path, weights_path: Path, source: str) -> LoadedModel:
    """A model saved by :func:`save_model_files` (or older code's ``model.pt``) as an eval-mode
    GPT on CPU."""
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    try:
        description = json.loads(description_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StepError(f"{source}: no readable {DESCRIPTION_FILE} ({type(exc).__name__}: {exc})") from None
    if not isinstance(description, dict):
        raise StepError(f"{source}: its {DESCRIPTION_FILE} is not a JSON object")
    model = build_model(description, source)
    try:
        if weights_path.name == WEIGHTS_FILE:
            load_model(model, str(weights_path), strict=True)
        else:  # written by older code: tensors only, no code runs
            model.load_state_dict(torch.load(weights_path, map_location="cpu", weights_only=True))
    except (SafetensorError, pickle.UnpicklingError, RuntimeError, OSError, EOFError) as exc:
        raise StepError(f"{source}: its weights do not load into the architecture it describes "
                        f"({first_line(exc)})") from None
    return LoadedModel(model.eval(), description)


def load_model_dir(uri: str, scratch: Path) -> LoadedModel:
    """The train step's output as an eval-mode GPT on CPU."""
    storage.require_complete(uri)
    description = storage.download(storage.join(uri, DESCRIPTION_FILE), scratch / DESCRIPTION_FILE)
    weights = WEIGHTS_FILE if storage.exists(storage.join(uri, WEIGHTS_FILE)) else LEGACY_WEIGHTS_FILE
    return load_model_files(description, storage.download(storage.join(uri, weights), scratch / weights), uri)


def build_config(description: dict[str, Any], source: str) -> GPTConfig:
    """The architecture ``description`` records (any known format)."""
    try:
        return GPTConfig.from_saved(description["config"], int(description.get("format_version", 1)))
    except (KeyError, TypeError, ValueError) as exc:
        raise StepError(f"{source}: its model description cannot be read by this code ({exc})") from None


def build_model(description: dict[str, Any], source: str) -> GPT:
    """An untrained module of the architecture ``description`` records (any known format)."""
    return GPT(build_config(description, source))


def load_registered(name: str, alias: str) -> LoadedModel | None:
    """``models:/NAME@ALIAS`` with its description, or None when there is no such alias."""
    version = version_by_alias(name, alias)
    return None if version is None else load_version(name, str(version.version))


def load_version(name: str, version: str) -> LoadedModel:
    """``models:/NAME/VERSION`` as an eval-mode GPT with its description (config, tokenizer)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    found = model_version(name, version)
    uri = f"models:/{name}/{version}"
    with storage.scratch() as scratch:
        try:
            folder = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(scratch)))
        except MlflowException as exc:
            raise registry_error(f"downloading {uri}", exc) from None
        flavors = registered_flavors(folder, uri)
        if REGISTRY_FLAVOR in flavors:
            loaded = load_model_files(folder / DESCRIPTION_FILE, folder / WEIGHTS_FILE, uri)
        elif "pytorch" in flavors:
            pickled = folder / str(flavors["pytorch"].get("model_data", "data")) / "model.pth"
            loaded = load_pickled_gpt(pickled, tag_description(found.tags, uri), uri)
        else:
            raise StepError(f"{uri}: a model of flavors {sorted(flavors)}, not {REGISTRY_FLAVOR} (safetensors "
                            "weights + config.json): not a model this pipeline registered")
    if not loaded.description.get("tokenizer_uri"):
        raise StepError(f"{uri}: its description names no tokenizer_uri")
    loaded.description["registry_version"] = str(found.version)
    return loaded


def registered_flavors(folder: Path, uri: str) -> dict[str, dict[str, Any]]:
    """The flavors a downloaded registered model's MLmodel (YAML, safely parsed) declares."""
    from mlflow.models import Model

    try:
        flavors: dict[str, dict[str, Any]] = Model.load(str(folder)).flavors
    except Exception as exc:  # a missing or unparsable MLmodel: whatever this is, it is not ours
        raise StepError(f"{uri}: no readable MLmodel ({type(exc).__name__}): not a model this pipeline registered") from None
    found_format = flavors.get(REGISTRY_FLAVOR, {}).get("format", 0)
    if not isinstance(found_format, int):
        raise StepError(f"{uri}: {REGISTRY_FLAVOR} format {found_format!r}: expected a whole number")
    if found_format > REGISTRY_FORMAT:
        raise StepError(f"{uri}: {REGISTRY_FLAVOR} format {found_format} is newer than this code reads "
                        f"({REGISTRY_FORMAT}): update the pipeline's code")
    return flavors


def pickled_model_classes() -> list[Callable[..., Any] | tuple[Callable[..., Any], str]]:
    """What a pickled GPT of older code's registry may name, by the names older code gave them
    (gpt-v1's pickles say ``MLP``): this project's model classes and the torch layers they hold.
    Listed one by one: a class added to tasks.lib.model later is not allowed by being there."""
    from tasks.lib import model as m

    ours = {"GPT": m.GPT, "GPTConfig": m.GPTConfig, "Block": m.Block, "Attention": m.Attention,
            "SwiGLU": m.SwiGLU, "GeluMLP": m.GeluMLP, "MLP": m.GeluMLP}
    layers = [torch.nn.Linear, torch.nn.Embedding, torch.nn.RMSNorm, torch.nn.LayerNorm, torch.nn.ModuleList]
    return [*[(cls, f"{m.__name__}.{name}") for name, cls in ours.items()],
            *[(cls, f"{cls.__module__}.{cls.__name__}") for cls in layers], (set, "builtins.set")]


def load_pickled_gpt(path: Path, description: dict[str, Any], source: str) -> LoadedModel:
    """A version older code registered: a GPT pickled by MLflow's pytorch flavor, read by torch's
    weights-only unpickler allowed to build only :func:`pickled_model_classes` and tensors. A
    pickle naming anything else (a function to call on loading) is refused, with nothing run."""
    import re

    model = build_model(description, source)
    try:
        with torch.serialization.safe_globals(pickled_model_classes()):
            module = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # whatever the pickle holds: the allowed classes built with odd state included
        named = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        what = f"it names {named.group(1)}, which no pickled model of this project does" if named else \
            f"{type(exc).__name__}: {first_line(exc)}"
        raise StepError(f"{source}: its pickled module ({path.name}) is refused: {what}; nothing in it was run") from None
    if not isinstance(module, torch.nn.Module):
        raise StepError(f"{source}: its pickle holds a {type(module).__name__}, not this project's GPT")
    try:  # the parameters only, into a module of today's code built from the description
        model.load_state_dict({n: p.detach() for n, p in module.named_parameters(remove_duplicate=False)})
    except Exception as exc:  # a module whose pickled state is not a module's
        raise StepError(f"{source}: its pickled weights do not fit the architecture it describes "
                        f"({type(exc).__name__}: {first_line(exc)})") from None
    return LoadedModel(model.eval(), description)


class RegistryFlavor:
    """What :meth:`mlflow.models.Model.log` calls to write a registered model's folder."""

    @staticmethod
    def save_model(path: str, mlflow_model: Any, model: torch.nn.Module, description: dict[str, Any],
                   signature: Any = None, **_: Any) -> None:
        from mlflow import pyfunc
        from mlflow.models import Model

        folder = Path(path)
        save_model_files(model.state_dict(), description, folder)
        assert isinstance(mlflow_model, Model)
        mlflow_model.signature = signature
        mlflow_model.add_flavor(REGISTRY_FLAVOR, format=REGISTRY_FORMAT, weights=WEIGHTS_FILE,
                                description=DESCRIPTION_FILE, torch_version=str(torch.__version__))
        # mlflow.pyfunc.load_model(uri).predict(token ids) -> logits, through this module of the
        # reader's own installed code: no code travels with the model
        pyfunc.add_to_model(mlflow_model, loader_module=__name__)
        mlflow_model.save(str(folder / "MLmodel"))


def log_model(model: torch.nn.Module, description: dict[str, Any], signature: Any = None,
              name: str = "registered-model") -> str:
    """Log ``model`` into the active MLflow run in the registry's form; its ``models:/`` URI."""
    from mlflow.models import Model

    info = Model.log(artifact_path=None, name=name, flavor=RegistryFlavor, flavor_name=REGISTRY_FLAVOR, model=model,
                     description=description, signature=signature)
    return str(info.model_uri)


class _PyfuncModel:
    """``mlflow.pyfunc.load_model`` of a registered version: token ids (batch, time) -> logits."""

    def __init__(self, model: GPT) -> None:
        self.model = model

    def predict(self, ids: Any, params: dict[str, Any] | None = None) -> Any:
        with torch.no_grad():
            return self.model(torch.as_tensor(ids, dtype=torch.long)).numpy()


def _load_pyfunc(path: str) -> _PyfuncModel:
    return _PyfuncModel(load_model_files(Path(path) / DESCRIPTION_FILE, Path(path) / WEIGHTS_FILE, path).model)


