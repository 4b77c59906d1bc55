"""params.yaml as the DAGs see it: ``tasks.config``'s typed settings, read and checked once at
parse time (a small YAML file, no network); per model line, the line's (``tasks.config.lines``).

A DAG file builds one DAG per line inside :func:`building`: while it builds a line's DAG, the
launcher, the alerts' defaults and :func:`raw_data_asset` read that line's settings, and every
step of the DAG gets ``PIPELINE_LINE`` (:func:`line_env`), so it reads them too. Outside it (the
drift and ingest DAGs, the cluster's rendering) they read the demo line's: the Airflow side never
takes its line from its own environment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Airflow's processes have the repository root (/opt/airflow in the image) on PYTHONPATH; a
# plugin run as a script (`python plugins/cluster.py base`) has only its own folder
if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from tasks.config import DEMO, LINE_ENV, REPO_ROOT, Settings, every_line, line_dag_id, load, params_path
from tasks.config.lines import BUILDING

if TYPE_CHECKING:
    from airflow.sdk import DAG

__all__ = ["DEMO", "REPO_ROOT", "SettingParam", "Settings", "building", "dags_per_line", "line_dag_id",
           "line_dag_shared", "line_env", "params_path", "pipeline_lines", "pipeline_params", "raw_data_asset", "served_traffic_asset", "set_arguments"]

# the line whose DAG is being built (building()); the demo line's otherwise
_building = BUILDING


def pipeline_params(line: str | None = None) -> Settings:
    """The typed settings of ``line`` (None: the line being built, else the demo line's
    params.yaml, ``PIPELINE_PARAMS``): cached per file."""
    return load(line=_building.get() if line is None else line)


def pipeline_lines() -> list[str]:
    """The model lines a DAG file builds its DAGs for, the demo line first: each checked, and
    checked apart from the others (``tasks.config.every_line``)."""
    return list(every_line())


@contextlib.contextmanager
def building(line: str) -> Iterator[Settings]:
    """Build ``line``'s DAG in this block: it yields the line's settings, which the launcher reads too."""
    token = _building.set(line)
    try:
        yield pipeline_params(line)
    finally:
        _building.reset(token)


def dags_per_line(builder: Callable[[str, Settings], DAG]) -> dict[str, DAG]:
    """``builder(line, its settings)`` for every model line, each inside :func:`building`: the
    DAGs it returns by their ids, the demo line's first (a DAG file assigns them as its globals)."""
    built: dict[str, DAG] = {}
    for line in pipeline_lines():
        with building(line) as settings:
            dag = builder(line, settings)
        built[dag.dag_id] = dag
    return built


def line_dag_shared(line: str, params: Settings, *tags: str) -> dict[str, Any]:
    """The DAG arguments every DAG of a line shares: the line's start date, no catch-up, and its
    tags (``llm``, ``tags``, and the line's own name but for the demo line's)."""
    import datetime as dt

    return {"start_date": dt.datetime.fromisoformat(params.pipeline.start_date).replace(tzinfo=dt.UTC),
            "catchup": False, "tags": ["llm", *tags, *([] if line == DEMO else [f"line:{line}"])]}


def line_env() -> dict[str, str]:
    """What a step of the line being built needs in its environment to read that line's settings:
    ``PIPELINE_LINE``, empty for the demo line's (a local step inherits the worker's environment,
    whose own PIPELINE_LINE must not reach it)."""
    return {LINE_ENV: _building.get()}


def raw_data_asset() -> Any:
    """The Airflow Asset of the raw data: updated by the ingest DAG, scheduling the retrain DAG."""
    from airflow.sdk import Asset

    pipeline = pipeline_params().pipeline
    return Asset(name=pipeline.raw_data_asset, uri=pipeline.raw_data_uri, group="raw-data")


def served_traffic_asset() -> Any:
    """The Airflow Asset of the captured served traffic: updated when llm_ingest closes a day's
    capture partition, scheduling the drift check (llm_drift)."""
    from airflow.sdk import Asset

    params = pipeline_params()
    return Asset(name=params.drift.served_asset, uri=params.serve.capture.uri, group="served-traffic")


FROM_SETTINGS: Any = object()  # a SettingParam's default: the setting's value in params.yaml


@dataclasses.dataclass(frozen=True)
class SettingParam:
    """A trigger-form Param that stands for one setting of params.yaml (``section.field``, or a
    nested ``section.sub.field``). Its default and its type (a ``Literal``'s values as its enum)
    are read from the typed settings, so the form cannot disagree with the file; ``set_key`` is
    the ``--set`` through which a run's value reaches the steps of the setting's section (None:
    the DAG passes the value as an argument of its own). Adding a Param is one of these."""

    setting: str
    title: str
    description: str
    bounds: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # JSON Schema: minimum, pattern...
    set_key: str | None = None
    nullable: bool = False  # the form may leave it empty (null); a blank setting is null there
    default: Any = FROM_SETTINGS

    @property
    def section(self) -> str:
        return self.setting.split(".", 1)[0]

    def schema(self, settings: Settings) -> dict[str, Any]:
        """The Param's JSON Schema type (and enum) from the setting's annotation, then ``bounds``."""
        *path, name = self.setting.split(".")
        owner: Any = settings
        for part in path:
            owner = getattr(owner, part)
        schema = json_schema(typing.get_type_hints(type(owner))[name])
        if self.nullable:
            schema["type"] = ["null", schema["type"]]
        return {**schema, **self.bounds}

    def value(self, settings: Settings) -> Any:
        if self.default is not FROM_SETTINGS:
            return self.default
        value: Any = settings
        for part in self.setting.split("."):
            value = getattr(value, part)
        if isinstance(value, tuple):
            return list(value)
        return None if self.nullable and value == "" else value

    def param(self, settings: Settings) -> Any:
        from airflow.sdk import Param

        schema = self.schema(settings)
        return Param(self.value(settings), title=self.title, description=self.description, **schema)

    def set_argument(self, name: str, settings: Settings) -> list[str]:
        """``--set KEY=<the run's value>``: JSON for lists and booleans (the steps read YAML)."""
        assert self.set_key is not None
        as_json = self.schema(settings)["type"] in ("array", "boolean")
        return ["--set", f"{self.set_key}={{{{ params.{name}{' | tojson' if as_json else ''} }}}}"]


def json_schema(annotation: Any) -> dict[str, Any]:
    """A settings field's type as JSON Schema's: bool, int, float (or int | float), str, a
    ``Literal`` of strings (with its enum) and a tuple (an array)."""
    if typing.get_origin(annotation) is typing.Literal:
        return {"type": "string", "enum": list(typing.get_args(annotation))}
    if typing.get_origin(annotation) is tuple:
        return {"type": "array"}
    if isinstance(annotation, types.UnionType) and set(typing.get_args(annotation)) == {int, float}:
        return {"type": "number"}
    names = {bool: "boolean", int: "integer", float: "number", str: "string"}
    if annotation not in names:
        raise TypeError(f"{annotation!r}: no JSON Schema type for a Param of this setting")
    return {"type": names[annotation]}


def set_arguments(run_params: Mapping[str, SettingParam], section: str, settings: Settings) -> list[str]:
    """The ``--set`` arguments that carry a run's Params to the steps of one settings section."""
    chosen: Iterable[tuple[str, SettingParam]] = ((name, p) for name, p in run_params.items()
                                                  if p.section == section and p.set_key is not None)
    return [arg for name, p in chosen for arg in p.set_argument(name, settings)]
