"""tasks.lib.torchrun: torchrun that keeps the step contract's exit codes (real torchrun, one
standalone agent restarting its worker group up to twice)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from helpers import REPO_ROOT, RUNTIME_PY

from tasks.lib import torchrun
from tasks.lib.torchrun import preload_allocator, with_rendezvous_host

pytestmark = pytest.mark.torchrun  # real torchrun agents: the slower tier

AGENT = [str(RUNTIME_PY), "-m", "tasks.lib.torchrun", "--standalone", "--nproc-per-node=1", "--max-restarts=2"]


def run_agent(*worker: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*AGENT, *worker], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_bad_input_exits_2_without_restarting_the_worker_group() -> None:
    proc = run_agent("-m", "tasks.train")  # no --dataset: a usage error, exit 2 of argparse
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("the following arguments are required") == 1  # not restarted
    assert "bad input, the worker group was not restarted: ERROR python -m tasks.train" in proc.stderr


def test_a_crash_is_restarted_and_exits_1() -> None:
    proc = run_agent("-m", "tasks.no_such_step")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.count("No module named tasks.no_such_step") == 3  # first try + 2 restarts


def test_only_completion_index_0_hosts_the_rendezvous() -> None:
    argv = ["--nnodes=2", "-m", "tasks.train"]
    assert with_rendezvous_host(argv, {"JOB_COMPLETION_INDEX": "0"})[0] == "--rdzv-conf=is_host=true"
    assert with_rendezvous_host(argv, {"JOB_COMPLETION_INDEX": "1"})[0] == "--rdzv-conf=is_host=false"
    assert with_rendezvous_host(argv, {"JOB_COMPLETION_INDEX": "7"})[0] == "--rdzv-conf=is_host=false"
    assert with_rendezvous_host(argv, {}) == argv  # not in a Job: torchrun decides
    explicit = ["--rdzv-conf=is_host=true", *argv]
    assert with_rendezvous_host(explicit, {"JOB_COMPLETION_INDEX": "1"}) == explicit


def test_cpu_workers_run_on_tcmalloc_unless_the_environment_names_its_own_preload(tmp_path: Path) -> None:
    worker = tmp_path / "which_malloc.py"
    worker.write_text(f"import sys; sys.path.insert(0, {str(REPO_ROOT)!r})\n"
                      "from tasks.lib.torchrun import malloc_in_use; print('malloc', malloc_in_use())\n")
    clean = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    preloaded = subprocess.run([*AGENT, str(worker)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=clean)
    assert "malloc tcmalloc" in preloaded.stdout, preloaded.stderr[-2000:]  # the Makefile installs it
    kept = run_agent(str(worker), env={"LD_PRELOAD": ""})  # an operator's choice: glibc
    assert "malloc glibc" in kept.stdout, kept.stderr[-2000:]


def test_allocator_preload_rules(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    env: dict[str, str] = {}
    assert preload_allocator(env, on_gpu=False) == "libtcmalloc_minimal.so.4"
    assert env["LD_PRELOAD"] == "libtcmalloc_minimal.so.4" and int(env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"]) >= 1 << 40
    for own in ({"LD_PRELOAD": ""}, {"LD_PRELOAD": "libjemalloc.so.2"}):
        assert preload_allocator(dict(own), on_gpu=False) is None
    gpu: dict[str, str] = {}
    assert preload_allocator(gpu, on_gpu=True) is None and gpu == {}
    # a machine without the library: one line saying what to install, glibc's malloc
    monkeypatch.setattr(torchrun.ctypes.util, "find_library", lambda name: None)
    bare: dict[str, str] = {}
    assert preload_allocator(bare, on_gpu=False) is None and bare == {}
    assert "apt-get install libtcmalloc-minimal4" in capsys.readouterr().err
