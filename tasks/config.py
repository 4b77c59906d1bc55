"""The settings of ``params.yaml``, typed: one frozen dataclass per section, read once.

``params.yaml`` holds the values (the one source of settings); these classes hold their types,
their allowed values and their checks, so a misspelt key, a string where a number belongs or an
engine that does not exist is refused once, when the file is read, naming the setting:

    >>> settings = load(section="train", overrides=["lr=0.001"])   # a step and its --set
    >>> settings.train.lr, settings.pipeline.model_name
    (0.001, 'llm-retrain')

Standard library only (PyYAML is imported by :func:`load`, which both images have): the DAGs
take their Params' choices from the same ``Literal`` types (:func:`choices`) without importing
a step. Each field's docstring is its documentation; docs/configuration.md's reference is
generated from them (``python -m tasks.config --markdown``), so it cannot drift. Torchtitan's
``JobConfig`` is the model followed.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import datetime as dt
import functools
import inspect
import itertools
import os
import sys
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

REPO_ROOT = Path(__file__).resolve().parents[1]

Engine = Literal["fsdp2", "ddp", "deepspeed", "single"]
Precision = Literal["auto", "bf16", "fp32"]
InitFrom = Literal["champion", "scratch"]
Switch = Union[bool, Literal["auto"]]  # noqa: UP007 (typing.get_type_hints needs a runtime object)
Backend = Literal["python", "onnxruntime_onnx", "tensorrt_plan"]
LauncherMode = Literal["local", "kubernetes"]


class SettingsError(ValueError):
    """A setting that cannot be used: the message names it (``train.lr``) and says why."""


def _check(ok: bool, name: str, value: Any, expectation: str) -> None:
    if not ok:
        raise SettingsError(f"{name} {value!r}: {expectation}")


def _positive(section: Any, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        _check(value > 0, name, value, "expected > 0")


def _at_least_zero(section: Any, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        _check(value >= 0, name, value, "expected >= 0")


def _fractions(section: Any, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        _check(0 <= value <= 1, name, value, "expected a fraction in [0, 1]")


# -- pipeline -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Pool:
    slots: int
    """Tasks of the pool running at once."""
    description: str
    """Shown in Airflow's pool list."""

    def __post_init__(self) -> None:
        _positive(self, "slots")


@dataclasses.dataclass(frozen=True)
class TaskSettings:
    timeout_min: float
    """The task's time limit: a hung step fails, and retries, instead of holding its pool."""
    pool: str | None = None
    """The Airflow pool it queues in (one of ``pipeline.pools``)."""
    priority: int | None = None
    """Its priority weight when pool slots are scarce."""

    def __post_init__(self) -> None:
        _positive(self, "timeout_min")


@dataclasses.dataclass(frozen=True)
class PipelineSettings:
    dag_id: str
    """The retraining DAG's id."""
    schedule: str
    """Its cron schedule; new raw data (the ``raw_data_asset`` Asset) also starts a run."""
    raw_data_asset: str
    """Name of the Airflow Asset the ingest DAG updates."""
    start_date: str
    """First data interval of the schedule (YYYY-MM-DD)."""
    artifact_root: str
    """Every step writes below ``{artifact_root}/{dag_id}/{run}/{step}``."""
    raw_data_uri: str
    """Raw JSON Lines records, partitioned as ``{raw_data_uri}/date=YYYY-MM-DD/``."""
    model_name: str
    """The MLflow registered model (aliases champion, challenger, previous)."""
    lookback_days: int
    """A run reads the daily partitions ``[end - lookback_days, end)``."""
    retries: int
    """Airflow retries of a failed task (bad input, exit 2, is never retried)."""
    retry_delay_s: float
    """First delay before a retry (exponential backoff)."""
    max_retry_delay_s: float
    """Longest delay between retries."""
    pools: dict[str, Pool]
    """Airflow pools, created before the scheduler starts."""
    tasks: dict[str, TaskSettings]
    """Per task id: time limit, pool, priority."""
    deadline_min: float
    """A run still going this long is failed by the scheduler (dagrun_timeout), with an alert."""

    def __post_init__(self) -> None:
        _positive(self, "lookback_days", "deadline_min")
        _at_least_zero(self, "retries", "retry_delay_s", "max_retry_delay_s")
        try:
            dt.date.fromisoformat(self.start_date)
        except ValueError:
            raise SettingsError(f"start_date {self.start_date!r}: expected a date, YYYY-MM-DD") from None
        for task_id, task in self.tasks.items():
            _check(task.pool is None or task.pool in self.pools, f"tasks.{task_id}.pool", task.pool,
                   f"expected one of pools ({', '.join(self.pools)})")


@dataclasses.dataclass(frozen=True)
class IngestSettings:
    dag_id: str
    """The ingest DAG's id."""
    schedule: str
    """When it lands the day's raw partition."""
    max_bad_share: float
    """``python -m tasks.ingest import``: a corpus with a larger share of bad rows (no text, wrong
    type, undecodable) fails with exit 2, nothing written; below it the bad rows are quarantined."""
    heldout_every: int
    """``import --heldout-output``: one text in this many, by its normalized text's hash, is held
    out of the partitions (with every duplicate of it) and written to the held-out file instead."""

    def __post_init__(self) -> None:
        _check(0 <= self.max_bad_share <= 1, "max_bad_share", self.max_bad_share, "expected a share in [0, 1]")
        _positive(self, "heldout_every")


# -- launcher -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RemoteLogs:
    base_uri: str
    """Where the cluster's Airflow writes task logs."""
    conn_id: str
    """The Airflow connection that reaches it."""
    conn_secret: str
    """The Kubernetes Secret holding that connection."""


