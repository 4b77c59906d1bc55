"""tasks.lib.torchrun: torchrun that keeps the step contract's exit codes (real torchrun, one
standalone agent restarting its worker group up to twice)."""

from __future__ import annotations

import subprocess

from helpers import REPO_ROOT, RUNTIME_PY

from tasks.lib.torchrun import with_rendezvous_host

AGENT = [str(RUNTIME_PY), "-m", "tasks.lib.torchrun", "--standalone", "--nproc-per-node=1", "--max-restarts=2"]


def run_agent(*worker: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*AGENT, *worker], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


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
