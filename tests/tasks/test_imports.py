"""The steps that load no model start without torch (2-4 s of every process's start on these
machines: a tokenize shard, each deploy and report of every run)."""

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