@dataclasses.dataclass(frozen=True)
class TrainingJob:
    queue_name: str
    """Kueue LocalQueue: a multi-node Job is admitted whole or not at all."""
    cluster_queue: str
    """The administrator's Kueue ClusterQueue behind it."""
    priority_class: str
    """PriorityClass of training pods."""
    priority: int
    """Its value: above batch work, below serving."""
    rdzv_port: int
    """torchrun's c10d rendezvous port on the headless Service."""
    active_deadline_s: int
    """The Job's activeDeadlineSeconds."""
    admission_timeout_s: int
    """How long a Job may wait for Kueue to admit it."""
    poll_interval_s: int
    """Job status and admission checks."""
    shm_size: str
    """Memory-backed /dev/shm per pod (NCCL, data loader workers)."""
    ttl_after_finished_s: int
    """The Job's ttlSecondsAfterFinished."""

    def __post_init__(self) -> None:
        _positive(self, "rdzv_port", "active_deadline_s", "admission_timeout_s", "poll_interval_s")


@dataclasses.dataclass(frozen=True)
class PodKind:
    resources: dict[str, dict[str, str]]
    """The container's requests and limits (Kubernetes quantities)."""
    node_selector: dict[str, str]
    """Node labels the pod must land on."""
    tolerations: tuple[dict[str, Any], ...]
    """Taints it tolerates (Kubernetes tolerations)."""


@dataclasses.dataclass(frozen=True)
class KubernetesLauncher:
    namespace: str
    """The step pods, training Jobs and serving."""
    airflow_namespace: str
    """Airflow's own (the Helm release, worker pods): never the steps'."""
    service_account: str
    """Every step pod's but deploy's: no API token mounted."""
    deploy_service_account: str
    """The deploy and rollback pods' (the only steps calling the Kubernetes API)."""
    deploy_grace_s: int
    """How long a deploy pod has after SIGTERM to move traffic back to stable."""
    airflow_service_account: str
    """The Airflow workers' (they launch the pods)."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"]
    """Of every step container."""
    airflow_image: str
    """The orchestrator image, pinned by digest (``name:tag@sha256:...``)."""
    remote_logs: RemoteLogs
    """Where the cluster's task logs go."""
    images: dict[str, str]
    """One runtime image per step kind (cpu, gpu), pinned by digest."""
    env_from_secrets: tuple[str, ...]
    """Secrets whose keys become the steps' environment (AWS_*, MLFLOW_*...)."""
    run_as_user: int
    """The steps' user id."""
    on_finish_action: str
    """KubernetesPodOperator's on_finish_action."""
    startup_timeout_s: int
    """How long a step pod may take to start."""
    scratch_size: str
    """sizeLimit of a step pod's /tmp (an emptyDir)."""
    training: TrainingJob
    """Multi-node steps: Indexed Job + headless rendezvous Service."""
    kinds: dict[str, PodKind]
    """Resources, node selector and tolerations per step kind."""

    def __post_init__(self) -> None:
        _check(self.namespace != self.airflow_namespace, "airflow_namespace", self.airflow_namespace,
               "must not be the steps' namespace (the workers could exec into Airflow's own pods)")
        _check(set(self.images) <= set(self.kinds), "images", sorted(self.images), f"kinds are {', '.join(self.kinds)}")


@dataclasses.dataclass(frozen=True)
class LauncherSettings:
    mode: LauncherMode
    """local: each step is a process of the runtime venv; kubernetes: a pod (PIPELINE_LAUNCHER_MODE overrides)."""
    kubernetes: KubernetesLauncher
    """Cluster mode's objects."""


@dataclasses.dataclass(frozen=True)
class StackSettings:
    ports: dict[str, int]
    """The local stack's ports on 127.0.0.1, per server."""

    def __post_init__(self) -> None:
        for name, port in self.ports.items():
            _check(0 < port < 65536, f"ports.{name}", port, "expected a TCP port")


# -- data ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SeedSettings:
    output: str
    """Where the demo generator writes raw partitions."""
    end_date: str
    """Last partition written (YYYY-MM-DD)."""
    days: int
    """Partitions written, ending on end_date."""
    max_documents: int
    """Docstrings of the installed Python software taken."""
    heldout_every: int
    """One document in this many is held out of every partition (the evaluation text)."""
    heldout_output: str
    """Where the held-out text goes."""

    def __post_init__(self) -> None:
        _positive(self, "days", "max_documents", "heldout_every")


@dataclasses.dataclass(frozen=True)
class SnapshotSettings:
    max_record_bytes: int
    """A single raw record above this is rejected."""
    tag_prefix: str
    """Of the DVC registry's git tags (``data-...``)."""
    registry_dir: str
    """The DVC data registry's git repository (local)."""
    registry_remote: str
    """Its S3 remote."""
    registry_git_remote: str
    """A git URL to clone/push the registry (cluster mode); empty: local only."""

    def __post_init__(self) -> None:
        _positive(self, "max_record_bytes")


@dataclasses.dataclass(frozen=True)
class ValidateSettings:
    min_records: int
    """Fewest records a snapshot may hold."""
    max_records: int
    """Most records a snapshot may hold."""
    min_text_chars: int
    """Shortest text within bounds."""
    max_text_chars: int
    """Longest text within bounds."""
    text_length_mostly: float
    """Share of records that must be within the length bounds."""
    max_duplicate_ratio: float
    """Share of raw records that were exact duplicates."""
    max_broken_text_ratio: float
    """Share of records with U+FFFD or control characters (mojibake)."""
    max_email_ratio: float
    """Share of records containing an e-mail-like string (PII)."""
    partition_min_share: float
    """A day's records relative to an even share of the window, at least."""
    partition_max_share: float
    """... and at most."""
    partition_max_repeated_ratio: float
    """Share of a day's records repeating a text seen earlier in the window."""

    def __post_init__(self) -> None:
        _check(0 <= self.min_records <= self.max_records, "min_records", self.min_records, "expected 0 <= min <= max_records")
        _check(0 < self.min_text_chars <= self.max_text_chars, "min_text_chars", self.min_text_chars,
               "expected 0 < min <= max_text_chars")
        _fractions(self, "text_length_mostly", "max_duplicate_ratio", "max_broken_text_ratio", "max_email_ratio",
                   "partition_max_repeated_ratio")
        _check(0 <= self.partition_min_share <= self.partition_max_share, "partition_min_share",
               self.partition_min_share, "expected 0 <= min <= partition_max_share")


