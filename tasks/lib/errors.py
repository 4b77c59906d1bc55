"""The exceptions a step raises on purpose."""

from __future__ import annotations

from typing import Any


class StepError(Exception):
    """Bad input or a failed check: reported as one line naming the input, exit code 2."""


class GateRejected(Exception):
    """A quality gate said no: the step reports its result and exits 99, the orchestrator
    skips everything downstream (the run ends cleanly, nothing is deployed)."""

    def __init__(self, message: str, result: dict[str, Any]) -> None:
        super().__init__(message)
        self.result = result
