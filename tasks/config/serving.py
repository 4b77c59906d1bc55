"""The ``export`` section (ONNX / TensorRT files and their parity) and the ``serve`` section (Triton,
the generation engine, the router, cluster mode's objects, the served-traffic capture)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from tasks.config.base import at_least_zero, check, fractions, positive

# the first opset with the operators model.onnx and decoder.onnx are written with (tasks/lib/onnx_graphs.py):
# ReduceMean's axes as an input, Split's num_outputs
MIN_OPSET = 18

Backend = Literal["python", "onnxruntime_onnx", "tensorrt_plan"]


@dataclasses.dataclass(frozen=True)
class Range:
    min: int
    """Smallest."""
    opt: int
    """The size TensorRT tunes for."""
    max: int | None = None
    """Largest (seq: the model's seq_len)."""

    def __post_init__(self) -> None:
        check(0 < self.min <= self.opt and (self.max is None or self.opt <= self.max), "min", self.min,
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
    """ONNX opset of model.onnx and decoder.onnx (18 or later: the operators they are written with)."""
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
        positive(self, "opset", "parity_atol", "parity_windows", "parity_new_tokens")
        check(self.opset >= MIN_OPSET, "opset", self.opset, f"expected >= {MIN_OPSET} (the graphs' operators)")


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
    prefill_tokens: int = 256
    """Prompt tokens the engine prefills per step before the running sequences' next token: a
    longer prompt goes in chunks over several steps, and many arriving at once over several steps,
    instead of stalling every stream (vLLM's chunked prefill); 0: every admitted prompt whole. On
    a GPU 1024 gave 32 streams 3.1-3.4x the tokens of 8 on gpu-125m, 256 2.9x (docs/benchmarks.md)."""
    tensorrt: bool = False
    """On a GPU, run the engine's decoder on ONNX Runtime's TensorRT provider (FP16) where
    TensorRT's library loads; off: its CUDA provider in full float32. FP16 changes greedy text,
    which the canary compares token for token with the PyTorch reference."""
    cuda_graph: bool = True
    """On ONNX Runtime's CUDA provider, replay the engine's decode step as one CUDA graph (a second
    session of the decoder with fixed shapes: its weights twice in the GPU's memory) instead of
    launching its kernels one by one; no effect on a CPU."""

    def __post_init__(self) -> None:
        positive(self, "max_tokens", "request_timeout_s")
        at_least_zero(self, "max_queue", "prefill_tokens")


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
        positive(self, "rate_per_client", "connections_per_client", "client_timeout_s")
        at_least_zero(self, "burst")


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
        positive(self, "replicas", "rollout_timeout_s", "route_timeout_s", "lease_duration_s")


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
        fractions(self, "rate")
        positive(self, "flush_s", "max_pending", "max_pending_bytes", "max_field_chars")


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
    """The most sequences the engine decodes together (vLLM's max_num_seqs)."""
    kv_cache_mb: float
    """The engine's KV cache budget per loaded version (MiB): it gets as many slots as whole-context
    caches of its model fit, at most max_slots; a model whose one sequence does not fit is refused
    before it is deployed. Locally Triton holds stable and the canary at once: two such caches."""
    memory_budget_mb: float
    """What Triton's versions may take together (MiB): the ONNX files and KV caches of stable and
    the canary (locally; a pod's one version in a cluster), counted before a deploy loads anything;
    over it, the deploy is refused with one line. 0: not checked."""
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
        positive(self, "max_batch_size", "instances", "max_slots", "kv_cache_mb", "load_timeout_s")
        at_least_zero(self, "max_queue_delay_us", "intra_op_threads", "memory_budget_mb")
        for size in self.preferred_batch_sizes:
            check(0 < size <= self.max_batch_size, "preferred_batch_sizes", self.preferred_batch_sizes,
                   "expected sizes in 1..max_batch_size")

    @property
    def export_kind(self) -> str:
        """The node kind the export step runs on: a TensorRT plan is built on a GPU, for the GPU
        model that serves it (tensorrt_plan); the other backends' files are built anywhere."""
        return "gpu" if self.backend == "tensorrt_plan" else "cpu"