@dataclasses.dataclass(frozen=True)
class TokenizeSettings:
    num_shards: int
    """Parallel encode tasks (pods in a cluster, processes locally)."""
    vocab_size: int
    """Of a newly trained byte-level BPE (ids stored as uint16)."""
    val_fraction: float
    """Documents held out for validation, by document hash."""
    batch_bytes: int
    """Snapshot bytes per encode_batch call."""
    tokenizer_store: str
    """Content-addressed tokenizers: ``sha256-<hash>/tokenizer.json``."""
    base_store: str
    """Imported base checkpoints (train.base) as model folders: ``sha256-<identity>/``."""

    def __post_init__(self) -> None:
        _positive(self, "num_shards", "batch_bytes")
        _check(256 < self.vocab_size <= 65536, "vocab_size", self.vocab_size, "expected 257..65536 (uint16 ids)")
        _check(0 < self.val_fraction < 1, "val_fraction", self.val_fraction, "expected a fraction in (0, 1)")


@dataclasses.dataclass(frozen=True)
class ReproSettings:
    end_date: str
    """`make repro` (dvc repro) runs the data half for this interval end."""
    shards: tuple[str, ...]
    """One DVC encode stage per shard: ``f"{i:05d}"`` for each of tokenize.num_shards."""


# -- training -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Preset:
    seq_len: int
    """Context length in tokens."""
    d_model: int
    """Width of the residual stream."""
    n_layers: int
    """Transformer blocks."""
    n_heads: int
    """Attention heads (d_model / n_heads must be even: rotary embeddings)."""
    ffn_dim: int = 0
    """Hidden size of the SwiGLU MLP; 0: 8/3 d_model rounded up to a multiple of 32."""
    rope_theta: float = 10000.0
    """Rotary embeddings' base."""

    def __post_init__(self) -> None:
        _positive(self, "seq_len", "d_model", "n_layers", "n_heads")
        _check(self.d_model % self.n_heads == 0, "d_model", self.d_model, f"not divisible by n_heads {self.n_heads}")


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    preset: str
    """The model size: one of ``presets``."""
    engine: Engine
    """fsdp2 | ddp | deepspeed | single."""
    deepspeed_stage: Literal[2, 3]
    """ZeRO stage of the deepspeed engine."""
    nodes: int
    """torchrun nodes (local: processes on 127.0.0.1; cluster: Indexed Job pods)."""
    procs_per_node: int
    """Processes (GPUs) per node."""
    max_restarts: int
    """torchrun restarts of a failed worker group before the step fails."""
    precision: Precision
    """bf16 autocast or fp32; auto: bf16 on CUDA GPUs that have it."""
    micro_batch: int
    """Sequences per process per micro-step."""
    grad_accum: int
    """Micro-steps per optimizer step."""
    max_steps: int
    """Optimizer steps."""
    init_from: InitFrom
    """champion: continue from the production model when it has this run's architecture and vocabulary."""
    lr: float
    """Peak learning rate (AdamW), after warmup."""
    min_lr_ratio: float
    """The cosine decay ends at this share of lr."""
    warmup_steps: int
    """Linear warmup steps."""
    weight_decay: float
    """AdamW's, on matrices only."""
    betas: tuple[float, float]
    """AdamW's."""
    grad_clip: float
    """Largest gradient norm (clipped above)."""
    activation_checkpointing: bool
    """Recompute each block's activations in the backward (less memory, more compute)."""
    compile: Switch
    """torch.compile each block; auto: on GPUs, off on CPUs."""
    reshard_after_forward: Switch
    """FSDP2: free a block's gathered weights after its forward; auto: on GPUs but the last block, off on CPUs."""
    seed: int
    """Of the initialization and the data order."""
    log_every: int
    """Steps between logged metrics."""
    eval_every: int
    """Steps between validation losses."""
    eval_batches: int
    """Validation micro-batches per evaluation."""
    checkpoint_every: int
    """Steps between checkpoints."""
    keep_last: int
    """Checkpoints kept, plus the best by val_loss."""
    async_checkpoint: bool
    """Write checkpoints in the background (the loop waits only for a copy of the weights)."""
    experiment: str
    """The MLflow experiment of training runs."""
    presets: dict[str, Preset]
    """Model sizes by name."""
    base: str = ""
    """A Hugging Face checkpoint folder the line starts from: local, s3://, or a registered MLflow
    version (models:/NAME/VERSION or models:/NAME@ALIAS: a checkpoint folder logged as a run's
    artifacts); empty: a preset from scratch. (A default: the settings models recorded before it
    replay as they were.)"""

    def __post_init__(self) -> None:
        _check(self.preset in self.presets, "preset", self.preset, f"expected one of {', '.join(self.presets)}")
        _positive(self, "nodes", "procs_per_node", "micro_batch", "grad_accum", "max_steps", "log_every",
                  "eval_every", "eval_batches", "checkpoint_every", "keep_last")
        _at_least_zero(self, "lr", "max_restarts", "warmup_steps", "weight_decay", "grad_clip")  # lr 0: weights frozen
        _fractions(self, "min_lr_ratio")
        for beta in self.betas:
            _check(0 <= beta < 1, "betas", self.betas, "expected two numbers in [0, 1)")

    @property
    def model(self) -> Preset:
        """The chosen preset."""
        return self.presets[self.preset]


# -- evaluation, export, serving ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GateLimits:
    max_eval_perplexity: float
    """The highest ``max_eval_perplexity`` a run may set (its Param's maximum)."""
    min_eval_accuracy: float
    """The lowest ``min_eval_accuracy`` a run may set (its Param's minimum)."""
    max_regression: float
    """The largest ``max_regression`` a run may set (its Param's maximum)."""


