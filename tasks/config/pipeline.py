"""The orchestration sections: the retraining DAG (``pipeline``), the ingest DAG (``ingest``), how
steps run (``launcher``: local processes or Kubernetes pods and Jobs) and the local stack (``stack``)."""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any, Literal

from tasks.config.base import SettingsError, at_least_zero, check, positive

LauncherMode = Literal["local", "kubernetes"]


@dataclasses.dataclass(frozen=True)
class Pool:
    slots: int
    """Tasks of the pool running at once."""
    description: str
    """Shown in Airflow's pool list."""

    def __post_init__(self) -> None:
        positive(self, "slots")


@dataclasses.dataclass(frozen=True)
class TaskSettings:
    timeout_min: float
    """The task's time limit: a hung step fails, and retries, instead of holding its pool."""
    pool: str | None = None
    """The Airflow pool it queues in (one of ``pipeline.pools``)."""
    priority: int | None = None
    """Its priority weight when pool slots are scarce."""

    def __post_init__(self) -> None:
        positive(self, "timeout_min")


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
        positive(self, "lookback_days", "deadline_min")
        at_least_zero(self, "retries", "retry_delay_s", "max_retry_delay_s")
        try:
            dt.date.fromisoformat(self.start_date)
        except ValueError:
            raise SettingsError(f"start_date {self.start_date!r}: expected a date, YYYY-MM-DD") from None
        for task_id, task in self.tasks.items():
            check(task.pool is None or task.pool in self.pools, f"tasks.{task_id}.pool", task.pool,
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
        check(0 <= self.max_bad_share <= 1, "max_bad_share", self.max_bad_share, "expected a share in [0, 1]")
        positive(self, "heldout_every")


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
        positive(self, "rdzv_port", "active_deadline_s", "admission_timeout_s", "poll_interval_s")


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
        check(self.namespace != self.airflow_namespace, "airflow_namespace", self.airflow_namespace,
               "must not be the steps' namespace (the workers could exec into Airflow's own pods)")
        check(set(self.images) <= set(self.kinds), "images", sorted(self.images), f"kinds are {', '.join(self.kinds)}")


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
            check(0 < port < 65536, f"ports.{name}", port, "expected a TCP port")
