"""params.yaml as the DAGs see it: ``tasks.config``'s typed settings, read and checked once at
parse time (a small YAML file, no network)."""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

# Airflow's processes have the repository root (/opt/airflow in the image) on PYTHONPATH; a
# plugin run as a script (`python plugins/cluster.py base`) has only its own folder
if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from tasks.config import REPO_ROOT, Settings, load, params_path

__all__ = ["REPO_ROOT", "SettingParam", "Settings", "params_path", "pipeline_params", "raw_data_asset",
           "served_traffic_asset", "set_arguments"]


def pipeline_params() -> Settings:
    """The settings of params.yaml (``PIPELINE_PARAMS``), typed: cached per file."""
    return load()


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