@dataclasses.dataclass(frozen=True)
class TaskGate:
    metric: str
    """The lm-eval metric judged, as its results name it: ``acc``, or ``exact_match,first_word`` (metric,filter)."""
    min: float = 0.0
    """Lowest score accepted."""


@dataclasses.dataclass(frozen=True)
class SuiteSettings:
    tasks_dir: str
    """A folder of lm-eval task YAML whose data files are named relative to it (relative: to the repository); empty: no suite."""
    tasks: dict[str, TaskGate]
    """The tasks run, by lm-eval task name, each with its metric and lowest score."""
    max_drop: float
    """The challenger fails a task when its paired bootstrap interval of (challenger - champion) lies wholly below -max_drop."""
    confidence: float
    """Of that interval."""
    bootstrap_samples: int
    """Resamples of the examples."""
    limit: int
    """Examples per task (0: all of them)."""
    batch_size: int
    """lm-eval's batch size."""

    def __post_init__(self) -> None:
        _positive(self, "bootstrap_samples", "batch_size")
        _at_least_zero(self, "max_drop", "limit")
        _check(0.5 <= self.confidence < 1, "confidence", self.confidence, "expected a level in [0.5, 1)")
        _check(not self.tasks_dir or bool(self.tasks), "tasks", self.tasks, "expected at least one task (or no tasks_dir)")

    @property
    def folder(self) -> Path | None:
        if not self.tasks_dir:
            return None
        path = Path(self.tasks_dir)
        return path if path.is_absolute() else REPO_ROOT / path


@dataclasses.dataclass(frozen=True)
class EvaluateSettings:
    eval_set_uri: str
    """The fixed evaluation text (held out by the seed, written once)."""
    max_eval_tokens: int
    """Per stream, in windows of the model's seq_len."""
    batch: int
    """Windows per forward."""
    max_eval_perplexity: float
    """Gate: highest perplexity accepted."""
    min_eval_accuracy: float
    """Gate: lowest next-token accuracy accepted."""
    max_regression: float
    """Gate: largest relative perplexity increase over the champion."""
    limits: GateLimits
    """The loosest gate a run may ask for: its Params (and the step's ``--set``) may tighten the gate, never loosen it past these."""
    sample_tokens: int
    """Greedy tokens generated per prompt for the report."""
    prompts: tuple[str, ...]
    """The report's and export's reference prompts."""
    suite: SuiteSettings
    """Task suites run by lm-evaluation-harness on each model's Hugging Face form."""

    def __post_init__(self) -> None:
        _positive(self, "max_eval_tokens", "batch", "max_eval_perplexity", "sample_tokens")
        _fractions(self, "min_eval_accuracy")
        _at_least_zero(self, "max_regression")
        _check(bool(self.prompts), "prompts", self.prompts, "expected at least one prompt")
        # the bounds a run sets (the DAG's Params) are checked here, in the step, as well as by the
        # trigger form: a run created before the limits were tightened is refused too
        limits = self.limits
        for name, looser in (("max_eval_perplexity", self.max_eval_perplexity > limits.max_eval_perplexity),
                             ("min_eval_accuracy", self.min_eval_accuracy < limits.min_eval_accuracy),
                             ("max_regression", self.max_regression > limits.max_regression)):
            _check(not looser, name, getattr(self, name), f"looser than limits.{name} ({getattr(limits, name):g}): "
                   "a run may tighten the gate, never loosen it")


@dataclasses.dataclass(frozen=True)
class Range:
    min: int
    """Smallest."""
    opt: int
    """The size TensorRT tunes for."""
    max: int | None = None
    """Largest (seq: the model's seq_len)."""

    def __post_init__(self) -> None:
        _check(0 < self.min <= self.opt and (self.max is None or self.opt <= self.max), "min", self.min,
               "expected 0 < min <= opt <= max")


@dataclasses.dataclass(frozen=True)
class TensorRT:
    fp16: bool
    """Build an FP16 engine."""
    workspace_gb: float
    """Builder workspace."""
    batch: Range
    """Optimization profile over the batch."""
    seq: Range
    """... and the sequence length."""


@dataclasses.dataclass(frozen=True)
class ExportSettings:
    opset: int
    """ONNX opset."""
    parity_atol: float
    """Largest |logit difference| ONNX Runtime vs PyTorch."""
    parity_windows: int
    """Held-out windows checked besides the prompts."""
    parity_new_tokens: int
    """Greedy tokens per prompt the engine must generate as PyTorch does."""
    tensorrt: TensorRT
    """An engine built from the ONNX file where the step runs on a GPU with the tensorrt package (the
    DAG runs the export on the gpu kind for serve.backend tensorrt_plan; no lock holds tensorrt)."""

    def __post_init__(self) -> None:
        _positive(self, "opset", "parity_atol", "parity_windows", "parity_new_tokens")


@dataclasses.dataclass(frozen=True)
class Queue:
    max_size: int
    """Logits requests waiting for a batch; beyond: 503."""
    timeout_ms: int
    """Longest wait in the queue; beyond: 503."""


@dataclasses.dataclass(frozen=True)
class Generate:
    max_tokens: int
    """Default max_tokens of a request that names none (within the context left)."""
    max_queue: int
    """Requests waiting for a slot; beyond: "overloaded" (HTTP 429)."""
    request_timeout_s: float
    """How long a request may hold its slot."""
    tensorrt: bool = False
    """On a GPU, run the engine's decoder on ONNX Runtime's TensorRT provider (FP16) where
    TensorRT's library loads; off: its CUDA provider in full float32. FP16 changes greedy text,
    which the canary compares token for token with the PyTorch reference."""

    def __post_init__(self) -> None:
        _positive(self, "max_tokens", "request_timeout_s")
        _at_least_zero(self, "max_queue")


@dataclasses.dataclass(frozen=True)
class Router:
    rate_per_client: int
    """Requests a second per client address on the public listener."""
    burst: int
    """Requests above the rate answered at once."""
    connections_per_client: int
    """Open connections per client address."""
    client_timeout_s: int
    """A client must send its request head and body within this (nginx: whole seconds)."""

    def __post_init__(self) -> None:
        _positive(self, "rate_per_client", "connections_per_client", "client_timeout_s")
        _at_least_zero(self, "burst")


