"""What a step's exit code becomes in Airflow: one mapping for the three ways a step runs (a local
process, a pod, an Indexed Job's pods). The codes themselves are the steps' contract
(:mod:`tasks.contract`); docs/architecture.md tabulates both.

- 0: success.
- ``GATE_REJECTED_EXIT_CODE`` (99): a gate said no: the task is skipped, not failed (a pod's
  operator maps it by ``skip_on_exit_code``).
- ``BAD_INPUT_EXIT_CODE`` (2): bad input, which no retry fixes: the task fails for good.
- anything else: a failure Airflow may retry (an outage, a killed worker).
"""

from __future__ import annotations

from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSkipException

from tasks.contract import BAD_INPUT_EXIT_CODE, GATE_REJECTED_EXIT_CODE


def step_outcome(exit_code: int | None, error_line: str, what: str) -> AirflowException | None:
    """The exception a step that exited ``exit_code`` raises (None: it succeeded). ``error_line``:
    its one-line error, quoted first (alerts and the run report read it); ``what``: the step,
    or what the launcher saw of its end (the provider's message), for the rest of the message."""
    if exit_code == 0:
        return None
    if exit_code == GATE_REJECTED_EXIT_CODE:
        return AirflowSkipException(error_line or f"{what}: rejected by its gate")
    if exit_code == BAD_INPUT_EXIT_CODE:
        return AirflowFailException(f"{error_line or 'bad input'} (exit {BAD_INPUT_EXIT_CODE}, not retried): {what}")
    ended = f"{what} exited with {exit_code}" if exit_code is not None else what
    if error_line.startswith("ERROR "):  # the step's own line first: what people read of a failure
        return AirflowException(f"{error_line}: {ended}")
    return AirflowException(f"{ended}: {error_line}" if error_line else ended)
