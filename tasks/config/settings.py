"""The whole of ``params.yaml``: one field per section, and the checks that span sections."""

from __future__ import annotations

import dataclasses

from tasks.config.base import check
from tasks.config.canary import CanarySettings
from tasks.config.data import ReproSettings, SeedSettings, SnapshotSettings, TokenizeSettings, ValidateSettings
from tasks.config.drift import DriftSettings
from tasks.config.evaluation import EvaluateSettings
from tasks.config.pipeline import IngestSettings, LauncherSettings, PipelineSettings, StackSettings
from tasks.config.serving import ExportSettings, ServeSettings
from tasks.config.training import TrainSettings


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
        check(self.serve.kubernetes.kind in self.launcher.kubernetes.kinds, "serve.kubernetes.kind",
               self.serve.kubernetes.kind, "expected one of launcher.kubernetes.kinds")
        check(len(self.repro.shards) == self.tokenize.num_shards, "repro.shards", self.repro.shards,
               f"expected one per tokenize.num_shards ({self.tokenize.num_shards})")
        # a run still waiting for its approval when the deadline comes is failed by the scheduler,
        # its canary left held: the answer's timeout (a rollback) must come first
        check(self.canary.approval.timeout_s < 60 * self.pipeline.deadline_min, "canary.approval.timeout_s",
               self.canary.approval.timeout_s, f"expected under pipeline.deadline_min ({self.pipeline.deadline_min} min)")