@dataclasses.dataclass(frozen=True)
class Gateway:
    name: str
    """The Gateway API Gateway."""
    namespace: str
    """Its namespace."""
    listener: str
    """The public listener clients call."""
    internal_listener: str
    """The in-cluster listener of deploy's track-header requests (ROUTER_INTERNAL_URL)."""


@dataclasses.dataclass(frozen=True)
class Network:
    gateway_proxy_namespace: str
    """Where the gateway's proxies run (allowed to reach Triton)."""
    metrics_namespace: str
    """Where Prometheus runs (allowed the metrics port)."""


@dataclasses.dataclass(frozen=True)
class ServeKubernetes:
    name: str
    """A Deployment and a Service per track: NAME-stable, NAME-canary, NAME-baseline."""
    image: str
    """The serving image (tritonserver + tokenizers), pinned by digest."""
    kind: str
    """Resources, node selector, tolerations: one of launcher.kubernetes.kinds."""
    config_variant: str
    """One of the export's configs (onnxruntime_onnx.gpu, tensorrt_plan.gpu...)."""
    replicas: int
    """Of the stable track; the canary track runs 1 during a rollout."""
    fresh_baseline: bool
    """A baseline track of the stable version at the canary's size, started with the canary, is what each step compares it with."""
    capture_secret: str
    """The Secret whose keys (AWS_*) the OpenAI front sidecar writes its served-traffic capture with."""
    ports: dict[str, int]
    """The pods' http, grpc, metrics and openai ports."""
    shm_size: str
    """/dev/shm of the pods (the python backend's stubs)."""
    model_repository_size: str
    """sizeLimit of a pod's model repository."""
    priority_class: str
    """The Triton pods' PriorityClass, above training's."""
    priority: int
    """Its value."""
    max_unavailable: int
    """The stable track's PodDisruptionBudget."""
    route: str
    """The HTTPRoute splitting traffic between the tracks."""
    gateway: Gateway
    """The Gateway's listeners."""
    network: Network
    """Who may open a connection to a Triton pod."""
    hostname: str
    """Clients' host name for the model."""
    rollout_timeout_s: float
    """A track's Deployment rolled out within this."""
    route_timeout_s: float
    """A weight change accepted by the gateway within this."""
    lease_duration_s: float
    """The deploy lock (a Lease); a dead holder's is free after it."""

    def __post_init__(self) -> None:
        _positive(self, "replicas", "rollout_timeout_s", "route_timeout_s", "lease_duration_s")


@dataclasses.dataclass(frozen=True)
class Capture:
    rate: float
    """Share of the OpenAI API's answered requests logged (prompt, answer, version, latency, tokens); 0: none."""
    uri: str
    """Where: date partitions ``{uri}/date=YYYY-MM-DD/part-*.jsonl``."""
    flush_s: float
    """Records are written at most this long after their request."""
    max_pending: int
    """Records waiting to be written; beyond, new ones are dropped (counted), never waited for ..."""
    max_pending_bytes: int
    """... and their text, in bytes: a few huge prompts cannot fill the memory either."""
    max_field_chars: int
    """A captured prompt, answer or error longer than this is cut to it, with a marker saying how much was cut."""

    def __post_init__(self) -> None:
        _fractions(self, "rate")
        _positive(self, "flush_s", "max_pending", "max_pending_bytes", "max_field_chars")


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    triton_model: str
    """The logits model: input_ids -> next-token logits + greedy next token."""
    generate_model: str
    """The generation engine: text in, text out or streamed."""
    backend: Backend
    """Of the logits model: python (ONNX Runtime in Triton's python backend), onnxruntime_onnx, tensorrt_plan."""
    max_batch_size: int
    """Logits requests batched together."""
    preferred_batch_sizes: tuple[int, ...]
    """Triton's dynamic batcher's preferred sizes."""
    max_queue_delay_us: int
    """How long the batcher waits to fill a batch."""
    queue: Queue
    """The logits model's queue bounds."""
    instances: int
    """Model instances."""
    intra_op_threads: int
    """ONNX Runtime threads per CPU instance; 0: every core."""
    max_slots: int
    """Sequences the engine decodes together (KV cache preallocated for each)."""
    generate: Generate
    """The engine's request limits."""
    load_timeout_s: float
    """A model version loaded within this."""
    router: Router
    """The local router's per-client limits."""
    kubernetes: ServeKubernetes
    """Cluster mode: the objects plugins/serving.py renders and deploy patches."""
    capture: Capture
    """A sample of served requests and answers, PII scrubbed, for the drift check."""

    def __post_init__(self) -> None:
        _positive(self, "max_batch_size", "instances", "max_slots", "load_timeout_s")
        _at_least_zero(self, "max_queue_delay_us", "intra_op_threads")
        for size in self.preferred_batch_sizes:
            _check(0 < size <= self.max_batch_size, "preferred_batch_sizes", self.preferred_batch_sizes,
                   "expected sizes in 1..max_batch_size")

    @property
    def export_kind(self) -> str:
        """The node kind the export step runs on: a TensorRT plan is built on a GPU, for the GPU
        model that serves it (tensorrt_plan); the other backends' files are built anywhere."""
        return "gpu" if self.backend == "tensorrt_plan" else "cpu"


