"""Run a command in the foreground and another beside it at idle CPU priority (make test's last tier).

The timed tests (the canary verdicts, an abandoned request's slot) leave about half of the two
cores idle while they wait on the clock; the orchestrator half is CPU-bound. Put in a CPU cgroup
marked idle (cgroup v1's ``cpu.idle``, kernel 5.15 or later, root: SCHED_IDLE for the group as a
whole, however many threads it runs), the orchestrator half takes only what the timed tests
leave: they ran as fast as alone, where plain ``nice -n 19`` slowed them by half and failed one,
its dozens of niced threads outweighing a few normal ones (docs/testing.md).

Where no such group can be made, the two run one after the other, foreground first: the same
tests, only slower.

    python tests/run_beside.py --foreground 'CMD' --idle 'CMD'

The foreground's output is printed as it comes; the idle command's is kept in a file and printed
once the foreground has ended, then followed to its end. Interrupted (Ctrl-C, SIGTERM, SIGHUP),
each command is asked to stop as Ctrl-C asks pytest (its fixtures stop their servers), then
killed, and so is whatever is left in the group. Exit status: the first non-zero of the two
(128 + N for a command ended by signal N), else 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")
STOP_GRACE_S = 120  # pytest's teardown after Ctrl-C: each stack's servers stopped in turn


class Interrupted(Exception):
    """SIGTERM or SIGHUP, raised where run() waits, so that its cleanup runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def interrupted(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum)


def idle_cgroup() -> Path | str:
    """A new CPU cgroup marked idle, or why none can be made here (one line)."""
    if not (CGROUP_V1_CPU / "cpu.idle").exists():
        return f"{CGROUP_V1_CPU}: no cgroup v1 CPU controller with cpu.idle (kernel 5.15 or later)"
    group = CGROUP_V1_CPU / f"llm-pipeline-tests-idle-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        group.mkdir()
    except OSError as err:
        return f"{group}: {err.strerror or err}"
    try:
        (group / "cpu.idle").write_text("1\n")
    except OSError as err:
        remove_group(group)
        return f"{group / 'cpu.idle'}: {err.strerror or err}"
    return group


def kill_left_in(group: Path) -> int:
    """SIGKILL what is still in ``group`` (servers started in sessions of their own stay in it)."""
    left = [int(pid) for pid in (group / "cgroup.procs").read_text().split()]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(left)


def remove_group(group: Path) -> None:
    deadline = time.monotonic() + 60  # a killed orphan leaves the group once init has reaped it
    while True:
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                print(f"run_beside: warning: {group} could not be removed", file=sys.stderr, flush=True)
                return
            time.sleep(0.5)


def interruptible() -> None:
    """In a child before it execs: SIGINT as a terminal's Ctrl-C (a command started from a
    background job inherits it ignored, and pytest tears its servers down only on SIGINT)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def wait_passing_signals(proc: subprocess.Popen[bytes]) -> int:
    """``proc``'s exit status (``proc`` leads a process group of its own). Interrupted meanwhile,
    its group is sent SIGINT, as Ctrl-C at a terminal would (pytest then stops its servers), and
    given up to STOP_GRACE_S before it is killed; the interruption is raised after."""
    caught: BaseException | None = None
    deadline: float | None = None
    while True:
        try:
            returncode = proc.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            break
        except subprocess.TimeoutExpired:
            signal_group(proc, signal.SIGKILL)
            deadline = None
        except (KeyboardInterrupt, Interrupted) as err:
            if caught is None:
                signal_group(proc, signal.SIGINT)
                caught, deadline = err, time.monotonic() + STOP_GRACE_S
    if caught is not None:
        raise caught
    return exit_status(returncode)


def signal_group(proc: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signum)


def started(command: str) -> subprocess.Popen[bytes]:
    """``command`` in a process group of its own, which an interruption is passed on to."""
    return subprocess.Popen(command, shell=True, process_group=0, preexec_fn=interruptible)


def stop(idle: subprocess.Popen[bytes]) -> None:
    """Ctrl-C to the idle command's session (it runs in one of its own), then SIGKILL past the grace."""
    signal_group(idle, signal.SIGINT)
    try:
        idle.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        signal_group(idle, signal.SIGKILL)
        idle.wait()


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


def one_after_the_other(foreground: str, idle_command: str) -> int:
    first = wait_passing_signals(started(foreground))
    second = wait_passing_signals(started(idle_command))
    return first or second


def join(procs: Path) -> None:
    """In the idle command's process before it execs: into the group, so all it starts is too."""
    procs.write_text(f"{os.getpid()}\n")
    interruptible()


def beside(foreground: str, idle_command: str, group: Path) -> int:
    log = Path(tempfile.mkdtemp(prefix="run-beside-")) / "idle.log"
    procs = group / "cgroup.procs"
    try:
        with log.open("wb") as out:
            idle = subprocess.Popen(idle_command, shell=True, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, preexec_fn=lambda: join(procs))
    except subprocess.SubprocessError:
        log.unlink()
        log.parent.rmdir()
        raise
    print(f"run_beside: at idle CPU priority ({group}), its output after this one's: {idle_command}", flush=True)
    try:
        first = wait_passing_signals(started(foreground))
        print(f"\nrun_beside: the foreground ended ({first}); the idle command's output:", flush=True)
        follow(log, idle)
        second = exit_status(idle.wait())
    except BaseException:
        stop(idle)
        print(f"run_beside: interrupted; the idle command's output is in {log}", file=sys.stderr, flush=True)
        raise
    log.unlink()
    log.parent.rmdir()
    return first or second


def run(foreground: str, idle_command: str) -> int:
    group = idle_cgroup()
    if not isinstance(group, Path):
        print(f"run_beside: no idle CPU group ({group}): the second command runs after the first", flush=True)
        return one_after_the_other(foreground, idle_command)
    try:
        return beside(foreground, idle_command, group)
    except subprocess.SubprocessError as err:  # the idle command could not join the group
        print(f"run_beside: {group / 'cgroup.procs'}: {err}: the second command runs after the first", flush=True)
        return one_after_the_other(foreground, idle_command)
    finally:
        if left := kill_left_in(group):
            print(f"run_beside: killed {left} processes the idle command left", file=sys.stderr, flush=True)
        remove_group(group)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--foreground", required=True, help="shell command run at the usual priority")
    parser.add_argument("--idle", required=True, help="shell command run beside it at idle CPU priority")
    args = parser.parse_args()
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, interrupted)
    try:
        return run(args.foreground, args.idle)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except Interrupted as err:
        return 128 + err.signum


if __name__ == "__main__":
    sys.exit(main())
