"""The code's shape: the steps that load no model start without torch (2-4 s of every process's
start on these machines: a tokenize shard, each deploy and report of every run), and no function
takes more than six parameters."""

from __future__ import annotations

import subprocess

import pytest
from helpers import REPO_ROOT, RUNTIME_PY

NO_MODEL_STEPS = ("snapshot", "validate", "ingest", "tokenize", "deploy", "report", "drift", "seed")


@pytest.mark.parametrize("step", NO_MODEL_STEPS)
def test_a_step_that_loads_no_model_imports_no_torch(step: str) -> None:
    check = f"import sys, tasks.{step}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    proc = subprocess.run([str(RUNTIME_PY), "-c", check], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", f"tasks.{step} imports {proc.stdout.strip()}"


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
