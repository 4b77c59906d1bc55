"""params.yaml as the DAGs see it: read once at parse time (a small YAML file, no network)."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]


def params_path() -> Path:
    return Path(os.environ.get("PIPELINE_PARAMS", REPO_ROOT / "params.yaml"))


@lru_cache(maxsize=4)
def _load(path: Path) -> dict[str, Any]:
    # libyaml's loader where PyYAML has it: ~8x faster than the pure-Python one
    loaded: dict[str, Any] = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    return loaded


def pipeline_params() -> dict[str, Any]:
    return _load(params_path())


def raw_data_asset() -> Any:
    """The Airflow Asset of the raw data: updated by the ingest DAG, scheduling the retrain DAG."""
    from airflow.sdk import Asset

    pipeline = pipeline_params()["pipeline"]
    return Asset(name=pipeline["raw_data_asset"], uri=pipeline["raw_data_uri"], group="raw-data")
