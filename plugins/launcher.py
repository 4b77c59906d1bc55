"""The one place that knows how a step runs.

:func:`step` turns ``python -m tasks.<module> ARGS`` into an Airflow operator:

- ``kubernetes`` mode: a :class:`KubernetesPodOperator` running the step's image (one per step
  kind: ``cpu`` / ``gpu``) with the namespace, service account, resources, GPU requests, node
  selector, tolerations, Secrets-as-env and non-root security context from params.yaml. The
  step writes its result to ``/airflow/xcom/return.json``; the xcom sidecar returns it.
- ``local`` mode (embedded default): a :class:`LocalStepOperator` running the *same argv with
  the same env* as a process of the runtime venv, its log streamed into the task log and its
  result JSON returned as the task's XCom.

The mode comes from configuration (``PIPELINE_LAUNCHER_MODE`` or params.yaml ``launcher.mode``),
never from the DAG file. Multi-node steps (training) get a ``KubernetesJobOperator`` (an Indexed
Job) from the training issue's builder beside this one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from pipeline_params import REPO_ROOT, pipeline_params

# Exit codes of the step contract (tasks/lib/step.py)
BAD_INPUT_EXIT_CODE = 2

# Run-scoped storage key of the DAG run: run ids hold ':' and '+', which S3 clients mangle.
RUN_KEY = "{{ run_id | replace(':', '-') | replace('+', '_') }}"


def launcher_mode() -> str:
    mode = os.environ.get("PIPELINE_LAUNCHER_MODE") or pipeline_params()["launcher"]["mode"]
    if mode not in ("local", "kubernetes"):
        raise ValueError(f"launcher mode {mode!r}: expected 'local' or 'kubernetes'")
    return str(mode)


def run_output_uri(step_name: str) -> str:
    """Templated output URI of a step for the current DAG run."""
    pipeline = pipeline_params()["pipeline"]
    return f"{pipeline['artifact_root']}/{{{{ dag.dag_id }}}}/{RUN_KEY}/{step_name}"


def runtime_python() -> str:
    return os.environ.get("PIPELINE_RUNTIME_PYTHON", str(REPO_ROOT / ".venvs" / "runtime" / "bin" / "python"))


class LocalStepOperator(BaseOperator):
    """Runs ``python -m MODULE ARGS`` in the runtime venv as a local process."""

    template_fields: Sequence[str] = ("arguments", "env_vars")
    ui_color = "#e8f4e8"

    def __init__(
        self,
        *,
        module: str,
        arguments: list[str] | None = None,
        env_vars: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.module = module
        self.arguments = arguments or []
        self.env_vars = env_vars or {}
        self._proc: subprocess.Popen[str] | None = None

    def argv(self) -> list[str]:
        return [runtime_python(), "-m", self.module, *map(str, self.arguments)]

    def execute(self, context: Any) -> Any:
        with tempfile.TemporaryDirectory(prefix="step-result-") as scratch:
            result_path = Path(scratch) / "return.json"
            env = {**os.environ, **self.env_vars, "STEP_RESULT_PATH": str(result_path)}
            self.log.info("running %s", " ".join(self.argv()))
            returncode, error_line = self._run(env)
            if returncode == BAD_INPUT_EXIT_CODE:
                # bad input does not get better by retrying
                raise AirflowFailException(error_line or f"{self.module}: bad input (exit {returncode})")
            if returncode != 0:
                raise AirflowException(f"{self.module} exited with {returncode}: {error_line}")
            return json.loads(result_path.read_text()) if result_path.exists() else None

    def _run(self, env: dict[str, str]) -> tuple[int, str]:
        """Stream the step's output into the task log; return its exit code and error line."""
        tail: deque[str] = deque(maxlen=1)
        error_line = ""
        self._proc = subprocess.Popen(
            self.argv(),
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            line = line.rstrip("\n")
            self.log.info("%s", line)
            tail.append(line)
            if line.startswith("ERROR "):
                error_line = line
        returncode = self._proc.wait()
        return returncode, error_line or (tail[0] if tail else "")

    def on_kill(self) -> None:
        if self._proc and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)


