"""params.yaml as the DAGs see it: ``tasks.config``'s typed settings, read and checked once at
parse time (a small YAML file, no network)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

# Airflow's processes have the repository root (/opt/airflow in the image) on PYTHONPATH; a
# plugin run as a script (`python plugins/cluster.py base`) has only its own folder
if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from tasks.config import REPO_ROOT, Settings, load, params_path

__all__ = ["REPO_ROOT", "Settings", "params_path", "pipeline_params", "raw_data_asset", "served_traffic_asset"]


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
