"""Fixtures shared by both halves of the suite (runtime venv: tasks/ stack/; orchestrator
venv: dags/ plugins/). Only stdlib + pytest here, so it imports in either environment.

Integration fixtures start the real local stack once per session, in a temporary state folder
and on ports of their own, so a developer's running stack is neither reused nor disturbed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
RUNTIME_PY = REPO_ROOT / ".venvs" / "runtime" / "bin" / "python"
SESSION_DIR = Path(tempfile.mkdtemp(prefix="llm-pipeline-tests-"))

# Airflow reads its config at import: point the orchestrator half at a throwaway database.
os.environ.setdefault("AIRFLOW_HOME", str(REPO_ROOT))
os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = f"sqlite:///{SESSION_DIR}/airflow.db"
os.environ["AIRFLOW__LOGGING__BASE_LOG_FOLDER"] = str(SESSION_DIR / "airflow-logs")
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ.setdefault("PIPELINE_LAUNCHER_MODE", "local")
for path in (REPO_ROOT, REPO_ROOT / "plugins", REPO_ROOT / "dags"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

# Ports of the test stack: apart from the defaults (8333, 9333, 5000, ...) of a dev stack.
TEST_PORTS = {
    "s3": 8433,
    "seaweedfs_master": 9433,
    "seaweedfs_volume": 18180,
    "seaweedfs_filer": 18988,
    "mlflow": 5100,
    "airflow": 8180,
}

# Raw demo data the integration tests share: 14 days ending on SEED_END, a week per run.
SEED_URI = "s3://raw/test-seed"
SEED_END = "2026-11-21"
SEED_DOCUMENTS = 3000


def run_module(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGS`` in the runtime venv from the repo root, output captured."""
    return subprocess.run(
        [str(RUNTIME_PY), "-m", module, *args],
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )


def step_result(proc: subprocess.CompletedProcess[str]) -> dict[str, object]:
    """The result JSON a step logged (``... result {json}``)."""
    for line in reversed(proc.stderr.splitlines()):
        if " result {" in line:
            loaded: dict[str, object] = json.loads(line.split(" result ", 1)[1])
            return loaded
    raise AssertionError(f"no result line; rc={proc.returncode}\n{proc.stderr[-3000:]}")


def error_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("ERROR ")]


@pytest.fixture(scope="session")
def stack_env() -> Iterator[dict[str, str]]:
    """The real local stack (SeaweedFS S3 + MLflow), started once, stopped at the end."""
    stack_dir = SESSION_DIR / "stack"
    env = {
        "STACK_DIR": str(stack_dir),
        "DVC_REGISTRY_DIR": str(SESSION_DIR / "dvc-registry"),
        **{f"STACK_PORT_{name.upper()}": str(port) for name, port in TEST_PORTS.items()},
    }
    os.environ.update(env)
    proc = run_module("stack", "up")
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = dict(line.split("=", 1) for line in (stack_dir / "stack.env").read_text().splitlines() if line)
    os.environ.update(client)
    yield {**env, **client}
    run_module("stack", "down")


@pytest.fixture(scope="session")
def seeded_raw(stack_env: dict[str, str]) -> str:
    """Raw partitions of real text (installed docstrings) on the test S3 server."""
    proc = run_module(
        "tasks.seed", "--output", SEED_URI, "--end-date", SEED_END, "--set", f"max_documents={SEED_DOCUMENTS}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return SEED_URI
