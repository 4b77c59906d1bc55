"""Run a command in the foreground and another beside it at idle CPU priority (make test's last tier).

The timed tests (the canary verdicts, an abandoned request's slot) leave about half of the two
cores idle while they wait on the clock; the orchestrator half is CPU-bound. Put in a CPU cgroup
marked idle (``cpu.idle``: SCHED_IDLE for the group as a whole, however many threads it runs),
the orchestrator half takes only what the timed tests leave: they ran as fast as alone (455 s
against 491-510) where plain ``nice -n 19`` slowed them by half and failed one, its dozens of
niced threads outweighing a few normal ones (docs/testing.md).

Where no such group can be made (no root, no CPU controller with ``cpu.idle``: kernels before
5.15), the two run one after the other, foreground first: the same tests, only slower.

    python tests/run_beside.py --foreground 'CMD' --idle 'CMD'

The foreground's output is printed as it comes; the idle command's is kept in a file and
printed once the foreground has ended (then followed to its end). Exit status: the first
non-zero of the two, else 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")


def idle_cgroup() -> Path | str:
    """A new CPU cgroup marked idle, or why none can be made here (one line)."""
    if not (CGROUP_V1_CPU / "cpu.idle").exists():
        return f"{CGROUP_V1_CPU}: no CPU controller with cpu.idle (cgroup v1, kernel 5.15 or later)"
    group = CGROUP_V1_CPU / f"llm-pipeline-tests-idle-{os.getpid()}"
    try:
        group.mkdir()
        (group / "cpu.idle").write_text("1\n")
    except OSError as err:
        remove_group(group)
        return f"{group}: {err.strerror or err}"
    return group


def remove_group(group: Path) -> None:
    with contextlib.suppress(OSError):  # not made, or a process the idle command left is still in it
        group.rmdir()


def follow(log: Path, idle: subprocess.Popen[bytes]) -> None:
    """Print ``log`` from its start, then what is added to it, until ``idle`` has exited."""
    with log.open("rb") as source:
        while True:
            exited = idle.poll() is not None
            chunk = source.read()
            if chunk:
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
            if exited:
                return
            time.sleep(1)


def run(foreground: str, idle_command: str) -> int:
    group = idle_cgroup()
    if not isinstance(group, Path):
        print(f"run_beside: no idle CPU group ({group}): the second command runs after the first", flush=True)
        first = subprocess.run(foreground, shell=True).returncode
        second = subprocess.run(idle_command, shell=True).returncode
        return first or second
    procs = group / "cgroup.procs"
    log = Path(tempfile.mkdtemp(prefix="run-beside-")) / "idle.log"
    print(f"run_beside: at idle CPU priority ({group}), its output after this one's: {idle_command}", flush=True)
    try:
        with log.open("wb") as out:
            # joins the group before it execs, so every process it starts is in it from the first
            idle = subprocess.Popen(idle_command, shell=True, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=lambda: procs.write_text(f"{os.getpid()}\n"))
        try:
            first = subprocess.run(foreground, shell=True).returncode
            print(f"\nrun_beside: the foreground ended ({first}); the idle command's output:", flush=True)
            follow(log, idle)
        finally:
            if idle.poll() is None:  # interrupted: the idle command and what it started go too
                os.killpg(idle.pid, signal.SIGTERM)
            second = idle.wait()
    finally:
        shutil.rmtree(log.parent, ignore_errors=True)
        remove_group(group)
    return first or second


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--foreground", required=True, help="shell command run at the usual priority")
    parser.add_argument("--idle", required=True, help="shell command run beside it at idle CPU priority")
    args = parser.parse_args()
    return run(args.foreground, args.idle)


if __name__ == "__main__":
    sys.exit(main())
