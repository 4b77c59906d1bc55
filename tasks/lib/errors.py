"""The exceptions a step raises on purpose."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _typeshed import DataclassInstance


class StepError(Exception):
    """Bad input or a failed check: reported as one line naming the input, exit code 2."""


class GateRejected(Exception):
    """A quality gate said no: the step reports its result and exits 99, the orchestrator
    skips everything downstream (the run ends cleanly, nothing is deployed). ``result``: the
    step's result (:mod:`tasks.results`), written as a passing one is."""

    def __init__(self, message: str, result: DataclassInstance) -> None:
        super().__init__(message)
        self.result = result


class Terminated(BaseException):
    """SIGTERM (an evicted pod, a killed task), raised in the main thread once the step asked
    for it (:func:`tasks.lib.step.raise_on_sigterm`), so the step can put things back before it
    goes. A BaseException: an ``except Exception`` around a request does not swallow it."""


def first_line(exc: BaseException, limit: int = 200) -> str:
    """An exception's first line, bounded, for a one-line error (an empty message gives "")."""
    return (str(exc).splitlines() or [""])[0][:limit]


# -- the MLflow registry: absent is an answer, an outage is not --------------------------------


class RegistryError(RuntimeError):
    """The registry failed to answer (an outage, a 5xx): the task fails and is retried. Never
    read as "no such model": that would judge a challenger as the first model ever."""


def absent(exc: Any) -> bool:
    """Whether an MlflowException says the model, version or alias does not exist (and
    nothing else)."""
    code, message = getattr(exc, "error_code", ""), getattr(exc, "message", str(exc))
    return code == "RESOURCE_DOES_NOT_EXIST" or (code == "INVALID_PARAMETER_VALUE" and "not found" in message)


def registry_error(what: str, exc: Any) -> RegistryError:
    return RegistryError(f"MLflow registry: {what} failed ({getattr(exc, 'error_code', '')}): "
                         f"{str(getattr(exc, 'message', exc))[:300]}")
