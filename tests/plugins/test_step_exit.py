"""One mapping of a step's exit to Airflow, for local processes, pods and Indexed Jobs alike."""

from __future__ import annotations

import pytest
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSkipException
from step_exit import step_outcome

LINE = "ERROR python -m tasks.validate: s3://raw/x: no records"


@pytest.mark.parametrize(("code", "kind"), [(2, AirflowFailException), (99, AirflowSkipException),
                                            (1, AirflowException), (137, AirflowException), (None, AirflowException)])
def test_each_exit_code_is_one_outcome_whoever_ran_the_step(code: int | None, kind: type[Exception]) -> None:
    outcome = step_outcome(code, LINE, "tasks.validate")
    assert type(outcome) is kind and str(outcome).startswith(LINE), outcome  # the step's own line first


def test_success_is_no_exception_and_a_crash_without_its_line_names_the_step() -> None:
    assert step_outcome(0, "", "tasks.seed") is None
    assert str(step_outcome(1, "ValueError: bad date", "tasks.seed")) == "tasks.seed exited with 1: ValueError: bad date"
