"""The one place that knows how a step runs.

:func:`step` turns ``python -m tasks.<module> ARGS`` into an Airflow operator:

- ``kubernetes`` mode: a :class:`KubernetesPodOperator` (``k8s_job.StepPodOperator``: exit 2
  fails the task without retries) running the step's image (one per step
  kind: ``cpu`` / ``gpu``) with the namespace, service account, resources, GPU requests, node
  selector, tolerations, Secrets-as-env and non-root security context from params.yaml. The
  step writes its result to ``/airflow/xcom/return.json``; the xcom sidecar returns it.
- ``local`` mode (the default): a :class:`LocalStepOperator` running the *same argv with
  the same env* as a process of the runtime venv, its log streamed into the task log and its
  result JSON returned as the task's XCom.

The mode comes from configuration (``PIPELINE_LAUNCHER_MODE`` or params.yaml ``launcher.mode``),
never from the DAG file. Multi-node steps (training) get a ``KubernetesJobOperator`` (an Indexed
Job) from the training issue's builder beside this one.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from airflow.sdk import BaseOperator
from cluster import DEPLOY_MODULE, DEPLOYER_LABEL, STEP_LABEL, pinned_image
from step_exit import step_outcome

from pipeline_params import REPO_ROOT, line_env, pipeline_params
from tasks.contract import (
    GATE_REJECTED_EXIT_CODE,
    RESULT_PATH_ENV,
    TORCHRUN_MODULE,
    Rendezvous,
    ended_without_error_line,
    record_error,
    torchrun_args,
)
from tasks.results import check_path, step_result_type

PR_SET_PDEATHSIG = 1  # prctl(2)

# Run-scoped storage key of the DAG run: run ids hold ':' and '+', which S3 clients mangle.
RUN_KEY = "{{ run_id | replace(':', '-') | replace('+', '_') }}"


def launcher_mode() -> str:
    mode = os.environ.get("PIPELINE_LAUNCHER_MODE") or pipeline_params().launcher.mode
    if mode not in ("local", "kubernetes"):
        raise ValueError(f"launcher mode {mode!r}: expected 'local' or 'kubernetes'")
    return str(mode)


def run_output_uri(step_name: str) -> str:
    """Templated output URI of a step for the current DAG run."""
    pipeline = pipeline_params().pipeline
    return f"{pipeline.artifact_root}/{{{{ dag.dag_id }}}}/{RUN_KEY}/{step_name}"


class StepResult(str):
    """A field of an earlier step's result: the Jinja template that reads its XCom, remembering
    the steps it reads. :func:`step` and the other builders make the task whose arguments hold it
    downstream of them, so the data draws the DAG's edges (a template alone draws none: a rewired
    DAG could read a step that has not run yet). Joined to a string it stays a StepResult."""

    sources: tuple[BaseOperator, ...]

    def __new__(cls, text: str, sources: tuple[BaseOperator, ...]) -> StepResult:
        made = super().__new__(cls, text)
        made.sources = sources
        return made

    def __add__(self, other: str) -> StepResult:
        return StepResult(str(self) + str(other), self.sources + getattr(other, "sources", ()))

    def __radd__(self, other: str) -> StepResult:
        return StepResult(str(other) + str(self), getattr(other, "sources", ()) + self.sources)


def result(task: BaseOperator, *keys: str, xcom_key: str | None = None) -> StepResult:
    """A field (``keys``: its path) of ``task``'s result, or its XCom ``xcom_key``, as JSON when
    the key is given (the run report's inputs). The path is checked against the step's result
    type (``tasks.results.STEP_RESULTS``) here, as the DAG is parsed: a misspelt or renamed
    field fails the DAG's import, naming the task, the key and the fields there are."""
    if xcom_key is not None:
        return StepResult(f"{{{{ ti.xcom_pull(task_ids='{task.task_id}', key='{xcom_key}') | tojson }}}}", (task,))
    module, arguments = step_command(task)
    try:
        check_path(step_result_type(module, arguments), keys)
    except ValueError as exc:
        raise ValueError(f"launcher.result({task.task_id}, {', '.join(map(repr, keys))}): {exc}") from None
    path = "".join(f"['{key}']" for key in keys)
    return StepResult(f"{{{{ ti.xcom_pull(task_ids='{task.task_id}'){path} }}}}", (task,))


def step_command(task: Any) -> tuple[str, list[Any]]:
    """The module and arguments a step's operator runs (``python -m MODULE ARGUMENTS``): a local
    process's or torchrun's ``module``, a pod's ``cmds``; a mapped task's from its partial and
    expanded arguments (an expansion only known at run time: no arguments)."""
    names = ("module", "cmds", "arguments")
    settings = {name: getattr(task, name, None) for name in names}
    if isinstance(getattr(task, "partial_kwargs", None), dict):  # a mapped operator
        expanded = getattr(getattr(task, "expand_input", None), "value", None) or {}
        settings = {name: task.partial_kwargs.get(name, expanded.get(name)) for name in names}
    module = settings.get("module")
    cmds = settings.get("cmds") or []
    if module is None and list(cmds[:2]) == ["python", "-m"] and len(cmds) > 2:
        module = cmds[2]
    if not isinstance(module, str):
        raise ValueError(f"launcher.result({getattr(task, 'task_id', task)}): not a step's task (no module it runs)")
    arguments = settings.get("arguments")
    return module, list(arguments) if isinstance(arguments, list) else []


def answer(task: BaseOperator) -> StepResult:
    """A human-in-the-loop task's answer as JSON: the options chosen, who answered (null: the
    timeout chose the defaults) and when (its datetime as text: Jinja's tojson takes no dates)."""
    pull = f"ti.xcom_pull(task_ids='{task.task_id}')"
    return StepResult(f"{{{{ {{'chosen_options': {pull}['chosen_options'], 'responded_by': "
                      f"({pull}['responded_by_user'] or {{}}).get('name'), "
                      f"'responded_at': {pull}['responded_at'] | string}} | tojson }}}}", (task,))


def read_results(arguments: Sequence[Any]) -> tuple[list[Any], list[BaseOperator]]:
    """``arguments`` as plain values (the operators keep no reference to other tasks), and the
    tasks whose results they read, in order, once each."""
    sources: dict[str, BaseOperator] = {}
    for argument in arguments:
        for source in getattr(argument, "sources", ()):
            sources.setdefault(source.task_id, source)
    plain = [str(a) if isinstance(a, StepResult) else a for a in arguments]
    # a result formatted into a plain string (an f-string, a join) has lost its task: refused
    # here, not found missing at run time
    for argument in plain:
        for task_id in re.findall(r"xcom_pull\(task_ids='(\w+)'", str(argument)):
            if task_id not in sources:
                raise ValueError(f"argument {str(argument)[:80]!r} reads {task_id}'s result without its edge: "
                                 "build it from launcher.result(...) with + (not an f-string or a join)")
    return plain, list(sources.values())


def downstream_of_what_it_reads(task: Any, sources: list[BaseOperator]) -> Any:
    """``task`` (an operator, mapped or not), downstream of ``sources``."""
    for source in sources:
        source >> task
    return task


def runtime_python() -> str:
    return os.environ.get("PIPELINE_RUNTIME_PYTHON", str(REPO_ROOT / ".venvs" / "runtime" / "bin" / "python"))


class LocalStepOperator(BaseOperator):
    """Runs ``python -m MODULE ARGS`` in the runtime venv as a local process."""

    template_fields: Sequence[str] = ("arguments", "env_vars")
    ui_color = "#e8f4e8"
    # when one process of a multi-process step fails, how long the others get to notice
    peer_grace_s = 60.0

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
        self._procs: list[subprocess.Popen[str]] = []

    def argv(self) -> list[str]:
        return [runtime_python(), "-m", self.module, *map(str, self.arguments)]

    def commands(self, context: Any) -> list[list[str]]:
        """The processes of this step: one here, one per node for distributed steps."""
        return [self.argv()]

    def process_env(self) -> dict[str, str]:
        return {**os.environ, **self.env_vars}

    def execute(self, context: Any) -> Any:
        with tempfile.TemporaryDirectory(prefix="step-result-") as scratch:
            result_path = Path(scratch) / "return.json"
            env = {**self.process_env(), RESULT_PATH_ENV: str(result_path)}
            commands = self.commands(context)
            for command in commands:
                self.log.info("running %s", " ".join(command))
            returncode, error_line = self._run(commands, env)
            result = json.loads(result_path.read_text()) if result_path.exists() else None
            if returncode not in (0, GATE_REJECTED_EXIT_CODE):
                record_error(context, error_line if error_line.startswith("ERROR ")
                             else ended_without_error_line(returncode, None, error_line))
            if returncode == GATE_REJECTED_EXIT_CODE and result is not None and context and "ti" in context:
                # a gate said no: keep its verdict for people and later tasks, skip what follows
                context["ti"].xcom_push(key="return_value", value=result)
            # bad input fails for good (tasks.lib.torchrun keeps the exit code of a training rank)
            outcome = step_outcome(returncode, error_line, self.module)
            if outcome is not None:
                raise outcome
            return result

    def _run(self, commands: list[list[str]], env: dict[str, str]) -> tuple[int, str]:
        """Stream every process's output into the task log; return the first failure's exit
        code (0 if all succeeded) and the line that explains it."""
        lines: queue.Queue[tuple[int, str | None]] = queue.Queue()
        self._procs = []
        for index, command in enumerate(commands):
            proc = subprocess.Popen(
                command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, bufsize=1, start_new_session=True, preexec_fn=_die_with_parent,
            )
            self._procs.append(proc)
            threading.Thread(target=_pump, args=(proc, index, lines), daemon=True).start()
        prefix = len(commands) > 1
        open_streams, last_line, error_line = len(commands), "", ""
        failed_at: float | None = None
        while open_streams:
            try:
                index, line = lines.get(timeout=1.0)
            except queue.Empty:
                failed_at = self._stop_peers_after_failure(failed_at)
                continue
            if line is None:
                open_streams -= 1
                continue
            self.log.info("%s%s", f"[node {index}] " if prefix else "", line)
            last_line = line
            if line.startswith(("ERROR ", "REJECTED ")) and not error_line:
                error_line = line
        codes = [proc.wait() for proc in self._procs]
        failures = [code for code in codes if code != 0]
        return (failures[0] if failures else 0), error_line or last_line

    def _stop_peers_after_failure(self, failed_at: float | None) -> float | None:
        if not any(p.poll() not in (None, 0) for p in self._procs):
            return failed_at
        now = time.monotonic()
        if failed_at is None:
            return now
        if now - failed_at > self.peer_grace_s:
            self.on_kill()
        return failed_at

    def on_kill(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the task process dies, however it dies (SIGKILL
    included). A torchrun agent stops its workers on SIGTERM, so a killed task leaves no
    orphan writing the checkpoints and MLflow run its retry is about to use (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _pump(proc: subprocess.Popen[str], index: int, lines: queue.Queue[tuple[int, str | None]]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.put((index, line.rstrip("\n")))
    lines.put((index, None))


class LocalTorchrunOperator(LocalStepOperator):
    """A multi-node step on one machine: one ``torchrun`` agent per node, like separate hosts,
    meeting through c10d rendezvous on 127.0.0.1 (gloo on CPUs)."""

    template_fields: Sequence[str] = (*LocalStepOperator.template_fields, "nodes")

    def __init__(self, *, nodes: int | str, procs_per_node: int, max_restarts: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # nodes may be a template (a Param of the trigger form): an int once rendered
        self.nodes, self.procs_per_node, self.max_restarts = nodes, procs_per_node, max_restarts

    @property
    def node_count(self) -> int:
        return int(self.nodes)

    def commands(self, context: Any) -> list[list[str]]:
        port = _free_port()
        ti = context.get("ti") if context else None
        # a fresh rendezvous per attempt: a retry must not meet the ghosts of the failed one
        rdzv_id = f"{getattr(ti, 'run_id', 'local')}-{getattr(ti, 'try_number', 0)}-{port}"
        rdzv_id = re.sub(r"[^A-Za-z0-9_.-]", "-", rdzv_id)
        command = [runtime_python(), "-m", TORCHRUN_MODULE,
                   *torchrun_args(nodes=self.node_count, procs_per_node=self.procs_per_node,
                                  rendezvous=Rendezvous(f"127.0.0.1:{port}", rdzv_id),
                                  max_restarts=self.max_restarts, module=self.module, arguments=self.arguments)]
        return [command for _ in range(self.node_count)]

    def process_env(self) -> dict[str, str]:
        processes = self.node_count * self.procs_per_node
        return {
            **super().process_env(),
            "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // processes)),
            # a node that restarts must not look for the store on the agent that died
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _pod_kwargs(task_id: str, module: str, kind: str) -> dict[str, Any]:
    """KubernetesPodOperator settings for one step, from params.yaml ``launcher.kubernetes``."""
    from kubernetes.client import models as k8s

    cluster = pipeline_params().launcher.kubernetes
    kind_settings = cluster.kinds[kind]
    deployer = module == DEPLOY_MODULE
    # kubernetes needs the same tmp space a read-only root filesystem takes away
    scratch = k8s.V1Volume(name="scratch", empty_dir=k8s.V1EmptyDirVolumeSource(size_limit=cluster.scratch_size))
    return {
        "name": task_id.replace("_", "-"),
        "namespace": cluster.namespace,
        "image": pinned_image(f"launcher.kubernetes.images.{kind}", cluster.images[kind]),
        "image_pull_policy": cluster.image_pull_policy,
        "cmds": ["python", "-m", module],
        # only deploy's pods carry an API token (and may reach Triton's pods: plugins/serving.py)
        "service_account_name": cluster.deploy_service_account if deployer else cluster.service_account,
        "automount_service_account_token": deployer,
        # deploy puts traffic back on stable on SIGTERM: give it the time (others: the default 30 s)
        "termination_grace_period": cluster.deploy_grace_s if deployer else None,
        "container_resources": k8s.V1ResourceRequirements(**kind_settings.resources),
        "node_selector": kind_settings.node_selector or None,
        "tolerations": [k8s.V1Toleration(**t) for t in kind_settings.tolerations] or None,
        "env_from": [
            k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name=name))
            for name in cluster.env_from_secrets
        ],
        "security_context": k8s.V1PodSecurityContext(
            run_as_non_root=True,
            run_as_user=cluster.run_as_user,
            run_as_group=cluster.run_as_user,
            fs_group=cluster.run_as_user,
            seccomp_profile=k8s.V1SeccompProfile(type="RuntimeDefault"),
        ),
        "container_security_context": k8s.V1SecurityContext(
            allow_privilege_escalation=False,
            read_only_root_filesystem=True,
            capabilities=k8s.V1Capabilities(drop=["ALL"]),
        ),
        "volumes": [scratch],
        "volume_mounts": [k8s.V1VolumeMount(name="scratch", mount_path="/tmp")],
        "labels": {"app.kubernetes.io/part-of": "llm-pipeline", STEP_LABEL: task_id.replace("_", "-"),
                   **({DEPLOYER_LABEL: "true"} if deployer else {})},
        "on_finish_action": cluster.on_finish_action,
        "startup_timeout_seconds": cluster.startup_timeout_s,
        "do_xcom_push": True,
        "skip_on_exit_code": GATE_REJECTED_EXIT_CODE,
        "get_logs": True,
        "log_events_on_failure": True,
        # a failed container's termination message is its log's tail: the step's ERROR line
        "termination_message_policy": "FallbackToLogsOnError",
    }


def scheduling(task_id: str) -> dict[str, Any]:
    """A task's time limit, pool and priority weight (params.yaml ``pipeline.tasks``)."""
    import datetime as dt

    settings = pipeline_params().pipeline.tasks.get(task_id)
    if settings is None:  # a task params.yaml gives no settings of its own
        return {}
    kwargs: dict[str, Any] = {"execution_timeout": dt.timedelta(minutes=settings.timeout_min)}
    if settings.pool is not None:
        kwargs["pool"] = settings.pool
    if settings.priority is not None:
        kwargs["priority_weight"] = settings.priority
    return kwargs


def step_env(env_vars: dict[str, str] | None) -> dict[str, str]:
    """The environment every step gets on top of its own: unbuffered output, for live logs, and
    the model line whose DAG it is in (``PIPELINE_LINE``), so it reads that line's settings."""
    return {"PYTHONUNBUFFERED": "1", **line_env(), **(env_vars or {})}


def _operator(task_id: str, module: str, kind: str, env_vars: dict[str, str] | None, **extra: Any) -> tuple[type[BaseOperator], dict[str, Any]]:
    """The operator class of the configured mode and its keyword arguments (no ``arguments``)."""
    env_vars = step_env(env_vars)
    if launcher_mode() == "kubernetes":
        from k8s_job import StepPodOperator

        env_vars = {**env_vars, "SERVING_PLATFORM": "kubernetes"}  # deploy drives the cluster's Triton tracks
        return StepPodOperator, {**_pod_kwargs(task_id, module, kind), "env_vars": env_vars, "task_id": task_id,
                                       **scheduling(task_id), **extra}
    return LocalStepOperator, {"module": module, "env_vars": env_vars, "task_id": task_id, **scheduling(task_id), **extra}


def step(
    task_id: str,
    module: str,
    arguments: list[str],
    *,
    kind: str = "cpu",
    env_vars: dict[str, str] | None = None,
    **operator_kwargs: Any,
) -> BaseOperator:
    """The operator running ``python -m MODULE ARGUMENTS`` (Jinja-templated) in the configured
    mode, downstream of the steps whose results its arguments read (:func:`result`)."""
    operator_cls, kwargs = _operator(task_id, module, kind, env_vars, **operator_kwargs)
    plain, sources = read_results(arguments)
    return downstream_of_what_it_reads(operator_cls(arguments=plain, **kwargs), sources)


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


@dataclasses.dataclass(frozen=True)
class Torchrun:
    """How a distributed step runs: ``nodes`` torchrun agents (a Param's template is rendered at
    run time), ``procs_per_node`` processes each, restarted up to ``max_restarts`` times."""

    nodes: int | str
    procs_per_node: int
    max_restarts: int


def distributed_step(
    task_id: str,
    module: str,
    arguments: list[str],
    torchrun: Torchrun,
    *,
    kind: str = "gpu",
    env_vars: dict[str, str] | None = None,
    **operator_kwargs: Any,
) -> BaseOperator:
    """A ``torchrun`` step over ``torchrun.nodes`` x ``procs_per_node`` processes: an Indexed Job
    with a rendezvous Service in a cluster, ``nodes`` local torchrun agents on 127.0.0.1
    otherwise; downstream of the steps whose results its arguments read."""
    env_vars = step_env(env_vars)
    arguments, sources = read_results(arguments)
    if launcher_mode() == "kubernetes":
        from k8s_job import TorchrunJobOperator
        from kubernetes.client import models as k8s

        cluster = pipeline_params().launcher.kubernetes
        training = cluster.training
        kwargs = _pod_kwargs(task_id, module, kind)
        resources = {key: dict(value) for key, value in cluster.kinds[kind].resources.items()}
        for bound in resources.values():  # one GPU per process of a node
            if "nvidia.com/gpu" in bound:
                bound["nvidia.com/gpu"] = str(torchrun.procs_per_node)
        kwargs["container_resources"] = k8s.V1ResourceRequirements(**resources)
        return downstream_of_what_it_reads(TorchrunJobOperator(
            task_id=task_id,
            module=module,
            arguments=arguments,
            env_vars=env_vars,
            nodes=torchrun.nodes,
            procs_per_node=torchrun.procs_per_node,
            max_restarts=torchrun.max_restarts,
            job=training,
            **{**kwargs, **scheduling(task_id), **operator_kwargs},
        ), sources)
    return downstream_of_what_it_reads(LocalTorchrunOperator(
        task_id=task_id,
        module=module,
        arguments=arguments,
        env_vars=env_vars,
        nodes=torchrun.nodes,
        procs_per_node=torchrun.procs_per_node,
        max_restarts=torchrun.max_restarts,
        **{**scheduling(task_id), **operator_kwargs},
    ), sources)


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

    plain, sources = read_results(arguments)
    planned = plan(plain, output_root, num_shards)
    for planner, _ in planned.iter_references():  # the plan's own task
        downstream_of_what_it_reads(planner, sources)
    return planned


def tokenize_steps(snapshot_uri: Any, tokenizer_uri: Any, num_shards: str, extra: Sequence[str] = ()) -> BaseOperator:
    """A DAG's tokenization: the snapshot encoded in ``num_shards`` mapped tasks
    (``tokenize_shard``), merged into one dataset (``tokenize_merge``, whose result holds
    ``dataset_uri``); ``extra`` goes to both (e.g. a recorded ``--set val_fraction=``)."""
    shards = run_output_uri("tokenize/shards")
    source = ["--snapshot", snapshot_uri, "--tokenizer", tokenizer_uri, *extra]
    encode = mapped_step("tokenize_shard", "tasks.tokenize",
                         shard_arguments(["encode", *source], output_root=shards, num_shards=num_shards))
    merge = step("tokenize_merge", "tasks.tokenize",
                 ["merge", *source, "--num-shards", num_shards, "--shards", shards,
                  "--output", run_output_uri("tokenize/dataset")])
    encode >> merge  # merge reads the shards' folder, written by the mapped encode tasks
    return merge