def _pod_kwargs(task_id: str, module: str, kind: str) -> dict[str, Any]:
    """KubernetesPodOperator settings for one step, from params.yaml ``launcher.kubernetes``."""
    from kubernetes.client import models as k8s

    cluster = pipeline_params()["launcher"]["kubernetes"]
    kind_settings = cluster["kinds"][kind]
    # kubernetes needs the same tmp space a read-only root filesystem takes away
    scratch = k8s.V1Volume(name="scratch", empty_dir=k8s.V1EmptyDirVolumeSource())
    return {
        "name": task_id.replace("_", "-"),
        "namespace": cluster["namespace"],
        "image": cluster["images"][kind],
        "image_pull_policy": cluster["image_pull_policy"],
        "cmds": ["python", "-m", module],
        "service_account_name": cluster["service_account"],
        "container_resources": k8s.V1ResourceRequirements(**kind_settings["resources"]),
        "node_selector": kind_settings["node_selector"] or None,
        "tolerations": [k8s.V1Toleration(**t) for t in kind_settings["tolerations"]] or None,
        "env_from": [
            k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name=name))
            for name in cluster["env_from_secrets"]
        ],
        "security_context": k8s.V1PodSecurityContext(
            run_as_non_root=True,
            run_as_user=cluster["run_as_user"],
            run_as_group=cluster["run_as_user"],
            fs_group=cluster["run_as_user"],
            seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault"),
        ),
        "container_security_context": k8s.V1SecurityContext(
            allow_privilege_escalation=False,
            read_only_root_filesystem=True,
            capabilities=k8s.V1Capabilities(drop=["ALL"]),
        ),
        "volumes": [scratch],
        "volume_mounts": [k8s.V1VolumeMount(name="scratch", mount_path="/tmp")],
        "labels": {"app.kubernetes.io/part-of": "llm-pipeline", "llm-pipeline/step": task_id.replace("_", "-")},
        "on_finish_action": cluster["on_finish_action"],
        "startup_timeout_seconds": cluster["startup_timeout_s"],
        "do_xcom_push": True,
        "get_logs": True,
        "log_events_on_failure": True,
    }


def _operator(task_id: str, module: str, kind: str, env_vars: dict[str, str] | None, **extra: Any) -> tuple[type[BaseOperator], dict[str, Any]]:
    """The operator class of the configured mode and its keyword arguments (no ``arguments``)."""
    env_vars = {"PYTHONUNBUFFERED": "1", **(env_vars or {})}
    if launcher_mode() == "kubernetes":
        from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator

        return KubernetesPodOperator, {**_pod_kwargs(task_id, module, kind), "env_vars": env_vars, "task_id": task_id, **extra}
    return LocalStepOperator, {"module": module, "env_vars": env_vars, "task_id": task_id, **extra}


def step(
    task_id: str,
    module: str,
    arguments: list[str],
    *,
    kind: str = "cpu",
    env_vars: dict[str, str] | None = None,
    **operator_kwargs: Any,
) -> BaseOperator:
    """The operator running ``python -m MODULE ARGUMENTS`` (Jinja-templated) in the configured mode."""
    operator_cls, kwargs = _operator(task_id, module, kind, env_vars, **operator_kwargs)
    return operator_cls(arguments=arguments, **kwargs)


def mapped_step(
    task_id: str,
    module: str,
    argument_lists: Any,
    *,
    kind: str = "cpu",
    env_vars: dict[str, str] | None = None,
    **operator_kwargs: Any,
) -> Any:
    """One task instance per element of ``argument_lists`` (an XComArg of argv lists):
    Airflow dynamic task mapping; one pod each in the cluster, one process each locally."""
    operator_cls, kwargs = _operator(task_id, module, kind, env_vars, **operator_kwargs)
    return operator_cls.partial(**kwargs).expand(arguments=argument_lists)


def shard_arguments(arguments: list[str], *, output_root: str, num_shards: str, task_id: str = "shard_plan") -> Any:
    """An XComArg of ``num_shards`` argument lists for :func:`mapped_step`: shard ``i`` gets
    ``--output {output_root}/{i:05d} --shard-index i --num-shards N`` appended.

    A tiny task, because N is only known at run time (a Param); its inputs are templated.
    """
    from airflow.sdk import task

    @task(task_id=task_id)
    def plan(arguments: list[str], output_root: str, num_shards: str) -> list[list[str]]:
        count = int(num_shards)
        return [
            [*arguments, "--output", f"{output_root}/{i:05d}", "--shard-index", str(i), "--num-shards", str(count)]
            for i in range(count)
        ]

    return plan(arguments, output_root, num_shards)
