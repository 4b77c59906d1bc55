"""Multi-node training on Kubernetes: an Indexed Job of ``torchrun`` agents + a headless Service.

One pod per node (``completions = parallelism = nodes``, ``completionMode: Indexed``). Every pod
runs ``torchrun --rdzv-backend=c10d --rdzv-endpoint=<service>:<port>``; the headless Service
selects the pod with completion index 0, so the rendezvous host is stable and resolvable before
the pods are ready (``publishNotReadyAddresses``). The operator creates the Service together
with the Job and deletes it when the task ends, whatever the outcome.

All-or-nothing start: the Job is created suspended with a Kueue queue label, so Kueue admits all
pods at once or none (a half-scheduled job would block in rendezvous). ``backoffLimit: 0``: a
pod that fails fails the Job; torchrun restarts workers inside pods first, and the Airflow
retry resumes from the newest checkpoint.

Imported only in ``kubernetes`` mode (see :func:`launcher.distributed_step`).
"""

from __future__ import annotations

from typing import Any

from airflow.providers.cncf.kubernetes.operators.job import KubernetesJobOperator
from kubernetes.client import models as k8s

JOB_LABEL = "llm-pipeline/job"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def rendezvous_service_name(job_name: str) -> str:
    return f"{job_name[:52].rstrip('-')}-rdzv"


class TorchrunJobOperator(KubernetesJobOperator):
    def __init__(
        self,
        *,
        module: str,
        nodes: int,
        procs_per_node: int,
        max_restarts: int,
        rdzv_port: int,
        queue_name: str,
        priority_class: str,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            completion_mode="Indexed",
            completions=nodes,
            parallelism=nodes,
            backoff_limit=0,
            suspend=bool(queue_name),  # Kueue unsuspends when the whole gang fits
            wait_until_job_complete=True,
            **kwargs,
        )
        self.module, self.nodes, self.procs_per_node = module, nodes, procs_per_node
        self.max_restarts, self.rdzv_port = max_restarts, rdzv_port
        self.queue_name, self.priority_class = queue_name, priority_class

    def torchrun_args(self, service: str) -> list[str]:
        return [
            f"--nnodes={self.nodes}",
            f"--nproc-per-node={self.procs_per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={service}.{self.namespace}.svc:{self.rdzv_port}",
            f"--rdzv-id={service}",
            f"--max-restarts={self.max_restarts}",
            "-m",
            self.module,
            *map(str, self.arguments or []),
        ]

    def build_job_request_obj(self, context: Any = None) -> k8s.V1Job:
        job = super().build_job_request_obj(context)
        name = job.metadata.name
        service = rendezvous_service_name(name)
        if self.queue_name:
            job.metadata.labels = {**(job.metadata.labels or {}), KUEUE_QUEUE_LABEL: self.queue_name}
        template = job.spec.template
        template.metadata.labels = {**(template.metadata.labels or {}), JOB_LABEL: name}
        spec = template.spec
        spec.subdomain = service
        spec.restart_policy = "Never"
        spec.priority_class_name = self.priority_class or None
        container = spec.containers[0]
        container.command = ["torchrun"]
        container.args = self.torchrun_args(service)
        container.ports = [k8s.V1ContainerPort(name="rdzv", container_port=self.rdzv_port)]
        return job

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

    def execute(self, context: Any) -> Any:
        try:
            result = super().execute(context)
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
