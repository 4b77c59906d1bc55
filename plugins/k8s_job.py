"""Multi-node training on Kubernetes: an Indexed Job of ``torchrun`` agents + a headless Service.

One pod per node (``completions = parallelism = nodes``, ``completionMode: Indexed``). Every pod
runs a ``torchrun`` agent (``python -m tasks.lib.torchrun``: torchrun that keeps the step
contract's exit codes) with ``--rdzv-backend=c10d --rdzv-endpoint=<service>:<port>``; the headless Service
selects the pod with completion index 0, so the rendezvous host is stable and resolvable before
the pods are ready (``publishNotReadyAddresses``). The operator creates the Service together
with the Job and deletes it when the task ends, whatever the outcome.

All-or-nothing start: the Job is created suspended with a Kueue queue label, so Kueue admits all
pods at once or none (a half-scheduled job would block in rendezvous); the operator waits for
the admission at a steady pace. The index-0 pod is told it hosts the rendezvous store
(``--rdzv-conf=is_host=...`` from ``JOB_COMPLETION_INDEX``); ``/dev/shm`` is memory-backed. ``backoffLimit: 0``: a
pod that fails fails the Job; torchrun restarts workers inside pods first, and the Airflow
retry resumes from the newest checkpoint. A pod that exits 2 (bad input) fails the Job through
its ``podFailurePolicy`` (condition reason ``PodFailurePolicy``), and the task without retries.

:class:`StepPodOperator` is the single-pod step: the provider's pod operator, except that a step
that exits 2 (bad input, the step contract) fails its task at once instead of being retried.

Imported only in ``kubernetes`` mode (see :func:`launcher.distributed_step`).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow.providers.cncf.kubernetes.operators.job import KubernetesJobOperator
from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSkipException
from cluster import JOB_LABEL
from kubernetes.client import models as k8s
from step_exit import step_outcome

from tasks.contract import (
    BAD_INPUT_EXIT_CODE,
    TORCHRUN_MODULE,
    Rendezvous,
    ended_without_error_line,
    record_error,
    torchrun_args,
)

if TYPE_CHECKING:
    from tasks.config import TrainingJob

ATTEMPT_OF_LABEL = "llm-pipeline/attempt-of"  # the task instance a Job is an attempt of (hashed)
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def attempt_of(context: Any) -> str | None:
    """A label value naming the task instance (DAG, task, run, map index) across its tries."""
    if not context or "ti" not in context:
        return None
    ti = context["ti"]
    key = f"{ti.dag_id}/{ti.task_id}/{context['run_id']}/{getattr(ti, 'map_index', -1)}"
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def terminated_state(remote_pod: k8s.V1Pod | None, container: str) -> k8s.V1ContainerStateTerminated | None:
    """How ``container`` ended, in the pod as last read from the API (None while it runs)."""
    statuses = (remote_pod.status.container_statuses if remote_pod and remote_pod.status else None) or []
    status = next((s for s in statuses if s.name == container), None)
    return status.state.terminated if status and status.state else None


def container_exit_code(remote_pod: k8s.V1Pod | None, container: str) -> int | None:
    """The exit code of ``container`` in the pod as last read from the API, if it terminated."""
    terminated = terminated_state(remote_pod, container)
    return int(terminated.exit_code) if terminated is not None else None


def termination_error_line(remote_pod: k8s.V1Pod | None, container: str) -> str | None:
    """The step's ERROR line from its termination message: with ``FallbackToLogsOnError`` the
    kubelet keeps the tail of a failed container's log there. A step that wrote none (killed,
    out of memory): how it ended and its last output line."""
    terminated = terminated_state(remote_pod, container)
    if terminated is None:
        return None
    lines = [line.strip() for line in (terminated.message or "").splitlines() if line.strip()]
    error = next((line for line in reversed(lines) if line.startswith("ERROR ")), None)
    return error or ended_without_error_line(terminated.exit_code, terminated.reason, lines[-1] if lines else "")


class StepPodOperator(KubernetesPodOperator):
    """A step's pod. The provider raises a retryable error for every failed pod; a step that
    exited 2 said its input is bad, which no retry fixes: that fails the task for good (as the
    local launcher does), after the provider has pushed XComs, logged events and cleaned up."""

    def cleanup(self, pod: k8s.V1Pod, remote_pod: k8s.V1Pod, xcom_result: dict[str, Any] | None = None,
                context: Any = None) -> None:
        try:
            super().cleanup(pod, remote_pod, xcom_result, context)
        except (AirflowSkipException, AirflowFailException):
            raise
        except AirflowException as exc:
            # the step's own line first: the alert and the run report quote it
            error_line = termination_error_line(remote_pod, self.base_container_name)
            record_error(context, error_line)
            exit_code = container_exit_code(remote_pod, self.base_container_name) or None  # (0: a sidecar failed)
            if exit_code != BAD_INPUT_EXIT_CODE and not error_line:
                raise
            raise step_outcome(exit_code, error_line or "", str(exc)) or exc from exc


def bad_input_fails_the_job(container: str) -> k8s.V1PodFailurePolicy:
    """A pod whose step exited 2 fails the Job with the reason ``PodFailurePolicy``, which the
    operator reads to fail its task without retries."""
    exit_2 = k8s.V1PodFailurePolicyOnExitCodesRequirement(
        container_name=container, operator="In", values=[BAD_INPUT_EXIT_CODE])
    return k8s.V1PodFailurePolicy(rules=[k8s.V1PodFailurePolicyRule(action="FailJob", on_exit_codes=exit_2)])


def failed_on_bad_input(job: k8s.V1Job | None) -> str | None:
    """The message of the Job's failure if its pod failure policy ended it (a step exited 2)."""
    conditions = (job.status.conditions if job is not None and job.status else None) or []
    return next((c.message or c.reason for c in conditions
                 if c.type == "Failed" and c.status == "True" and c.reason == "PodFailurePolicy"), None)