@dataclasses.dataclass(frozen=True)
class Approval:
    enabled: bool
    """A person approves the rollout before it goes on: the default of the retrain DAG's approval Param (an Airflow HITL task)."""
    required: bool
    """This deployment requires the approval: a run cannot switch it off (its Param is refused, and a false one reaching deploy is overridden)."""
    approvers: tuple[str, ...]
    """Airflow user ids who may answer (the HITL task's assigned users; the simple auth manager's ids are user names); empty: anyone who may edit the DAG."""
    four_eyes: bool
    """The user who triggered the run may not answer its approval: Airflow refuses them when they are among the approvers, and the task refuses an answer of theirs."""
    hold_before: int | float
    """The rollout holds before the step of this weight (one of steps), at the weight before it (0: after shadow)."""
    timeout_s: float
    """No answer by then: rolled back."""

    def __post_init__(self) -> None:
        _positive(self, "hold_before", "timeout_s")
        _check(all(name.strip() == name and name for name in self.approvers) and
               len(set(self.approvers)) == len(self.approvers), "approvers", list(self.approvers),
               "expected distinct Airflow user ids, none empty")

    @property
    def active(self) -> bool:
        """Whether a rollout holds for a person: the run asked for it, or this deployment requires it."""
        return self.enabled or self.required


@dataclasses.dataclass(frozen=True)
class CanarySettings:
    shadow: bool
    """Before any weighted step, mirror live /v1 requests to the new version and compare its answers with stable's."""
    shadow_min_stable_agreement: float
    """Share of greedy answers the new version must give exactly as stable does in shadow (0: reported only)."""
    steps: tuple[int | float, ...]
    """Traffic share (%) of the new version at each step (0.1 steps: the routes are per mille); 100 ends the rollout."""
    step_duration_s: float
    """Real traffic through the router at each step ..."""
    rate_rps: float
    """... at this rate (logits requests, prompts from the eval text)."""
    concurrency: int
    """Requests in flight at once."""
    request_timeout_s: float
    """Of one logits request."""
    max_error_rate: float
    """Of the canary's requests."""
    min_agreement: float
    """Canary next tokens equal to the export's parity reference."""
    latency_alpha: float
    """Mann-Whitney U, one-sided: is the canary slower than stable?"""
    max_latency_ratio: float
    """... and its median latency at least this times stable's."""
    min_samples: int
    """Canary requests per step: the window repeats until it has them ..."""
    max_windows: int
    """... at most this many times, else the step fails."""
    text_rps: float
    """Streams a second on the text endpoint (/v1/completions, greedy)."""
    text_min_samples: int
    """Canary streams per step."""
    text_timeout_s: float
    """Of one stream."""
    min_text_agreement: float
    """Canary completions equal to the reference text."""
    text_max_latency_ratio: float
    """TTFT and inter-token latency: the Mann-Whitney rule with this ratio."""
    warmup_streams: int
    """Streams straight to the new version before the first step (discarded)."""
    clearly_slower_factor: float
    """Slower by more than a check's ratio times this fails at once; by less, the verdict is inconclusive."""
    max_analyses: int
    """Analyses of a step, each on fresh traffic, while its verdict is inconclusive; then it fails."""
    deploy_older_data: bool
    """Deploy a model whose data window ends before the champion's (else: a gate, exit 99)."""
    approval: Approval
    """A person in the loop: whether a run may go without one, who may answer, where the rollout holds and how long it waits."""

    def __post_init__(self) -> None:
        _check(bool(self.steps) and self.steps[-1] == 100 and all(0 < s <= 100 for s in self.steps)
               and list(self.steps) == sorted(set(self.steps)), "steps", self.steps,
               "expected rising percentages ending at 100")
        _check(not self.approval.active or self.approval.hold_before in self.steps, "approval.hold_before",
               self.approval.hold_before, f"expected one of steps {list(self.steps)}")
        _positive(self, "step_duration_s", "rate_rps", "concurrency", "request_timeout_s", "max_latency_ratio",
                  "min_samples", "max_windows", "text_rps", "text_min_samples", "text_timeout_s",
                  "text_max_latency_ratio", "max_analyses")
        _check(self.clearly_slower_factor >= 1, "clearly_slower_factor", self.clearly_slower_factor,
               "expected at least 1 (1: no inconclusive latency band)")
        _fractions(self, "max_error_rate", "min_agreement", "latency_alpha", "min_text_agreement",
                   "shadow_min_stable_agreement")
        _at_least_zero(self, "warmup_streams")


@dataclasses.dataclass(frozen=True)
class DriftSettings:
    dag_id: str
    """The drift check's DAG."""
    schedule: str
    """Its cron (it also runs on each closed capture partition's Asset event)."""
    served_asset: str
    """The Airflow Asset of the captured traffic (its URI: serve.capture.uri)."""
    window_h: float
    """The captured requests of this many hours before the check are compared."""
    min_prompts: int
    """Fewer captured prompts in the window: no verdict (too little traffic to judge), nothing started."""
    max_prompts: int
    """At most this many prompts are read (a random sample of the window's, seeded)."""
    reference_tokens: int
    """Tokens of the champion's validation split the window is compared with."""
    null_samples: int
    """Samples of the reference as large as the window's, to know how far a sample of the same size strays by chance."""
    max_js_excess: float
    """Token distribution: Jensen-Shannon divergence (bits) above what samples of the reference reach by chance."""
    max_byte_fallback_excess: float
    """Share of byte-fallback tokens (non-ASCII bytes the vocabulary never merged) above the reference's."""
    max_perplexity_ratio: float
    """The champion's perplexity on the prompts over its perplexity on reference text of the same lengths."""
    max_prompt_tokens: int
    """A prompt counts with at most this many tokens: a handful of huge prompts cannot make the token distribution."""
    min_clients: int
    """Drift must be seen in the prompts of at least this many distinct clients (hashed addresses) for a verdict."""
    cooldown_h: float
    """After drift started a retrain, no other for the same champion for this long."""
    state_uri: str
    """Where the last retrain the drift check started is recorded."""

    def __post_init__(self) -> None:
        _positive(self, "window_h", "min_prompts", "max_prompts", "reference_tokens", "null_samples",
                  "max_perplexity_ratio", "max_prompt_tokens", "min_clients")
        _at_least_zero(self, "max_js_excess", "cooldown_h")
        _fractions(self, "max_byte_fallback_excess")


