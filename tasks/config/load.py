"""Reading ``params.yaml``: the file found (``PIPELINE_PARAMS``), a step's ``--set key=value``
overrides applied to its section, the whole built and checked once per process."""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tasks.config.base import REPO_ROOT, SettingsError
from tasks.config.coerce import build
from tasks.config.settings import Settings


def params_path() -> Path:
    return Path(os.environ.get("PIPELINE_PARAMS", REPO_ROOT / "params.yaml"))


def read_yaml(path: Path) -> dict[str, Any]:
    import yaml  # both images have PyYAML; libyaml's loader: 5 ms instead of 37 for params.yaml

    try:
        loaded = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except FileNotFoundError:
        raise SettingsError(f"{path}: params file not found") from None
    except yaml.YAMLError as exc:
        raise SettingsError(f"{path}: invalid YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(loaded, dict):
        raise SettingsError(f"{path}: expected a mapping at the top level")
    return loaded


def apply_overrides(section: Mapping[str, Any], overrides: Sequence[str], where: str = "") -> dict[str, Any]:
    """Apply ``key=value`` / ``a.b=value`` overrides; values parse as YAML (``3``, ``true``)."""
    import yaml

    merged = copy.deepcopy(dict(section))
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SettingsError(f"--set {item!r}: expected KEY=VALUE")
        *parents, leaf = key.split(".")
        node = merged
        for name in parents:
            child = node.get(name)
            if not isinstance(child, dict):
                raise SettingsError(f"--set {item!r}: {where}{'.' if where else ''}{name} is not a section")
            node = child
        if leaf not in node:
            raise SettingsError(f"--set {item!r}: unknown setting {where}{'.' if where else ''}{key}")
        node[leaf] = yaml.safe_load(raw)
    return merged


def load(path: Path | None = None, section: str | None = None, overrides: Sequence[str] = ()) -> Settings:
    """params.yaml as :class:`Settings`, with a step's ``--set`` overrides applied to its
    ``section``. Cached: a process reads and checks the file once."""
    return _load(path or params_path(), section, tuple(overrides))


@functools.lru_cache(maxsize=16)
def _load(path: Path, section: str | None, overrides: tuple[str, ...]) -> Settings:
    raw = read_yaml(path)
    if section is not None:
        if section not in raw:
            raise SettingsError(f"{path}: no {section!r} section")
        raw = {**raw, section: apply_overrides(raw[section], overrides, section)}
    try:
        return build(Settings, raw)
    except SettingsError as exc:
        raise SettingsError(f"{path}: {exc}") from None