def rendezvous_service_name(job_name: str) -> str:
    return f"{job_name[:52].rstrip('-')}-rdzv"


class TorchrunJobOperator(KubernetesJobOperator):
    template_fields: Sequence[str] = (*KubernetesJobOperator.template_fields, "nodes")

    def __init__(
        self,
        *,
        module: str,
        nodes: int | str,
        procs_per_node: int,
        max_restarts: int,
        job: TrainingJob,
        **kwargs: Any,
    ) -> None:
        """``job``: launcher.kubernetes.training, the Job's queue, priority, rendezvous port,
        admission time, shared memory, polling, retention and deadline."""
        super().__init__(
            completion_mode="Indexed",
            # nodes may be a template (a trigger-form Param): set again once rendered
            completions=nodes if isinstance(nodes, int) else 1,
            parallelism=nodes if isinstance(nodes, int) else 1,
            backoff_limit=0,
            suspend=bool(job.queue_name),  # Kueue unsuspends when the whole gang fits
            wait_until_job_complete=True,
            job_poll_interval=job.poll_interval_s,
            ttl_seconds_after_finished=job.ttl_after_finished_s,
            active_deadline_seconds=job.active_deadline_s,
            **kwargs,
        )
        self.module, self.nodes, self.procs_per_node = module, nodes, procs_per_node
        self.max_restarts, self.rdzv_port = max_restarts, job.rdzv_port
        self.queue_name, self.priority_class = job.queue_name, job.priority_class
        self.admission_timeout_s, self.shm_size = float(job.admission_timeout_s), job.shm_size

    @property
    def node_count(self) -> int:
        return int(self.nodes)

    def torchrun_args(self, service: str) -> list[str]:
        return torchrun_args(nodes=self.node_count, procs_per_node=self.procs_per_node,
                             rendezvous=Rendezvous(f"{service}.{self.namespace}.svc:{self.rdzv_port}", service),
                             max_restarts=self.max_restarts, module=self.module, arguments=self.arguments or [])

    def build_job_request_obj(self, context: Any = None) -> k8s.V1Job:
        self.completions = self.parallelism = self.node_count  # rendered by now
        job = super().build_job_request_obj(context)
        name = job.metadata.name
        service = rendezvous_service_name(name)
        if self.queue_name:
            job.metadata.labels = {**(job.metadata.labels or {}), KUEUE_QUEUE_LABEL: self.queue_name}
        owner = attempt_of(context)
        if owner:
            job.metadata.labels = {**(job.metadata.labels or {}), ATTEMPT_OF_LABEL: owner}
        template = job.spec.template
        template.metadata.labels = {**(template.metadata.labels or {}), JOB_LABEL: name}
        spec = template.spec
        spec.subdomain = service
        spec.restart_policy = "Never"
        spec.priority_class_name = self.priority_class or None
        container = spec.containers[0]
        container.command = ["python", "-m", TORCHRUN_MODULE]  # is_host from JOB_COMPLETION_INDEX
        container.args = self.torchrun_args(service)
        job.spec.pod_failure_policy = bad_input_fails_the_job(container.name)
        container.ports = [k8s.V1ContainerPort(name="rdzv", container_port=self.rdzv_port)]
        # NCCL and the data loader's workers exchange tensors through /dev/shm: the runtime's
        # default 64 MiB breaks multi-GPU pods
        shm = k8s.V1Volume(name="dshm", empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory", size_limit=self.shm_size))
        spec.volumes = [*(spec.volumes or []), shm]
        container.volume_mounts = [*(container.volume_mounts or []), k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm")]
        return job

    def get_pods(self, pod_request_obj: k8s.V1Pod, context: Any, *, exclude_checked: bool = True) -> list[k8s.V1Pod]:
        """All of the Job's pods. Kueue keeps the Job suspended, without pods, until the whole
        gang fits: wait for them every ``job_poll_interval`` seconds up to
        ``admission_timeout_s`` (the provider's own lookup retries in a tight loop, then fails)."""
        selector = self._build_find_pod_label_selector(context, exclude_checked=exclude_checked)
        deadline = time.monotonic() + self.admission_timeout_s
        while True:
            pods = list(self.client.list_namespaced_pod(namespace=pod_request_obj.metadata.namespace,
                                                        label_selector=selector).items)
            if len(pods) >= self.node_count:
                break
            if time.monotonic() > deadline:
                raise AirflowException(f"job {selector}: {len(pods)} of {self.node_count} pods after "
                                       f"{self.admission_timeout_s:.0f}s: not admitted (Kueue queue {self.queue_name!r})")
            self.log.info("waiting for the job's %d pods (%d so far): suspended until Kueue admits the whole gang",
                          self.node_count, len(pods))
            time.sleep(self.job_poll_interval)
        for pod in pods:
            self.log_matching_pod(pod=pod, context=context)
        return pods

    def build_rendezvous_service(self, job: k8s.V1Job) -> k8s.V1Service:
        name = job.metadata.name
        return k8s.V1Service(
            api_version="v1",
            kind="Service",
            metadata=k8s.V1ObjectMeta(
                name=rendezvous_service_name(name),
                namespace=job.metadata.namespace,
                labels={JOB_LABEL: name, "app.kubernetes.io/part-of": "llm-pipeline"},
            ),
            spec=k8s.V1ServiceSpec(
                cluster_ip="None",
                publish_not_ready_addresses=True,
                selector={JOB_LABEL: name, COMPLETION_INDEX_LABEL: "0"},
                ports=[k8s.V1ServicePort(name="rdzv", port=self.rdzv_port, target_port=self.rdzv_port)],
            ),
        )

    def create_job(self, job_request_obj: k8s.V1Job) -> k8s.V1Job:
        service = self.build_rendezvous_service(job_request_obj)
        self.hook.core_v1_client.create_namespaced_service(namespace=service.metadata.namespace, body=service)
        self._service = service
        return super().create_job(job_request_obj)

    def delete_earlier_attempts(self, context: Any) -> list[str]:
        """A retry starts only once the Jobs of earlier tries of this task instance are gone: an
        attempt whose Airflow worker died may still be training, and both would write the same
        checkpoints and MLflow run. Deleted in the foreground (pods first), then waited for."""
        owner = attempt_of(context)
        if not owner:
            return []
        batch = self.hook.batch_v1_client
        selector = f"{ATTEMPT_OF_LABEL}={owner}"
        earlier = [j.metadata.name for j in batch.list_namespaced_job(self.namespace, label_selector=selector).items]
        for name in earlier:
            self.log.warning("deleting job %s, an earlier attempt of this task, before starting again", name)
            batch.delete_namespaced_job(name, self.namespace, propagation_policy="Foreground")
            with contextlib.suppress(Exception):
                self.hook.core_v1_client.delete_namespaced_service(rendezvous_service_name(name), self.namespace)
        deadline = time.monotonic() + self.admission_timeout_s
        while earlier and batch.list_namespaced_job(self.namespace, label_selector=selector).items:
            if time.monotonic() > deadline:
                raise AirflowException(f"earlier attempts {earlier} still exist after {self.admission_timeout_s:.0f}s")
            time.sleep(self.job_poll_interval)
        return earlier

    def execute(self, context: Any) -> Any:
        self.delete_earlier_attempts(context)
        try:
            result = super().execute(context)
        except AirflowException as exc:
            bad_input = failed_on_bad_input(getattr(self, "job", None))
            if bad_input:
                raise step_outcome(BAD_INPUT_EXIT_CODE, "", bad_input) or exc from exc
            raise
        finally:
            self._delete_service()
        # every pod reports the same (rank 0's) result: hand on one
        return result[0] if isinstance(result, list) and result else result

    def on_kill(self) -> None:
        try:
            super().on_kill()
        finally:
            self._delete_service()

    def _delete_service(self) -> None:
        service = getattr(self, "_service", None)
        if service is None:
            return
        from kubernetes.client.exceptions import ApiException

        try:
            self.hook.core_v1_client.delete_namespaced_service(
                name=service.metadata.name, namespace=service.metadata.namespace
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
        self._service = None
