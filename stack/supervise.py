"""Starting, reusing and stopping a server of the stack: its process (own process group, PID
file, log), its environment, its health check; where its binary is."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from stack.credentials import without_stack_credentials
from stack.state import ports, state_dir
from tasks.lib.polling import wait_until


class StackError(RuntimeError):
    """A server of the stack could not be started (one line for `python -m stack up`)."""


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


@dataclass(frozen=True)
class Server:
    name: str
    command: Callable[[], list[str]]
    env: Callable[[], dict[str, str]]
    healthy: Callable[[], bool]
    start_timeout_s: float
    port: str | None = None  # its key in ports(): the port it serves on, refused when another process holds it
    # its process holds the credentials of env() alone (see process_env); Airflow's components
    # are not isolated: they run the steps, and a developer's AIRFLOW__ settings are meant for them
    isolated: bool = True
    # a running server that is not healthy brought current in place (True), instead of being
    # restarted: the router takes a new set of model lines by a reload, refusing no request
    refresh: Callable[[], bool] | None = None

    @property
    def pid_file(self) -> Path:
        return state_dir() / f"{self.name}.pid"

    @property
    def log_file(self) -> Path:
        return state_dir() / f"{self.name}.log"

    def process_env(self) -> dict[str, str]:
        """Its process's environment: the starter's, less the stack's credentials where it is
        isolated (SeaweedFS would adopt a starter's AWS keys as one more admin identity; the
        OpenAI front must hold only its capture's keys), and env()."""
        inherited = without_stack_credentials(os.environ) if self.isolated else dict(os.environ)
        return {**inherited, **self.env()}

    def pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text())
            os.kill(pid, 0)
            return pid
        except (FileNotFoundError, ValueError, ProcessLookupError):
            return None

    def start(self) -> None:
        if self.pid() and self.healthy():
            return  # reuse a healthy running server
        if self.pid() and self.refresh is not None and self.refresh():
            return
        self.stop()
        if self.port is not None and _listening(port := ports()[self.port]):
            # another stack's server on the same port would answer the health check (and the steps)
            raise StackError(f"{self.name}: port {port} is held by a process this stack ({state_dir()}) did not "
                             f"start: stop it, or give this stack other ports (STACK_PORT_{self.port.upper()})")
        with self.log_file.open("ab") as log:
            proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.process_env(),
                cwd=state_dir(),
                start_new_session=True,  # own process group: `down` stops its children too
            )
        self.pid_file.write_text(str(proc.pid))
        def healthy() -> bool:
            if self.healthy():
                return True
            if proc.poll() is not None:
                raise StackError(f"{self.name} exited with {proc.returncode}; see {self.log_file}")
            return False

        wait_until(healthy, self.start_timeout_s, 0.3, lambda: StackError(
            f"{self.name} not healthy after {self.start_timeout_s:.0f}s; see {self.log_file}"))

    def stop(self) -> None:
        stop_servers([self])


def stop_servers(servers: Iterable[Server]) -> None:
    """Stop servers (and their children) together: one grace period for all of them. Airflow's
    components each used most of theirs, and stopping them one after another took ~50 s."""
    servers = list(servers)
    terminate_groups([pid for pid in (server.pid() for server in servers) if pid is not None])
    for server in servers:
        server.pid_file.unlink(missing_ok=True)


def terminate_groups(pids: list[int], grace_s: float = 10.0) -> None:
    """SIGTERM each process group, then SIGKILL those still alive after the grace period."""
    _signal_groups(pids, signal.SIGTERM)
    alive = _wait_for_groups(pids, grace_s)
    _signal_groups(alive, signal.SIGKILL)
    _wait_for_groups(alive, 5.0)


def _signal_groups(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)


def _wait_for_groups(pids: Iterable[int], timeout_s: float) -> set[int]:
    """The groups still alive after up to timeout_s."""
    alive = {pid for pid in pids if _group_alive(pid)}
    deadline = time.monotonic() + timeout_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = {pid for pid in alive if _group_alive(pid)}
    return alive


def _group_alive(pid: int) -> bool:
    # a leader this process started stays a zombie member of its group until reaped
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    try:
        os.killpg(pid, 0)
        return True
    except ProcessLookupError:
        return False


def http_ok(url: str, headers: Mapping[str, str] | None = None) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=dict(headers or {})), timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def bin_path(name: str) -> str:
    """A console script of the runtime environment (the one running this module)."""
    found = Path(sys.executable).parent / name
    return str(found) if found.exists() else (shutil.which(name) or name)


def debian_bin(name: str) -> str:
    """A server from a Debian package (the Makefile installs it with apt-get when missing)."""
    found = shutil.which(name) or f"/usr/bin/{name}"
    if not Path(found).exists():
        raise RuntimeError(f"{name} is not installed: run `make env` (it installs the Debian package)")
    return found