@dataclasses.dataclass(frozen=True)
class Settings:
    """The whole of params.yaml."""

    pipeline: PipelineSettings
    """The retraining DAG: schedule, storage layout, retries, pools, time limits."""
    ingest: IngestSettings
    """The ingest DAG."""
    launcher: LauncherSettings
    """How steps run: local processes or Kubernetes pods and Jobs."""
    stack: StackSettings
    """The local stack's servers."""
    seed: SeedSettings
    """The demo raw-data generator (tasks.seed)."""
    snapshot: SnapshotSettings
    """Versioning a window of raw data in the DVC registry (tasks.snapshot)."""
    validate: ValidateSettings
    """Data checks (tasks.validate, Great Expectations)."""
    tokenize: TokenizeSettings
    """Tokenizer training and sharded encoding (tasks.tokenize)."""
    repro: ReproSettings
    """`make repro` (dvc repro) of the data half."""
    train: TrainSettings
    """Training (tasks.train)."""
    evaluate: EvaluateSettings
    """Evaluation and its gate (tasks.evaluate)."""
    export: ExportSettings
    """ONNX / TensorRT export and parity (tasks.export)."""
    serve: ServeSettings
    """Triton, the generation engine and the router."""
    canary: CanarySettings
    """The canary rollout and its analysis (tasks.deploy)."""
    drift: DriftSettings
    """The drift check of served traffic against the champion's training data (tasks.drift)."""

    def __post_init__(self) -> None:
        _check(self.serve.kubernetes.kind in self.launcher.kubernetes.kinds, "serve.kubernetes.kind",
               self.serve.kubernetes.kind, "expected one of launcher.kubernetes.kinds")
        _check(len(self.repro.shards) == self.tokenize.num_shards, "repro.shards", self.repro.shards,
               f"expected one per tokenize.num_shards ({self.tokenize.num_shards})")
        # a run still waiting for its approval when the deadline comes is failed by the scheduler,
        # its canary left held: the answer's timeout (a rollback) must come first
        _check(self.canary.approval.timeout_s < 60 * self.pipeline.deadline_min, "canary.approval.timeout_s",
               self.canary.approval.timeout_s, f"expected under pipeline.deadline_min ({self.pipeline.deadline_min} min)")


# -- building the dataclasses from YAML ---------------------------------------------------------

T = TypeVar("T")


def build(cls: type[T], values: Mapping[str, Any], where: str = "") -> T:
    """``cls`` from a mapping: every key known, every value of its field's type, the class's
    checks passed; else :class:`SettingsError` naming the setting (``where.key``)."""
    if not isinstance(values, Mapping):
        raise SettingsError(f"{where or cls.__name__}: expected a section (a mapping), got {values!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    prefix = f"{where}." if where else ""
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise SettingsError(f"{prefix}{unknown[0]}: unknown setting (known: {', '.join(fields)})")
    hints = get_type_hints(cls)
    kwargs = {}
    for name, field in fields.items():
        if name in values:
            kwargs[name] = _coerce(hints[name], values[name], f"{prefix}{name}")
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise SettingsError(f"{prefix}{name}: missing")
    try:
        return cls(**kwargs)
    except SettingsError as exc:  # a check of the class: it names the setting
        raise SettingsError(f"{prefix}{exc}") from None
    except ValueError as exc:  # anything else a check met
        raise SettingsError(f"{where or cls.__name__}: {exc}") from None


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return build(tp, value, where)  # type: ignore[arg-type]
    if origin is Literal:
        # True == 1: a bool is only ever a bool
        if any(value == arg and type(value) is type(arg) for arg in args):
            return value
        raise SettingsError(f"{where} {value!r}: expected one of {', '.join(map(str, args))}")
    if origin in (Union, types.UnionType):
        for arm in args:
            try:
                return _coerce(arm, value, where)
            except SettingsError:
                continue
        raise SettingsError(f"{where} {value!r}: expected {describe(tp)}")
    if tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            with contextlib.suppress(ValueError):
                return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, dt.date):  # an unquoted date in YAML or --set end_date=2026-11-25
            return value.isoformat()
    elif origin is tuple and isinstance(value, list | tuple):
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], item, f"{where}[{i}]") for i, item in enumerate(value))
        if len(value) == len(args):
            return tuple(_coerce(arm, item, f"{where}[{i}]") for i, (arm, item) in enumerate(zip(args, value, strict=True)))
    elif origin is dict and isinstance(value, Mapping):
        return {str(key): _coerce(args[1], item, f"{where}.{key}") for key, item in value.items()}
    elif origin is None or origin not in (tuple, dict):
        raise TypeError(f"{where}: unsupported setting type {tp!r}")
    raise SettingsError(f"{where} {value!r}: expected {describe(tp)}")


def describe(tp: Any, bar: str = " | ") -> str:
    """A type as an error message (or, ``bar`` escaped, the configuration reference) writes it."""
    origin, args = get_origin(tp), get_args(tp)
    if dataclasses.is_dataclass(tp):
        return "section"
    if origin is Literal:
        return bar.join(str(arg).lower() if isinstance(arg, bool) else str(arg) for arg in args)
    if origin in (Union, types.UnionType):
        return bar.join(describe(arm, bar) for arm in args)
    if origin is tuple:
        return f"list of {describe(args[0], bar)}" if len(args) == 2 and args[1] is Ellipsis else \
            f"[{', '.join(describe(arm, bar) for arm in args)}]"
    if origin is dict:
        return f"mapping of {describe(args[1], bar)}"
    return {type(None): "null", bool: f"true{bar}false", int: "integer", float: "number", str: "string"}.get(tp, "any")


def choices(cls: type, name: str) -> list[Any]:
    """A field's allowed values (its ``Literal``'s), e.g. for a DAG Param's ``enum``."""
    tp = get_type_hints(cls)[name]
    if get_origin(tp) is not Literal:
        raise TypeError(f"{cls.__name__}.{name} is not a Literal")
    return list(get_args(tp))


# -- reading params.yaml ------------------------------------------------------------------------


