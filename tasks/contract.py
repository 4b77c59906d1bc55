"""The step contract: what a step process and whoever launches it agree on.

Standard library only: the steps (runtime image), the launcher and the Job builder (Airflow's
image, which holds this file but not the steps), the tests and the benchmarks import it.

A step runs as ``python -m tasks.<step> ARGS`` (a multi-process one under
``python -m tasks.lib.torchrun TORCHRUN_OPTIONS -m tasks.<step> ARGS``) and ends with one of
these exit codes:

====  ==========================================================================================
 0    done; its result (small JSON) is at ``STEP_RESULT_PATH`` or :data:`POD_RESULT_PATH`
 1    a bug or a lost dependency: a traceback; retried
 2    bad input (:data:`BAD_INPUT_EXIT_CODE`): one ``ERROR`` line naming the input; not retried
 99   a gate said no (:data:`GATE_REJECTED_EXIT_CODE`): downstream tasks are skipped, not failed
 143  stopped by SIGTERM (:data:`TERMINATED_EXIT_CODE`: evicted, the task killed); retried
====  ==========================================================================================
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

BAD_INPUT_EXIT_CODE = 2
GATE_REJECTED_EXIT_CODE = 99  # KubernetesPodOperator skip_on_exit_code / LocalStepOperator: skip downstream
TERMINATED_EXIT_CODE = 128 + signal.SIGTERM  # as a shell reports a process SIGTERM ended: retried

# Where KubernetesPodOperator's xcom sidecar picks the result up (do_xcom_push=True).
POD_RESULT_PATH = Path("/airflow/xcom/return.json")
RESULT_PATH_ENV = "STEP_RESULT_PATH"  # a local launcher's choice of result file
# set by tasks.lib.torchrun for its workers: where a worker with bad input leaves its error line
BAD_INPUT_FILE_ENV = "STEP_BAD_INPUT_FILE"

# torchrun that keeps this contract's exit codes (torchrun itself turns a worker's 2 into 1)
TORCHRUN_MODULE = "tasks.lib.torchrun"

# XCom key of a failed step's one-line error (a failed task returns no result): the run report quotes it
ERROR_XCOM_KEY = "error"
# the replay DAG's id (a model line's: tasks.config.line_dag_id): tasks.replay show reads its
# comparisons below {artifact_root}/{this id}/
REPLAY_DAG = "llm_replay"
# the retrain DAG's tasks whose results the run report gathers (tasks.report's --result options)
REPORTED_STEPS = ("snapshot", "validate", "tokenizer", "tokenize_merge", "train", "evaluate", "register", "export",
                  "deploy", "deploy_finish")

# What a person can answer to a rollout held for approval (the DAG's human-in-the-loop task offers
# them; ``tasks.deploy finish`` carries the answer out). The first is what a timeout chooses.
ROLL_BACK, PROMOTE, EXTEND = "Roll back", "Promote", "Extend"
DECISIONS = (ROLL_BACK, PROMOTE, EXTEND)


class RolloutVerdict(StrEnum):
    """How a rollout ended (``tasks.deploy``'s result and report.json, the run report, the DAG)."""

    PROMOTED = "promoted"
    ROLLED_BACK = "rolled back"
    HELD = "held"  # waiting for a person's decision, its traffic where it is
    NOT_DEPLOYED = "not deployed"  # a gate said no (older data than the champion's)


# the field of deploy's result (its XCom) and report.json holding its RolloutVerdict: the DAG
# reads it by this name, and the report's dataclass is checked to have it when it is imported
ROLLOUT_VERDICT = "verdict"


@dataclass(frozen=True)
class Rendezvous:
    """Where a step's torchrun agents meet (c10d): the store's ``HOST:PORT`` and the run's id,
    fresh per attempt (a retry must not meet the agents of the failed one)."""

    endpoint: str
    id: str


def torchrun_args(*, nodes: int, procs_per_node: int, rendezvous: Rendezvous, max_restarts: int,
                  module: str, arguments: Sequence[Any]) -> list[str]:
    """A step's torchrun options, the same for a local agent, a Job's pod, a test and a
    benchmark; they follow ``python -m`` :data:`TORCHRUN_MODULE`."""
    return [
        f"--nnodes={nodes}",
        f"--nproc-per-node={procs_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rendezvous.endpoint}",
        f"--rdzv-id={rendezvous.id}",
        f"--max-restarts={max_restarts}",
        "-m",
        module,
        *map(str, arguments),
    ]


def ended_without_error_line(exit_code: int, reason: str | None, last_line: str) -> str:
    """What the report says of a step that failed without its ERROR line (killed, out of memory,
    a crash): its exit code, the kubelet's reason where there is one, its last output."""
    how = f"exit {exit_code}" + (f" ({reason})" if reason else "")
    return f"{how}; last output: {last_line[:300]}" if last_line else how


def record_error(context: Any, error_line: str | None) -> None:
    """Keep a failed step's one-line error as its :data:`ERROR_XCOM_KEY` XCom, for the run report
    (the task's last try keeps it: a retry starts with its XComs cleared)."""
    if error_line and context and "ti" in context:
        context["ti"].xcom_push(key=ERROR_XCOM_KEY, value=error_line.splitlines()[0][:500])
