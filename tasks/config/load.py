"""Reading ``params.yaml``: the file found (``PIPELINE_PARAMS``), the model line's file merged over
it (``PIPELINE_LINE``: ``tasks.config.lines``), a step's ``--set key=value`` overrides applied to
its section, the whole built and checked once per process."""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tasks.config.base import REPO_ROOT, SettingsError
from tasks.config.coerce import build
from tasks.config.lines import APART, DEMO, apart_defaults, current_line, line_path, lines, lines_dir, merged, read_line
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


def load(path: Path | None = None, section: str | None = None, overrides: Sequence[str] = (),
         line: str | None = None) -> Settings:
    """params.yaml as :class:`Settings`, the model ``line``'s file merged over it (None: the line
    ``PIPELINE_LINE`` names; ``DEMO``: params.yaml alone), with a step's ``--set`` overrides
    applied to its ``section``. Cached: a process reads and checks the files once."""
    line = current_line() if line is None else line
    return _load(path or params_path(), section, tuple(overrides), line, None if line == DEMO else lines_dir())


@functools.lru_cache(maxsize=128)  # (path, section, overrides, line): a DAG file reads every line
def _load(path: Path, section: str | None, overrides: tuple[str, ...], line: str, folder: Path | None) -> Settings:
    raw, source = read_yaml(path), path
    if folder is not None:
        demo = _load(path, None, (), DEMO, None)  # params.yaml checked first: its errors name it
        source = line_path(line, folder)
        line_overrides = read_line(source)  # its errors name the file
        try:
            raw = merged(Settings, merged(Settings, raw, apart_defaults(demo, line)), line_overrides)
        except SettingsError as exc:
            raise SettingsError(f"{source}: {exc}") from None
    if section is not None:
        if section not in raw:
            raise SettingsError(f"{source}: no {section!r} section")
        raw = {**raw, section: apply_overrides(raw[section], overrides, section)}
    try:
        return build(Settings, raw)
    except SettingsError as exc:
        raise SettingsError(f"{source}: {exc}") from None


def every_line(path: Path | None = None) -> dict[str, Settings]:
    """The settings of every line, the demo line's first, checked together: no two lines share
    what keeps their runs apart (``lines.APART``), and a pool two lines name is one pool, defined
    once (the same slots and description)."""
    settings = {line: load(path, line=line) for line in [DEMO, *lines()]}
    owners: dict[tuple[str, Any], str] = {}
    pools: dict[str, tuple[str, Any]] = {}
    for line, each in settings.items():
        for key in APART:
            value = _setting(each, key)
            owner = owners.setdefault((key, value), line)
            if owner != line:
                raise SettingsError(f"{line_path(line)}: {key} {value!r} is {_named(owner)}'s too: each line needs "
                                    "its own")
        for name, pool in each.pipeline.pools.items():
            owner, first = pools.setdefault(name, (line, pool))
            if first != pool:
                raise SettingsError(f"{line_path(line)}: pipeline.pools.{name} differs from {_named(owner)}'s: one "
                                    "pool, one definition")
    check_one_triton(settings)
    return settings


def check_one_triton(settings: dict[str, Settings]) -> None:
    """One Triton serves every line: its models' names are one namespace (no line's logits model
    is another's engine, nor its own), and it has one memory budget (params.yaml's)."""
    models: dict[str, str] = {}
    budget = settings[DEMO].serve.memory_budget_mb
    for line, each in settings.items():
        serve = each.serve
        if serve.triton_model == serve.generate_model:
            raise SettingsError(f"{_named(line)}: serve.triton_model and serve.generate_model are both "
                                f"{serve.triton_model!r}: two models need two names")
        for key in ("triton_model", "generate_model"):
            owner = models.setdefault(getattr(serve, key), line)
            if owner != line:
                raise SettingsError(f"{_named(line)}: serve.{key} {getattr(serve, key)!r} is a Triton model of "
                                    f"{_named(owner)} too: one Triton serves every line")
        if serve.memory_budget_mb != budget:
            raise SettingsError(f"{_named(line)}: serve.memory_budget_mb {serve.memory_budget_mb:g} differs from "
                                f"params.yaml's {budget:g}: one Triton, one budget (set it there)")


def _setting(settings: Settings, key: str) -> Any:
    value: Any = settings
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _named(line: str) -> str:
    return "the demo line (params.yaml)" if line == DEMO else f"line {line!r} ({line_path(line)})"
