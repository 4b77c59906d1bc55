"""The code's shape: the steps that load no model start without torch (2-4 s of every process's
start on these machines: a tokenize shard, each deploy and report of every run), a step process
sends no library's usage telemetry, and no function takes more than six parameters."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from helpers import REPO_ROOT, RUNTIME_PY

NO_MODEL_STEPS = ("snapshot", "validate", "ingest", "tokenize", "deploy", "report", "drift", "seed")


@pytest.mark.parametrize("step", NO_MODEL_STEPS)
def test_a_step_that_loads_no_model_imports_no_torch(step: str) -> None:
    check = f"import sys, tasks.{step}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    proc = subprocess.run([str(RUNTIME_PY), "-c", check], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", f"tasks.{step} imports {proc.stdout.strip()}"


# what MLflow's and DVC's own switches say in a process (outside any CI, outside a DVC repository)
TELEMETRY = ("import dvc.analytics, mlflow.telemetry.utils as mlflow_telemetry; "
             "print(dvc.analytics.is_enabled(), not mlflow_telemetry.is_telemetry_disabled())")


def test_a_step_process_sends_no_usage_telemetry(tmp_path: Path) -> None:
    """MLflow's client and DVC (an analytics daemon beside each command) report usage by default;
    importing the steps' package turns both off, and a deployment that sets a variable keeps it."""
    # a bare environment: MLflow stays quiet wherever it sees a CI or pytest variable
    bare = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONPATH": str(REPO_ROOT)}

    def enabled(code: str, env: dict[str, str]) -> str:
        proc = subprocess.run([str(RUNTIME_PY), "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.strip()

    assert enabled(TELEMETRY, bare) == "True True"  # the libraries' defaults: what the import turns off
    assert enabled("import tasks; " + TELEMETRY, bare) == "False False"
    assert enabled("import tasks; " + TELEMETRY, {**bare, "DVC_NO_ANALYTICS": "", "MLFLOW_DISABLE_TELEMETRY": "false"}
                   ) == "True True"  # set by the deployment: kept
    # and `dvc repro` in this repository (its DVC config), whatever the environment
    proc = subprocess.run([str(RUNTIME_PY), "-m", "dvc", "config", "core.analytics"], cwd=REPO_ROOT, env=bare,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "false", proc.stderr[-2000:]


def test_no_function_takes_more_than_six_parameters() -> None:
    """What travels together is one value (a settings section, a frozen dataclass): a function of
    tasks/, plugins/ or dags/ takes at most six parameters (self, *args and **kwargs not counted)."""
    import ast

    over = []
    for root in ("tasks", "plugins", "dags"):
        for path in sorted((REPO_ROOT / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    args = node.args
                    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
                    count = len(names) - (names[:1] in (["self"], ["cls"]))
                    if count > 6:
                        over.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} {node.name} ({count})")
    assert not over, over
