"""tests/run_beside.py, make test's last tier: the timed tests in the foreground, the orchestrator
half beside them in a CPU cgroup marked idle (or after them where none can be made)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO_ROOT

RUN_BESIDE = REPO_ROOT / "tests" / "run_beside.py"
sys.path.insert(0, str(RUN_BESIDE.parent))
from run_beside import CGROUP_V1_CPU, idle_cgroup, remove_group  # noqa: E402


def idle_group_here() -> bool:
    group = idle_cgroup()
    if isinstance(group, Path):
        remove_group(group)
        return True
    return False


def groups_left(run: subprocess.Popen[str]) -> list[str]:
    """The idle groups ``run`` made that are still there (named by its pid)."""
    made = CGROUP_V1_CPU.glob(f"llm-pipeline-tests-idle-{run.pid}-*")
    return sorted(p.name for p in made) if CGROUP_V1_CPU.exists() else []


def run_beside(foreground: str, idle: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(RUN_BESIDE), "--foreground", foreground, "--idle", idle],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_the_idle_command_runs_in_an_idle_group_and_its_output_follows() -> None:
    """Its output after the foreground's; the first non-zero status of the two; in the group where
    one can be made (cpu.idle set), after the foreground where not; no group left."""
    proc = run_beside("echo foreground; exit 3", "cat /proc/self/cgroup; cat /sys/fs/cgroup/cpu$(grep -o ':cpu:.*' "
                      "/proc/self/cgroup | cut -d: -f3)/cpu.idle 2>/dev/null; echo idle")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3, out
    assert out.index("\nforeground\n") < out.rindex("\nidle\n"), out
    if idle_group_here():
        assert ":cpu:/llm-pipeline-tests-idle-" in out and "\n1\nidle\n" in out, out
    else:
        assert "no idle CPU group" in out, out
    assert groups_left(proc) == []


def test_a_terminated_run_stops_both_and_what_the_idle_command_left() -> None:
    """SIGTERM (CI's): the foreground asked to stop (SIGINT, as pytest tears down on it), the idle
    command's session too, then anything still in its group killed (a server of its own session,
    as the stack's are) and the group removed; exit 128 + 15."""
    if not idle_group_here():
        pytest.skip("no cgroup v1 CPU controller with cpu.idle here (or not root): the two run one after the other")
    marker = f"{time.time_ns() % 10**6 + 1000}.5"  # a sleep no one else runs
    proc = run_beside(f"sleep {marker}1", f"setsid sleep {marker}2 & exec sleep {marker}3")
    time.sleep(2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "killed 1 processes the idle command left" in out, out
    running = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True).stdout
    assert running == "", running
    assert groups_left(proc) == []
