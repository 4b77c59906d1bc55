"""The step contract: what a step process and whoever launches it agree on.

Standard library only: the steps (runtime image), the launcher and the Job builder (Airflow's
image, which holds this file but not the steps), the tests and the benchmarks import it.

A step runs as ``python -m tasks.<step> ARGS`` (a multi-process one under
``python -m tasks.lib.torchrun TORCHRUN_OPTIONS -m tasks.<step> ARGS``) and ends with one of
these exit codes:

====  ==========================================================================================
 0    done; its result (small JSON: :func:`to_json` of its :mod:`tasks.results` dataclass) is at
      ``STEP_RESULT_PATH`` or :data:`POD_RESULT_PATH`
 1    a bug or a lost dependency: a traceback; retried
 2    bad input (:data:`BAD_INPUT_EXIT_CODE`): one ``ERROR`` line naming the input; not retried
 99   a gate said no (:data:`GATE_REJECTED_EXIT_CODE`): downstream tasks are skipped, not failed
 143  stopped by SIGTERM (:data:`TERMINATED_EXIT_CODE`: evicted, the task killed); retried
====  ==========================================================================================
"""

from __future__ import annotations

import signal
import types
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, fields, is_dataclass
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

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
                  "deploy", "deploy_finish", "drift_recheck")

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


# -- a result as JSON ---------------------------------------------------------------------------
# A step's result is a frozen dataclass (tasks/results.py); these two functions are the only places
# one becomes JSON (the step's XCom, a report file) or is read back.

T = TypeVar("T")

# field metadata: how a None is written (where the JSON always left such keys out, or wrote {})
OMIT_IF_NONE: Mapping[str, Any] = {"omit_if_none": True}
EMPTY_IF_NONE: Mapping[str, Any] = {"empty_if_none": True}


def omit_unless(other: str) -> Mapping[str, Any]:
    """Left out of the JSON while field ``other`` is None (written, null or not, once it is set)."""
    return {"omit_unless": other}


def to_json(value: Any) -> Any:
    """A step's result (a frozen dataclass of :mod:`tasks.results`, nested ones included), a
    canary report, or lists and dicts of them, as JSON values: each field by its name, tuples as
    lists, enums as their values, a None left out where the field's metadata says so."""
    if is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {}
        for f in fields(value):
            item = getattr(value, f.name)
            if item is None and f.metadata.get("omit_if_none"):
                continue
            if "omit_unless" in f.metadata and getattr(value, f.metadata["omit_unless"]) is None:
                continue
            out[f.name] = {} if item is None and f.metadata.get("empty_if_none") else to_json(item)
        return out
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    return value


def from_json(kind: type[T], data: Any) -> T:
    """``data`` (JSON values, as :func:`to_json` wrote them) as a ``kind``; keys it does not know
    are ignored, fields it lacks take their defaults."""
    return _decode(kind, data)  # type: ignore[no-any-return]


def _decode(kind: Any, data: Any) -> Any:
    origin, args = get_origin(kind), get_args(kind)
    if origin in (Union, types.UnionType):
        if data is None:
            return None
        return _decode(next(a for a in args if a is not type(None)), data)
    if isinstance(kind, type) and is_dataclass(kind):
        hints = get_type_hints(kind)
        given = {}
        for f in fields(kind):
            if not f.init or f.name not in data:
                continue
            item = data[f.name]
            if item is None and (f.default is not MISSING or f.default_factory is not MISSING):
                continue  # (null where a default stands: a section written with every key, known or not)
            empty = f.metadata.get("empty_if_none") and item == {}
            given[f.name] = None if empty else _decode(hints[f.name], item)
        return kind(**given)
    if origin is tuple:
        return tuple(_decode(args[0], v) for v in data)
    if origin is list:
        return [_decode(args[0], v) for v in data]
    if origin is dict:
        return {k: _decode(args[1], v) for k, v in data.items()}
    if isinstance(kind, type) and issubclass(kind, Enum):
        return kind(data)
    return data
