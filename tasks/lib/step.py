"""What every step shares: the CLI skeleton, logging, progress lines and the result JSON.

A step is ``main(args) -> dict``; :func:`run_step` turns it into a process with the contract
the launcher relies on: exit 0 and a small JSON result, or exit 2 with one ``ERROR`` line
naming the bad input (exit 1 with a traceback for bugs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from tasks.lib.errors import GateRejected, StepError

log = logging.getLogger("tasks")

# Where KubernetesPodOperator's xcom sidecar picks the result up (do_xcom_push=True).
POD_RESULT_PATH = Path("/airflow/xcom/return.json")
BAD_INPUT_EXIT_CODE = 2
GATE_REJECTED_EXIT_CODE = 99  # KubernetesPodOperator skip_on_exit_code / LocalStepOperator: skip downstream


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
    if "STEP_RESULT_PATH" in os.environ:
        return Path(os.environ["STEP_RESULT_PATH"])
    return POD_RESULT_PATH if POD_RESULT_PATH.parent.is_dir() else None


def write_result(result: dict[str, Any]) -> None:
    """Hand the result to the orchestrator (XCom) and show it in the log."""
    text = json.dumps(result, sort_keys=True)
    log.info("result %s", text)
    path = result_path()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # ranks of one job may share the path
        tmp.write_text(text)
        tmp.replace(path)


def stop_torchrun_agent() -> None:
    """Under torchrun, a worker's exit code is lost (the agent restarts the group
    ``--max-restarts`` times, then exits 1): on bad input, which no restart can fix, the worker
    stops its agent instead (SIGTERM: it ends its workers and exits without restarting). The
    launcher reads the ``ERROR`` line, not the exit code, and fails the task without retries."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(os.getppid(), signal.SIGTERM)


def run_step(parser: argparse.ArgumentParser, main: Callable[[argparse.Namespace], dict[str, Any]]) -> NoReturn:
    configure_logging()
    args = parser.parse_args()
    try:
        result = main(args)
    except StepError as exc:
        # one line, so the orchestrator can show it as the reason the task failed
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"ERROR {parser.prog}: {first_line}", file=sys.stderr, flush=True)
        stop_torchrun_agent()
        sys.exit(BAD_INPUT_EXIT_CODE)
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
