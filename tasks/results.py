"""What each step returns: its result (the XCom the DAGs read) as a frozen dataclass.

Standard library only: the steps build these, :func:`tasks.lib.step.run_step` writes them as JSON
(:func:`tasks.contract.to_json`: the field names are the keys, a None marked ``OMIT_IF_NONE`` is
left out), and the DAGs' ``launcher.result(task, *keys)`` checks the path it reads against
:data:`STEP_RESULTS` when the DAG is parsed (Airflow's image holds this file): a renamed field fails
the DAG's import, not a run.

A step with sub-commands has a result per sub-command (``"tasks.tokenize prepare"``). Deploy's
(``canary``, ``finish``) is :class:`tasks.serving.canary.RolloutSummary`, beside the canary report
it sums up. A ``dict`` field is a mapping by name whose names are data (splits, figures, days),
never a record's fields.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Union, get_args, get_origin, get_type_hints

from tasks.contract import EMPTY_IF_NONE, OMIT_IF_NONE, omit_unless
from tasks.serving.canary import RolloutSummary

# -- data ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SeedResult:
    """``tasks.seed``: the raw partitions of a window (written: documents written now, 0 when all
    existed; drifted: how many of them in the drifted domain, ``--drifted-share``)."""

    output_uri: str
    days: tuple[str, ...]
    heldout_uri: str
    written: int
    drifted: int = 0


@dataclass(frozen=True)
class IngestResult:
    """``tasks.ingest import``: a corpus landed as raw partitions, what was refused, where it went."""

    source: str
    format: str
    to: str
    key: str
    rows: int
    imported: int
    bad: int
    bad_reasons: dict[str, int]
    heldout: int
    heldout_uri: str | None
    quarantine_uri: str | None
    days: dict[str, int]  # records by day (ISO date)
    days_added: tuple[str, ...]
    days_already_there: tuple[str, ...]
    seconds: float
    peak_rss_mb: float


@dataclass(frozen=True)
class DataVersionResult:
    """The DVC data version a snapshot is (``new``: False when the tag existed with this content)."""

    tag: str
    content_hash: str
    records: int
    bytes: int
    commit: str
    new: bool


@dataclass(frozen=True)
class SnapshotResult:
    """``tasks.snapshot``: the deduplicated snapshot, its stats and its data version."""

    snapshot_uri: str
    stats_uri: str
    data_version: DataVersionResult
    duplicates_removed: int
    traffic_records: int = 0  # captured prompts trained on (snapshot.learn_from_traffic)


@dataclass(frozen=True)
class ValidateResult:
    """``tasks.validate``: the expectations passed (a failure is the step's error, not a result)."""

    success: bool
    report_uri: str
    summary_uri: str
    evaluated: int
    records: int


@dataclass(frozen=True)
class BaseRecord:
    """An imported base checkpoint, as every model of its line records it."""

    uri: str
    identity: str


@dataclass(frozen=True)
class TokenizerResult:
    """``tasks.tokenize prepare``: the run's tokenizer (trained, the champion's or a base's) and
    what training starts from (``init_model_uri``: the base, else the champion; "" for none)."""

    tokenizer_uri: str
    tokenizer_hash: str
    tokenizer_source: str
    champion_model_uri: str
    init_model_uri: str
    base: BaseRecord | None
    vocab_size: int
    dtype: str


@dataclass(frozen=True)
class ShardResult:
    """``tasks.tokenize encode``: one shard (records ``[start, end)`` of the snapshot)."""

    shard_uri: str
    shard_index: int
    num_shards: int
    records: tuple[int, int]
    tokens: int
    seconds: float
    tokens_per_s: int


@dataclass(frozen=True)
class DatasetResult:
    """``tasks.tokenize merge``: the tokenized dataset; tokens and documents by split."""

    dataset_uri: str
    index_uri: str
    tokens: dict[str, int]
    documents: dict[str, int]
    dtype: str
    tokenizer_hash: str
    tokens_per_s: int
    tokens_per_s_per_worker: tuple[int, ...]


# -- the model ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainResult:
    """``tasks.train``: the model (``model_file`` and ``mlflow_run_id``: rank 0's, which every rank
    reports), its losses and the run's figures (throughput, MFU, the shares of the loop's time)."""

    model_uri: str
    final_loss: float | None
    val_loss: float | None
    steps: int
    tokens_seen: int
    tokens_per_s: float
    mfu: float
    peak_flops: float
    peak_source: str
    data_loading_share: float
    eval_share: float
    checkpoint_share: float
    checkpoint_stall_s: float
    checkpoint_stalls_s: tuple[float, ...]
    checkpoint_save_s: float
    checkpoints: tuple[str, ...]
    resumed_from: str | None
    initialized_from: str | None
    world_size: int
    engine: str
    precision: str
    malloc: str
    model_file: str | None = field(default=None, metadata=OMIT_IF_NONE)
    mlflow_run_id: str | None = field(default=None, metadata=omit_unless("model_file"))


@dataclass(frozen=True)
class ModelFigures:
    """A model measured by the evaluation: on the held-out text (``eval_``), on the dataset's val
    split (``val_``: absent for a champion of another vocabulary); a champion's registry version."""

    eval_loss: float
    eval_perplexity: float
    eval_accuracy: float
    eval_tokens: float
    eval_bits_per_byte: float
    tokenizer_hash: str
    val_loss: float | None = field(default=None, metadata=OMIT_IF_NONE)
    val_perplexity: float | None = field(default=None, metadata=OMIT_IF_NONE)
    val_accuracy: float | None = field(default=None, metadata=OMIT_IF_NONE)
    val_tokens: float | None = field(default=None, metadata=OMIT_IF_NONE)
    registry_version: str | None = field(default=None, metadata=OMIT_IF_NONE)


@dataclass(frozen=True)
class PairedDifferenceFigures:
    """The challenger's task score minus the champion's: the mean and its bootstrap interval."""

    mean: float
    low: float
    high: float
    examples: int


@dataclass(frozen=True)
class TaskFigures:
    """One task of the evaluation suite (``champion``, ``difference``: None without a champion)."""

    metric: str
    min: float
    challenger: float
    examples: int
    champion: float | None
    difference: PairedDifferenceFigures | None


@dataclass(frozen=True)
class GateBounds:
    max_eval_perplexity: float
    min_eval_accuracy: float
    max_regression: float


@dataclass(frozen=True)
class DriftedFigures:
    """A drift-started run's models on the prompts of the drift check it answers (captured
    traffic, which no retrain trains on: all of it held out): each prompt's bits per byte after
    its first token, the mean over the distinct prompts (comparable across tokenizers)."""

    drift_report: str
    prompts: int
    challenger_bits_per_byte: float
    champion_bits_per_byte: float | None = field(default=None, metadata=OMIT_IF_NONE)


@dataclass(frozen=True)
class EvaluateResult:
    """``tasks.evaluate``: the gate's verdict and reasons, both models' figures (its report.json,
    less the two URIs); the result of a rejection too (exit 99)."""

    passed: bool
    reasons: tuple[str, ...]
    model_uri: str
    eval_set_uri: str
    eval_set_sha256: str
    challenger: ModelFigures
    champion: ModelFigures | None
    tasks: dict[str, TaskFigures] | None  # by task name; None: no suite configured
    gate: GateBounds
    drifted: DriftedFigures | None = field(default=None, metadata=OMIT_IF_NONE)  # a run the drift check started
    report_uri: str | None = field(default=None, metadata=OMIT_IF_NONE)
    samples_uri: str | None = field(default=None, metadata=OMIT_IF_NONE)


@dataclass(frozen=True)
class RegisterResult:
    """``tasks.register``: the registered version (``new``: False when this run's was found, reused:
    then no ``run_id``) and the version the challenger alias points at."""

    model_name: str
    version: str
    challenger: str
    new: bool
    model_uri: str
    run_id: str | None = field(default=None, metadata=OMIT_IF_NONE)


@dataclass(frozen=True)
class DecoderParity:
    max_abs_logit_diff: float
    windows: int
    greedy_tokens_compared: int


@dataclass(frozen=True)
class HfCheckpointParity:
    """The Hugging Face form, checked against transformers; or why there is none (``skipped``)."""

    skipped: str | None = field(default=None, metadata=OMIT_IF_NONE)
    max_abs_logit_diff: float | None = field(default=None, metadata=OMIT_IF_NONE)
    inputs: int | None = field(default=None, metadata=OMIT_IF_NONE)
    architecture: str | None = field(default=None, metadata=OMIT_IF_NONE)


@dataclass(frozen=True)
class ExportParity:
    """The ONNX model against PyTorch (logits, greedy next tokens), the decoder's and the HF form's."""

    max_abs_logit_diff: float
    tolerance: float
    inputs: int
    sequences: int
    decoder: DecoderParity
    hf_checkpoint: HfCheckpointParity


@dataclass(frozen=True)
class ExportResult:
    """``tasks.export`` (kept as export.json in its output: a repeated export returns it)."""

    model_name: str
    version: str
    export_uri: str
    opset: int
    onnx_sha256: str
    onnx_bytes: int
    backend: str
    tensorrt: str  # "built: fp16", "skipped: no GPU", ...
    parity: ExportParity


# -- deploy's other sub-commands (canary and finish: RolloutSummary) ----------------------------


@dataclass(frozen=True)
class ReleaseResult:
    """``tasks.deploy release``: the version rolled back (None: nothing was left held)."""

    released: int | None
    stable: int | None = field(default=None, metadata=omit_unless("released"))


@dataclass(frozen=True)
class RollbackResult:
    """``tasks.deploy rollback``: the version serving all traffic now, those it replaced."""

    serving: int
    replaced: tuple[int, ...]
    aliases: dict[str, str | None]  # alias -> version
    export_uri: str


@dataclass(frozen=True)
class StageResult:
    """``tasks.deploy stage``: one exported version copied into a Triton model repository."""

    staged: int
    repository: str
    config_variant: str


# -- reports, replays, the drift check ----------------------------------------------------------


@dataclass(frozen=True)
class ReportResult:
    """``tasks.report write``: the run's verdict and its report (``mlflow_run``: its URL, or None)."""

    verdict: str
    outcome: str
    report_uri: str
    summary_uri: str
    mlflow_run: str | None


@dataclass(frozen=True)
class ReportShown:
    """``tasks.report show``."""

    report_uri: str
    verdict: str


@dataclass(frozen=True)
class ReplayPlan:
    """``tasks.replay plan``: what version ``model_version`` was trained from and how."""

    model_version: str
    data_version: str
    tokenizer_uri: str
    val_fraction: float
    init_from: str
    settings_uri: str
    nodes: int
    procs_per_node: int


@dataclass(frozen=True)
class ReplayComparison:
    """``tasks.replay compare`` (identical: a difference is the step's error)."""

    model_version: str
    identical: bool
    tensors: int
    differences: tuple[str, ...]
    report_uri: str


@dataclass(frozen=True)
class ReplayShown:
    """``tasks.replay show``."""

    report_uri: str
    identical: bool


@dataclass(frozen=True)
class DriftWindow:
    start: str  # ISO date-times
    end: str
    hours: float


@dataclass(frozen=True)
class TopClient:
    client: str
    prompts: int
    share_of_prompts: float
    share_of_drift: float


@dataclass(frozen=True)
class DriftClients:
    """Who drove a verdict: the distinct clients; once a bound was crossed, whether it still is
    without the prompts of fewer than ``min_clients`` of them (``driven_by``: how many it took
    otherwise) and the clients by share of the drift."""

    distinct: int
    min_clients: int
    seen_from_enough: bool | None = field(default=None, metadata=OMIT_IF_NONE)
    driven_by: int | None = field(default=None, metadata=omit_unless("seen_from_enough"))
    top: tuple[TopClient, ...] | None = field(default=None, metadata=OMIT_IF_NONE)


@dataclass(frozen=True)
class DriftCheck:
    """``tasks.drift check``: the verdict (drift, too few clients, no drift, no verdict), whether a
    retrain is requested, and the window's figures by name. ``clients``: None (written ``{}``)
    when there was no verdict."""

    verdict: str
    heading: str
    outcome: str
    request_retrain: bool
    window: DriftWindow
    reasons: tuple[str, ...]
    clients: DriftClients | None = field(metadata=EMPTY_IF_NONE)
    champion: str | None
    report_uri: str
    figures: dict[str, float]


@dataclass(frozen=True)
class DriftClosed:
    """``tasks.drift close``: a day's capture partition marked complete (0 records: rejected)."""

    partition: str
    parts: int
    records: int


@dataclass(frozen=True)
class LoopBound:
    """One bound of the drift check, on the same window before and after the retrain the drift
    started: the figure it judges, its value with each champion, the bound, and, while it is still
    crossed, why the retrain could not bring it back."""

    bound: str
    figure: str
    before: float
    after: float
    limit: float
    crossed_before: bool
    crossed_after: bool
    why: str = ""


@dataclass(frozen=True)
class DriftRecheck:
    """``tasks.drift recheck``: the drift check that started a retrain, run again on the same
    window once the retrain promoted its version: whether the loop closed (every bound held), and
    each bound before and after (empty, ``closed`` None: not started by the drift check, or no
    version promoted; exit 99)."""

    closed: bool | None
    heading: str
    started_by: str
    champion_before: str | None = None
    champion_after: str | None = None
    bounds: tuple[LoopBound, ...] = ()
    report_uri: str | None = None


@dataclass(frozen=True)
class DriftShown:
    """``tasks.drift show``."""

    verdict: str
    request_retrain: bool


# The result of each step, by module (and sub-command, where it has several).
STEP_RESULTS: dict[str, type] = {
    "tasks.seed": SeedResult,
    "tasks.ingest import": IngestResult,
    "tasks.snapshot": SnapshotResult,
    "tasks.validate": ValidateResult,
    "tasks.tokenize prepare": TokenizerResult,
    "tasks.tokenize encode": ShardResult,
    "tasks.tokenize merge": DatasetResult,
    "tasks.train": TrainResult,
    "tasks.evaluate": EvaluateResult,
    "tasks.register": RegisterResult,
    "tasks.export": ExportResult,
    "tasks.deploy canary": RolloutSummary,
    "tasks.deploy finish": RolloutSummary,
    "tasks.deploy release": ReleaseResult,
    "tasks.deploy rollback": RollbackResult,
    "tasks.deploy stage": StageResult,
    "tasks.report write": ReportResult,
    "tasks.report show": ReportShown,
    "tasks.replay plan": ReplayPlan,
    "tasks.replay compare": ReplayComparison,
    "tasks.replay show": ReplayShown,
    "tasks.drift check": DriftCheck,
    "tasks.drift close": DriftClosed,
    "tasks.drift show": DriftShown,
    "tasks.drift recheck": DriftRecheck,
}


def step_result_type(module: str, arguments: Sequence[Any]) -> type:
    """The result type of ``python -m MODULE ARGUMENTS`` (the sub-command: the first argument
    after the step's ``--set`` options); ValueError when the step is not known or its sub-command
    cannot be told."""
    if module in STEP_RESULTS:
        return STEP_RESULTS[module]
    commands = sorted(key.split(" ", 1)[1] for key in STEP_RESULTS if key.startswith(f"{module} "))
    if not commands:
        raise ValueError(f"{module} is not a step with a result (tasks.results.STEP_RESULTS)")
    command = sub_command(arguments)
    if command not in commands:
        raise ValueError(f"{module}: its sub-command, the first argument after --set options, is {command!r} here, "
                         f"not one of {', '.join(commands)}")
    return STEP_RESULTS[f"{module} {command}"]


def sub_command(arguments: Sequence[Any]) -> Any:
    """The first argument that is not a ``--set KEY=VALUE`` (the only option before a
    sub-command: ``tasks.lib.step.step_parser``'s); None when there is none."""
    rest = list(arguments)
    while rest and (rest[0] == "--set" or str(rest[0]).startswith("--set=")):
        rest = rest[2:] if rest[0] == "--set" else rest[1:]
    return rest[0] if rest else None


def check_path(kind: type, keys: tuple[str, ...]) -> None:
    """That ``keys`` name a field of ``kind``, then of that field's type, and so on (a ``dict``
    field takes any key); ValueError naming the key and the fields there are."""
    current: Any = kind
    for depth, key in enumerate(keys):
        current = _without_none(current)
        where = "".join(f"['{k}']" for k in keys[:depth]) or "the result"
        if get_origin(current) is dict:
            current = get_args(current)[1]
            continue
        if not (isinstance(current, type) and is_dataclass(current)):
            raise ValueError(f"{where} is a {getattr(current, '__name__', current)}: it has no field {key!r}")
        names = [f.name for f in fields(current)]
        if key not in names:
            raise ValueError(f"{where} ({current.__name__}) has no field {key!r}; its fields: {', '.join(names)}")
        current = get_type_hints(current)[key]


def _without_none(kind: Any) -> Any:
    if get_origin(kind) in (Union, types.UnionType):
        kinds = [k for k in get_args(kind) if k is not type(None)]
        return kinds[0] if len(kinds) == 1 else kind
    return kind
