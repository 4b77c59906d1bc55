"""What every step shares: the CLI skeleton, logging, progress lines and the result JSON.

A step is ``main(args) -> result``, its result a frozen dataclass of :mod:`tasks.results`;
:func:`run_step` turns it into a process that keeps the step contract (``tasks/contract.py``):
exit 0 and the result as small JSON, or exit 2 with one ``ERROR`` line naming the bad input
(exit 1 with a traceback for bugs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from tasks.contract import (
    BAD_INPUT_EXIT_CODE,
    BAD_INPUT_FILE_ENV,
    GATE_REJECTED_EXIT_CODE,
    POD_RESULT_PATH,
    RESULT_PATH_ENV,
    TERMINATED_EXIT_CODE,
    to_json,
)
from tasks.lib.errors import GateRejected, StepError, Terminated, first_line

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

log = logging.getLogger("tasks")



def step_parser(name: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m tasks.{name}", description=description)
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a setting of the {name!r} section of params.yaml (repeatable)",
    )
    return parser


def configure_logging() -> None:
    logging.basicConfig(
        level=os.environ.get("LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def result_path() -> Path | None:
    if RESULT_PATH_ENV in os.environ:
        return Path(os.environ[RESULT_PATH_ENV])
    return POD_RESULT_PATH if POD_RESULT_PATH.parent.is_dir() else None


def write_result(result: DataclassInstance) -> None:
    """Hand the result to the orchestrator (XCom) as JSON and show it in the log."""
    text = json.dumps(to_json(result), sort_keys=True)
    log.info("result %s", text)
    path = result_path()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # ranks of one job may share the path
        tmp.write_text(text)
        tmp.replace(path)


def stop_torchrun_agent(error_line: str) -> None:
    """Under torchrun, a worker's exit code is lost (the agent restarts the group
    ``--max-restarts`` times, then exits 1): on bad input, which no restart can fix, the worker
    leaves its error line where ``tasks.lib.torchrun`` looks and stops its agent (SIGTERM: it
    ends its workers and exits without restarting); the agent then exits 2."""
    if not os.environ.get("TORCHELASTIC_RUN_ID"):
        return
    if BAD_INPUT_FILE_ENV in os.environ:
        with contextlib.suppress(OSError):
            Path(os.environ[BAD_INPUT_FILE_ENV]).write_text(error_line + "\n")
    with contextlib.suppress(ProcessLookupError):
        os.kill(os.getppid(), signal.SIGTERM)


# set on SIGTERM (after raise_on_sigterm): loops and load generators stop starting new work
stopping = threading.Event()


def raise_on_sigterm() -> None:
    """From now on SIGTERM raises :class:`Terminated` in the main thread and sets ``stopping``,
    so a step can undo what it must before it goes (the deploy: traffic back to stable). Once:
    a second SIGTERM while that clean-up runs is ignored (the pod's grace period bounds it)."""
    def on_sigterm(signum: int, frame: object) -> None:
        if stopping.is_set():
            return
        stopping.set()
        raise Terminated("terminated by SIGTERM")

    signal.signal(signal.SIGTERM, on_sigterm)


def parse_step_args(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """``parser.parse_args()``; a usage error is bad input (argparse exits 2) under torchrun too."""
    try:
        return parser.parse_args()
    except SystemExit as exc:
        if exc.code == BAD_INPUT_EXIT_CODE:
            stop_torchrun_agent(f"ERROR {parser.prog}: invalid arguments (see the usage line above)")
        raise


def run_step(parser: argparse.ArgumentParser, main: Callable[[argparse.Namespace], DataclassInstance]) -> NoReturn:
    configure_logging()
    args = parse_step_args(parser)
    try:
        result = main(args)
    except StepError as exc:
        # one line, so the orchestrator can show it as the reason the task failed
        line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        error_line = f"ERROR {parser.prog}: {line}"
        print(error_line, file=sys.stderr, flush=True)
        stop_torchrun_agent(error_line)
        sys.exit(BAD_INPUT_EXIT_CODE)
    except Terminated as exc:
        print(f"ERROR {parser.prog}: {first_line(exc) or 'terminated by SIGTERM'}", file=sys.stderr, flush=True)
        sys.exit(TERMINATED_EXIT_CODE)
    except GateRejected as exc:
        write_result(exc.result)
        print(f"REJECTED {parser.prog}: {exc}", file=sys.stderr, flush=True)
        sys.exit(GATE_REJECTED_EXIT_CODE)
    write_result(result)
    sys.exit(0)


class Progress:
    """Logs ``done/total unit, rate/s, ETA`` at most every ``every_s`` seconds."""

    def __init__(self, what: str, total: float | None, unit: str, every_s: float = 5.0) -> None:
        self.what, self.total, self.unit, self.every_s = what, total, unit, every_s
        self.done = 0.0
        self.start = self._last = time.perf_counter()

    def update(self, amount: float) -> None:
        self.done += amount
        now = time.perf_counter()
        if now - self._last >= self.every_s:
            self._last = now
            self.log()

    @property
    def rate(self) -> float:
        return self.done / max(time.perf_counter() - self.start, 1e-9)

    def log(self) -> None:
        rate = self.rate
        total = f"/{self.total:,.0f}" if self.total else ""
        eta = ""
        if self.total and rate > 0:
            eta = f", ETA {max(self.total - self.done, 0) / rate:,.0f}s"
        log.info("%s: %s%s %s, %s %s/s%s", self.what, f"{self.done:,.0f}", total, self.unit, f"{rate:,.0f}", self.unit, eta)
