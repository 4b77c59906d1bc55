"""Fixtures shared by both halves of the suite (runtime venv: tasks/ stack/ containers/;
orchestrator venv: dags/ plugins/). Helpers live in helpers.py.

Integration fixtures start the real local stack once per session, in a temporary state folder
and on ports of their own, so a developer's running stack is neither reused nor disturbed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import (
    REPO_ROOT,
    SEED_DOCUMENTS,
    SEED_END,
    SEED_URI,
    SESSION_DIR,
    SHARED_RUN_MODULES,
    TEST_PORTS,
    run_module,
    step_result,
    tokenize,
)

# Airflow reads its config at import: point the orchestrator half at a throwaway database.
os.environ.setdefault("AIRFLOW_HOME", str(REPO_ROOT))
os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = f"sqlite:///{SESSION_DIR}/airflow.db"
os.environ["AIRFLOW__LOGGING__BASE_LOG_FOLDER"] = str(SESSION_DIR / "airflow-logs")
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"] = str(SESSION_DIR / "airflow-passwords.json")
os.environ.setdefault("PIPELINE_LAUNCHER_MODE", "local")
# Where two test processes share two cores (xdist sets the count before this file loads), a torch
# process's OpenMP threads are contended: by default one spins at each barrier while the thread
# it waits for is descheduled. Sleeping there instead halved the evaluate and export steps' CPU
# (docs/testing.md); in one process, as the timed tests run (the orchestrator half beside them
# only at idle priority), spinning is faster. Read when torch loads: set before any test imports
# it, inherited by the steps and servers the tests start.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
for path in (REPO_ROOT, REPO_ROOT / "plugins", REPO_ROOT / "dags"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))



def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that uses the real stack is an integration test, marked or not (make test-fast
    leaves them out, so the fast tier never starts a server)."""
    for item in items:
        if "stack_env" in getattr(item, "fixturenames", ()) and not item.get_closest_marker("integration"):
            item.add_marker(pytest.mark.integration)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``, with the modules that share a DAG run as one unit (helpers.py's
    SHARED_RUN_MODULES; not xdist's loadgroup: pytest 9 ignores the node id xdist 3.8 rewrites)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedRunScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return SHARED_RUN_MODULES.get(module, module)

    return SharedRunScheduling(config, log)


def pytest_sessionfinish(session: pytest.Session) -> None:
    shutil.rmtree(SESSION_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def airflow_db() -> None:
    """The session's Airflow database (orchestrator half only: it imports Airflow)."""
    from airflow.utils import db

    db.initdb()


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
    try:  # a server that did start is stopped even when another failed to
        proc = run_module("stack", "up")
        assert proc.returncode == 0, proc.stderr[-3000:]
        client = dict(line.split("=", 1) for line in (stack_dir / "stack.env").read_text().splitlines() if line)
        # and people's logins (Prometheus), which the steps' stack.env leaves out
        printed = run_module("stack", "env").stdout.splitlines()
        client.update(line.removeprefix("export ").split("=", 1) for line in printed if line.startswith("export "))
        os.environ.update(client)
        yield {**env, **client}
    finally:
        run_module("stack", "down")


@pytest.fixture(scope="session")
def seeded_raw(stack_env: dict[str, str]) -> str:
    """Raw partitions of real text (installed docstrings) on the test S3 server."""
    proc = run_module(
        "tasks.seed", "--output", SEED_URI, "--end-date", SEED_END, "--set", f"max_documents={SEED_DOCUMENTS}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return SEED_URI


@pytest.fixture(scope="session")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small snapshot of real text: 600 installed docstrings, normalized and de-duplicated."""
    from tasks import seed
    from tasks.lib import records

    raw = ({"id": str(i), "text": doc, "source": name, "created_at": "2026-11-01T00:00:00"}
           for i, (name, doc) in enumerate(seed.documents(600)))
    result = records.normalize_and_dedup(raw)
    path = tmp_path_factory.mktemp("snap") / "snapshot.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in result.records))
    return path


@pytest.fixture(scope="session")
def tokenizer_uri(snapshot: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("tok")
    proc = run_module(
        "tasks.tokenize", "prepare", "--snapshot", str(snapshot), "--output", str(root / "prepare"),
        "--set", "vocab_size=1000", "--set", f"tokenizer_store={root / 'store'}",
        env={"MLFLOW_TRACKING_URI": ""},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = step_result(proc)
    assert result["tokenizer_source"] == "trained"
    assert result["vocab_size"] == 1000 and result["dtype"] == "uint16"
    assert str(result["tokenizer_uri"]).endswith(f"sha256-{result['tokenizer_hash']}/tokenizer.json")
    return str(result["tokenizer_uri"])


@pytest.fixture(scope="session")
def dataset(snapshot: Path, tokenizer_uri: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("train-data")
    tokenize(snapshot, tokenizer_uri, root, 1)
    return root / "dataset"
