"""Model lines: several models retrained by the same pipeline, each line a file.

A line is ``lines/<name>.yaml`` (``PIPELINE_LINES_DIR`` names another folder): what differs from
params.yaml, section by section. Its settings are params.yaml's with the file merged over them,
then built and checked as params.yaml is. Merging follows the settings' types: a section's
settings are overridden one by one, a mapping of named entries (``train.presets``,
``evaluate.suite.tasks``, ``pipeline.tasks``) entry by entry, ``null`` removing an entry; any
other value (a number, a list) is replaced whole. What keeps the lines' runs apart (:data:`APART`:
their DAG, registered model, raw data and its Asset, DVC tags, MLflow experiment) defaults to the
demo line's name with the line's added; no two lines may share one (``load.every_line``).

The demo line is params.yaml alone: no file, no name (:data:`DEMO`). A process reads the line
``PIPELINE_LINE`` names (the launcher sets it for the steps of a line's DAG).
"""

from __future__ import annotations

import contextvars
import dataclasses
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args, get_origin, get_type_hints

from tasks.config.base import REPO_ROOT, SettingsError

if TYPE_CHECKING:
    from tasks.config.settings import Settings

DEMO = ""
DEMO_LABEL = "demo"  # the demo line where a name must not be empty: metrics' line label, the router's route keys
LINE_ENV = "PIPELINE_LINE"
# the line whose DAG a DAG file is building (plugins/pipeline_params.py's building()). Held here,
# not in the plugin: Airflow's plugin manager can import plugins/ modules a second time (a DAG's
# serialization does), and a launcher bound to the first copy would not see the second's.
BUILDING: contextvars.ContextVar[str] = contextvars.ContextVar("pipeline_line_being_built", default=DEMO)
LINES_DIR_ENV = "PIPELINE_LINES_DIR"
# it becomes part of DAG ids, a registered model's name, S3 keys and git tags; a letter first, so
# a line's tags (data-<line>-...) never read as the demo line's (data-<date>-...)
LINE_NAME = re.compile(r"[a-z][a-z0-9_-]*")
# what no two lines may share: each line's runs read and write their own
APART = ("pipeline.dag_id", "pipeline.model_name", "pipeline.raw_data_uri", "pipeline.raw_data_asset",
         "snapshot.tag_prefix", "train.experiment", "serve.triton_model", "serve.generate_model",
         "serve.kubernetes.name", "serve.kubernetes.route")


def current_line() -> str:
    """The line this process reads: ``PIPELINE_LINE``, the demo line when unset or empty."""
    return os.environ.get(LINE_ENV, DEMO)


def line_label(line: str) -> str:
    """A line's name where it may not be empty (``demo``: the demo line's)."""
    return line or DEMO_LABEL


def lines_dir() -> Path:
    return Path(os.environ.get(LINES_DIR_ENV) or REPO_ROOT / "lines")


def lines(folder: Path | None = None) -> list[str]:
    """The names of the line files (``<name>.yaml``), sorted; the demo line is not among them."""
    folder = folder or lines_dir()
    names = sorted(path.stem for path in folder.glob("*.yaml")) if folder.is_dir() else []
    for name in names:
        if not LINE_NAME.fullmatch(name):
            raise SettingsError(f"{folder / name}.yaml: a line's name is lowercase letters, digits, '-' and '_', "
                                "a letter first")
        if name == DEMO_LABEL:
            raise SettingsError(f"{folder / name}.yaml: {DEMO_LABEL!r} names the demo line (params.yaml): "
                                "choose another name")
    return names


def line_path(line: str, folder: Path | None = None) -> Path:
    folder = folder or lines_dir()
    path = folder / f"{line}.yaml"
    if not LINE_NAME.fullmatch(line) or not path.is_file():
        known = ", ".join(lines(folder)) or "none"
        raise SettingsError(f"{LINE_ENV}={line!r}: no line file {path} (lines there: {known})")
    return path


def line_dag_id(dag_id: str, line: str) -> str:
    """A DAG's id in a line: the demo line's own, ``<dag_id>__<line>`` in the others."""
    return dag_id if line == DEMO else f"{dag_id}__{line}"


def apart_defaults(demo: Settings, line: str) -> dict[str, dict[str, Any]]:
    """What keeps ``line`` apart from the demo line where its file does not say (:data:`APART`)."""
    pipeline = demo.pipeline
    return {
        "pipeline": {"dag_id": line_dag_id(pipeline.dag_id, line), "model_name": f"{pipeline.model_name}-{line}",
                     "raw_data_uri": f"{pipeline.raw_data_uri.rstrip('/')}-{line}",
                     "raw_data_asset": f"{pipeline.raw_data_asset}__{line}"},
        "snapshot": {"tag_prefix": f"{demo.snapshot.tag_prefix}{line}-"},
        "train": {"experiment": f"{demo.train.experiment}-{line}"},
        # one Triton serves every line locally: each line's versions are folders of its own two
        # models; in a cluster each line has its own tracks (Deployments, Services) and HTTPRoutes
        "serve": {"triton_model": f"{demo.serve.triton_model}__{line}",
                  "generate_model": f"{demo.serve.generate_model}__{line}",
                  "kubernetes": {"name": f"{demo.serve.kubernetes.name}-{line}",
                                 "route": f"{demo.serve.kubernetes.route}-{line}"}},
    }


def read_line(path: Path) -> dict[str, Any]:
    """A line file's overrides: a mapping of sections (an empty file: none)."""
    import yaml

    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise SettingsError(f"{path}: invalid YAML ({' '.join(str(exc).split())})") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise SettingsError(f"{path}: expected a mapping of sections (pipeline:, train: ...), got {loaded!r}")
    return loaded


def merged(cls: type, base: Mapping[str, Any], overrides: Any, where: str = "") -> dict[str, Any]:
    """``base`` (the raw settings of dataclass ``cls``) with ``overrides`` merged in by the
    settings' types; a key ``cls`` does not know is refused, naming it."""
    if not isinstance(overrides, Mapping):
        raise SettingsError(f"{where or cls.__name__}: expected a section (a mapping), got {overrides!r}")
    hints = get_type_hints(cls)
    result = dict(base)
    for key, value in overrides.items():
        name = f"{where}.{key}" if where else str(key)
        if key not in hints:
            raise SettingsError(f"{name}: unknown setting (known: {', '.join(hints)})")
        result[key] = _merged_value(hints[key], base.get(key), value, name)
    return result


def _merged_value(tp: Any, base: Any, value: Any, where: str) -> Any:
    if dataclasses.is_dataclass(tp) and isinstance(base, Mapping):
        return merged(tp, base, value, where)  # type: ignore[arg-type]
    if get_origin(tp) is dict and isinstance(base, Mapping) and isinstance(value, Mapping):
        entries = dict(base)
        for key, entry in value.items():
            if entry is None:  # an entry the line does without (a task of the demo's suite)
                entries.pop(key, None)
            else:
                entries[key] = _merged_value(get_args(tp)[1], entries.get(key), entry, f"{where}.{key}")
        return entries
    return value