def params_path() -> Path:
    return Path(os.environ.get("PIPELINE_PARAMS", REPO_ROOT / "params.yaml"))


def read_yaml(path: Path) -> dict[str, Any]:
    import yaml  # both images have PyYAML; libyaml's loader: 5 ms instead of 37 for params.yaml

    try:
        loaded = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except FileNotFoundError:
        raise SettingsError(f"{path}: params file not found") from None
    except yaml.YAMLError as exc:
        raise SettingsError(f"{path}: invalid YAML ({' '.join(str(exc).split())})") from None
    if not isinstance(loaded, dict):
        raise SettingsError(f"{path}: expected a mapping at the top level")
    return loaded


def apply_overrides(section: Mapping[str, Any], overrides: Sequence[str], where: str = "") -> dict[str, Any]:
    """Apply ``key=value`` / ``a.b=value`` overrides; values parse as YAML (``3``, ``true``)."""
    import yaml

    merged = copy.deepcopy(dict(section))
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SettingsError(f"--set {item!r}: expected KEY=VALUE")
        *parents, leaf = key.split(".")
        node = merged
        for name in parents:
            child = node.get(name)
            if not isinstance(child, dict):
                raise SettingsError(f"--set {item!r}: {where}{'.' if where else ''}{name} is not a section")
            node = child
        if leaf not in node:
            raise SettingsError(f"--set {item!r}: unknown setting {where}{'.' if where else ''}{key}")
        node[leaf] = yaml.safe_load(raw)
    return merged


def load(path: Path | None = None, section: str | None = None, overrides: Sequence[str] = ()) -> Settings:
    """params.yaml as :class:`Settings`, with a step's ``--set`` overrides applied to its
    ``section``. Cached: a process reads and checks the file once."""
    return _load(path or params_path(), section, tuple(overrides))


@functools.lru_cache(maxsize=16)
def _load(path: Path, section: str | None, overrides: tuple[str, ...]) -> Settings:
    raw = read_yaml(path)
    if section is not None:
        if section not in raw:
            raise SettingsError(f"{path}: no {section!r} section")
        raw = {**raw, section: apply_overrides(raw[section], overrides, section)}
    try:
        return build(Settings, raw)
    except SettingsError as exc:
        raise SettingsError(f"{path}: {exc}") from None


# -- the configuration reference (docs/configuration.md) ----------------------------------------


MD_BAR = " \\| "  # a | inside a Markdown table cell


def _field_docs(cls: Any) -> dict[str, str]:
    """Each field's docstring: the string literal under it (as Sphinx reads attribute docs)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in itertools.pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr) \
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    text = "" if value is None else str(value)
    return text if len(text) <= 48 else text[:45] + "..."


def _rows(cls: Any, values: Any, prefix: str) -> list[str]:
    rows = []
    docs, hints = _field_docs(cls), get_type_hints(cls)
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        tp, value, name = hints[field.name], getattr(values, field.name), f"{prefix}{field.name}"
        if dataclasses.is_dataclass(tp):
            rows.append(f"| `{name}` | section | | {docs.get(field.name, '')} |")
            rows += _rows(tp, value, f"{name}.")
        elif get_origin(tp) is dict and dataclasses.is_dataclass(get_args(tp)[1]):
            # one set of rows for the entries' fields; the entries are named, their values are in params.yaml
            rows.append(f"| `{name}` | {describe(tp, MD_BAR)} | {', '.join(value)} | {docs.get(field.name, '')} |")
            item_cls = get_args(tp)[1]
            item_docs, item_hints = _field_docs(item_cls), get_type_hints(item_cls)
            rows += [f"| `{name}.<name>.{item.name}` | {describe(item_hints[item.name], MD_BAR)} | | {item_docs.get(item.name, '')} |"
                     for item in dataclasses.fields(item_cls)]
        else:
            shown = _value(value) if not isinstance(value, dict) else ", ".join(f"{k}: {_value(v)}" for k, v in value.items())
            rows.append(f"| `{name}` | {describe(tp, MD_BAR)} | `{shown}` | {docs.get(field.name, '')} |" if shown
                        else f"| `{name}` | {describe(tp, MD_BAR)} | | {docs.get(field.name, '')} |")
    return rows


def reference(settings: Settings) -> str:
    """The configuration reference: per section, each setting's type, value and meaning."""
    docs = _field_docs(Settings)
    out = []
    for field in dataclasses.fields(Settings):
        section_cls = get_type_hints(Settings)[field.name]
        out += [f"### `{field.name}`", "", docs.get(field.name, ""), "",
                "| setting | type | params.yaml | meaning |", "|---|---|---|---|",
                *_rows(section_cls, getattr(settings, field.name), f"{field.name}."), ""]
    return "\n".join(out)


REFERENCE_START = "<!-- reference: generated from tasks/config.py by `make config-docs`; edit the dataclasses, not this -->"
REFERENCE_END = "<!-- end of the generated reference -->"


def with_reference(page: str, settings: Settings) -> str:
    """``page`` (docs/configuration.md) with its generated reference brought up to date."""
    head, start, rest = page.partition(REFERENCE_START)
    _, end, tail = rest.partition(REFERENCE_END)
    if not start or not end:
        raise SettingsError(f"the page has no {REFERENCE_START!r} ... {REFERENCE_END!r} block")
    return f"{head}{start}\n\n{reference(settings)}\n{end}{tail}"


def main(argv: Sequence[str]) -> int:
    """``python -m tasks.config``: check params.yaml (exit 2 and one line if a setting cannot be
    used); ``--markdown``: print the reference; ``--update-docs PAGE``: rewrite PAGE's reference."""
    if list(argv) == ["--markdown"]:
        print(reference(load()), end="")
        return 0
    if len(argv) == 2 and argv[0] == "--update-docs":
        page = Path(argv[1])
        page.write_text(with_reference(page.read_text(), load()))
        return 0
    try:
        load()
    except SettingsError as exc:
        print(f"ERROR {exc}", file=sys.stderr)
        return 2
    print(f"{params_path()}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
