"""The launcher: local processes that surface step failures, and cluster pods that pass the
Kubernetes 1.32 schema (built offline with the provider's own dry-run, validated strictly)."""

from __future__ import annotations

import importlib
import itertools
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from airflow.sdk.exceptions import AirflowException, AirflowFailException
from helpers import REPO_ROOT, validate_objects

import launcher
from tasks.contract import ERROR_XCOM_KEY


def test_mode_comes_from_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPELINE_LAUNCHER_MODE", "kubernetes")
    assert launcher.launcher_mode() == "kubernetes"
    monkeypatch.setenv("PIPELINE_LAUNCHER_MODE", "docker")
    with pytest.raises(ValueError, match="launcher mode 'docker'"):
        launcher.launcher_mode()
    monkeypatch.delenv("PIPELINE_LAUNCHER_MODE")
    assert launcher.launcher_mode() == "local"  # params.yaml default


def test_run_output_uri_is_scoped_by_dag_run() -> None:
    uri = launcher.run_output_uri("validate")
    assert uri.startswith("s3://pipeline/runs/{{ dag.dag_id }}/")
    assert uri.endswith("/validate") and "run_id" in uri


# -- local mode -----------------------------------------------------------------------------


def local_step(tmp_path: Path, *arguments: str, module: str = "tasks.seed") -> launcher.LocalStepOperator:
    return launcher.LocalStepOperator(task_id="t", module=module, arguments=list(arguments))


def test_local_step_returns_the_step_result(tmp_path: Path) -> None:
    op = local_step(tmp_path, "--output", str(tmp_path / "raw"), "--heldout-output", str(tmp_path / "heldout"),
                    "--end-date", "2026-11-02", "--set", "days=2", "--set", "max_documents=40")
    result = op.execute(context={})
    heldout = (tmp_path / "heldout" / "eval.jsonl").read_text().splitlines()
    assert result["written"] + len(heldout) == 40 and result["days"] == ["2026-11-01", "2026-11-02"]
    assert op.argv()[1:3] == ["-m", "tasks.seed"]


def test_bad_input_fails_the_task_without_retry_and_names_the_problem(tmp_path: Path) -> None:
    op = local_step(tmp_path, "--source", str(tmp_path / "nothing"), "--end-date", "2026-11-22",
                    "--output", str(tmp_path / "out"), module="tasks.snapshot")
    with pytest.raises(AirflowFailException, match=r"^ERROR python -m tasks.snapshot: .*empty interval"):
        op.execute(context={})
    assert not (tmp_path / "out").exists()


class RecordingTaskInstance:
    """What the launcher uses of Airflow's runtime task instance: its XCom push."""

    def __init__(self) -> None:
        self.pushed: dict[str, Any] = {}

    def xcom_push(self, key: str, value: Any) -> None:
        self.pushed[key] = value


def test_a_crash_fails_the_task_with_its_last_line(tmp_path: Path) -> None:
    op = local_step(tmp_path, "--end-date", "not-a-date", "--output", str(tmp_path / "raw"))
    ti = RecordingTaskInstance()
    with pytest.raises(AirflowException, match=r"tasks\.seed exited with 1: ValueError: Invalid isoformat"):
        op.execute(context={"ti": ti})
    # no ERROR line: the report is told how it ended, not handed a log line as the error
    assert ti.pushed[ERROR_XCOM_KEY].startswith("exit 1; last output: ValueError: Invalid isoformat")


# -- reading a step's result ---------------------------------------------------------------


MISREAD_DAG = """
import datetime as dt
from airflow.sdk import DAG
from launcher import result, step

with DAG("misread", schedule=None, start_date=dt.datetime(2026, 1, 1)) as dag:
    snapshot = step("snapshot", "tasks.snapshot", ["--source", "s3://raw", "--end-date", "2026-11-22", "--output", "o"])
    step("validate", "tasks.validate", ["--snapshot", result(snapshot, "snapshot_url"), "--output", "v"])
"""


def test_a_misspelt_result_field_fails_the_dags_import_with_one_error(tmp_path: Path) -> None:
    from airflow.dag_processing.dagbag import DagBag

    (tmp_path / "misread.py").write_text(MISREAD_DAG)
    bag = DagBag(dag_folder=str(tmp_path))
    assert bag.dags == {} and len(bag.import_errors) == 1
    error = next(iter(bag.import_errors.values()))
    assert ("ValueError: launcher.result(snapshot, 'snapshot_url'): the result (SnapshotResult) has no field "
            "'snapshot_url'; its fields: snapshot_uri, stats_uri, data_version, duplicates_removed") in error


@pytest.fixture(scope="module")
def retrain_dag() -> Any:
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO_ROOT / "dags"))
    assert bag.import_errors == {}
    return bag.dags["llm_retrain"]


def test_a_result_path_is_checked_against_the_tasks_step(retrain_dag: Any) -> None:
    snapshot, merge = retrain_dag.get_task("snapshot"), retrain_dag.get_task("tokenize_merge")
    assert launcher.result(snapshot, "data_version", "tag") == \
        "{{ ti.xcom_pull(task_ids='snapshot')['data_version']['tag'] }}"
    assert launcher.result(merge, "tokens", "train")  # a mapping by split: any key
    with pytest.raises(ValueError, match=r"^launcher.result\(snapshot, 'data_version', 'tags'\): \['data_version'\] "
                                         r"\(DataVersionResult\) has no field 'tags'; its fields: tag, content_hash"):
        launcher.result(snapshot, "data_version", "tags")
    with pytest.raises(ValueError, match=r"^launcher.result\(tokenizer, 'dataset_uri'\): the result "
                                         r"\(TokenizerResult\) has no field 'dataset_uri'"):  # prepare's, not merge's
        launcher.result(retrain_dag.get_task("tokenizer"), "dataset_uri")
    with pytest.raises(ValueError, match=r"\(RolloutSummary\) has no field 'verdicts'"):
        launcher.result(retrain_dag.get_task("deploy_finish"), "verdicts")
    # a mapped task: its module from its partial arguments; its sub-command only known at run time
    assert launcher.step_command(retrain_dag.get_task("tokenize_shard")) == ("tasks.tokenize", [])
    with pytest.raises(ValueError, match=r"tasks.tokenize: its sub-command, .* is None here"):
        launcher.result(retrain_dag.get_task("tokenize_shard"), "shard_uri")
    with pytest.raises(ValueError, match=r"^launcher.result\(deploy_gate\): not a step's task"):
        launcher.result(retrain_dag.get_task("deploy_gate"))


def test_the_airflow_image_holds_every_tasks_module_the_dags_import() -> None:
    """The cluster image holds tasks/ files one by one (the steps run in the runtime image): what
    parsing the DAGs imports of tasks/ (the contract, the result types, the settings) is there."""
    dags = ", ".join(path.stem for path in sorted((REPO_ROOT / "dags").glob("llm_*.py")))
    code = (f"import sys; sys.path[:0] = ['plugins', 'dags']; import {dags}; "
            "print('\\n'.join(m.__file__ for n, m in sys.modules.items() if n.split('.')[0] == 'tasks'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    imported = {str(Path(line).relative_to(REPO_ROOT)) for line in out.stdout.split()}
    cluster = (REPO_ROOT / "containers" / "Dockerfile.airflow").read_text().split(" AS local", 1)[0]
    copied = [word for line in cluster.replace("\\\n", " ").splitlines() if line.startswith("COPY ")
              for word in line.split()[1:-1] if word.startswith("tasks/")]
    missing = [path for path in sorted(imported)
               if path not in copied and not any(path.startswith(folder) for folder in copied if folder.endswith("/"))]
    assert "tasks/results.py" in imported and missing == [], missing


# -- cluster mode ---------------------------------------------------------------------------


@pytest.fixture
def cluster_dag(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("PIPELINE_LAUNCHER_MODE", "kubernetes")
    import llm_retrain

    yield importlib.reload(llm_retrain).dag
    monkeypatch.setenv("PIPELINE_LAUNCHER_MODE", "local")
    importlib.reload(llm_retrain)


def pod_of(task: Any) -> dict[str, Any]:
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
    from kubernetes.client import ApiClient

    if not isinstance(task, KubernetesPodOperator):  # mapped: the pod one map index gets
        task = KubernetesPodOperator(
            **{**task.partial_kwargs, "task_id": task.task_id, "arguments": ["encode", "--shard-index", "0"]}
        )
    serialized: dict[str, Any] = ApiClient().sanitize_for_serialization(task.build_pod_request_obj(None, dry_run=True))
    return serialized


def test_only_the_deploy_pod_carries_an_api_token_and_reaches_triton(cluster_dag: Any) -> None:
    """Deploy's pod runs as the account serving's Role is bound to, with its token mounted, and
    carries the label Triton's NetworkPolicy admits; every other step pod has no token."""
    import cluster

    from pipeline_params import pipeline_params

    params = pipeline_params().launcher.kubernetes
    for task_id in ("deploy", "deploy_finish", "release_hold"):  # (a rollout held for approval: the last two)
        deploy = pod_of(cluster_dag.get_task(task_id))
        assert deploy["metadata"]["labels"][cluster.DEPLOYER_LABEL] == "true"
        assert deploy["spec"]["serviceAccountName"] == params.deploy_service_account
        assert deploy["spec"]["automountServiceAccountToken"] is True
        # on SIGTERM it moves traffic back to stable before it goes: its grace period allows for it
        assert deploy["spec"]["terminationGracePeriodSeconds"] == params.deploy_grace_s > 30
    for task_id in ("snapshot", "validate", "tokenize_shard", "evaluate", "register", "export", "report"):
        pod = pod_of(cluster_dag.get_task(task_id))
        assert cluster.DEPLOYER_LABEL not in pod["metadata"]["labels"], task_id
        assert pod["spec"]["serviceAccountName"] == params.service_account, task_id
        assert pod["spec"]["automountServiceAccountToken"] is False, task_id
        assert "terminationGracePeriodSeconds" not in pod["spec"], task_id


def validate_strict(objects: list[dict[str, Any]], tmp_path: Path) -> None:
    proc = validate_objects(objects, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_pods_and_a_training_jobs_result_is_checked_too(cluster_dag: Any) -> None:
    assert launcher.result(cluster_dag.get_task("snapshot"), "snapshot_uri")  # a pod: its cmds name the module
    with pytest.raises(ValueError, match=r"\(TrainResult\) has no field 'model_url'"):  # an Indexed Job's module
        launcher.result(cluster_dag.get_task("train"), "model_url")


def test_every_step_pod_is_valid_kubernetes_1_32(cluster_dag: Any, tmp_path: Path) -> None:
    steps = [t for t in cluster_dag.tasks if t.task_id not in ("shard_plan", "deploy_gate", "approval_gate",
                                                                 "approve_rollout", "train")]
    pods = [pod_of(t) for t in steps]
    # every step but the shard plan, the gates and the approval (Airflow tasks) and train (an Indexed Job)
    assert len(pods) == 13
    validate_strict(pods, tmp_path)
    for pod in pods:
        spec, container = pod["spec"], pod["spec"]["containers"][0]
        assert pod["metadata"]["namespace"] == "llm-pipeline"
        deployer = container["command"][2] == "tasks.deploy"  # the API's one caller
        assert spec["serviceAccountName"] == ("llm-pipeline-deployer" if deployer else "llm-pipeline-runner")
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["command"][:2] == ["python", "-m"] and container["command"][2].startswith("tasks.")
        assert {s["secretRef"]["name"] for s in container["envFrom"]} == {"llm-pipeline-storage", "llm-pipeline-mlflow"}
        assert container["resources"]["limits"]["memory"] == "4Gi"
        # /tmp is bounded: a step filling it is evicted, not the node's other pods
        assert {"name": "scratch", "emptyDir": {"sizeLimit": "50Gi"}} in spec["volumes"]
        assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"  # the report's error line
    # the step's result comes back through the xcom sidecar
    assert any(c["name"] == "airflow-xcom-sidecar" for c in pods[0]["spec"]["containers"])


def test_gpu_step_pod_requests_gpus_and_tolerates_gpu_nodes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PIPELINE_LAUNCHER_MODE", "kubernetes")
    op = launcher.step("gpu_probe", "tasks.seed", ["--help"], kind="gpu")
    pod = pod_of(op)
    validate_strict([pod], tmp_path)
    spec = pod["spec"]
    assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert spec["containers"][0]["image"].split("@")[0].endswith("runtime-gpu:0.1.0")


@pytest.mark.parametrize("backend", ["python", "tensorrt_plan"])
def test_the_export_runs_on_the_gpu_kind_where_a_tensorrt_plan_is_served(
    backend: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A TensorRT plan is built on the GPU kind that serves it: serve.backend tensorrt_plan
    schedules the DAG's export pod there; the other backends' export stays on the cpu kind."""
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["serve"]["backend"] = backend
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    monkeypatch.setenv("PIPELINE_PARAMS", str(tmp_path / "params.yaml"))
    monkeypatch.setenv("PIPELINE_LAUNCHER_MODE", "kubernetes")
    import llm_retrain

    try:
        pod = pod_of(importlib.reload(llm_retrain).dag.get_task("export"))
    finally:
        monkeypatch.undo()
        importlib.reload(llm_retrain)
    validate_strict([pod], tmp_path)
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    assert ("nvidia.com/gpu" in limits) == (backend == "tensorrt_plan"), limits
    assert pod["spec"]["containers"][0]["image"].split("@")[0].endswith(
        "runtime-gpu:0.1.0" if backend == "tensorrt_plan" else "runtime-cpu:0.1.0")


def test_validator_rejects_an_unknown_field(tmp_path: Path) -> None:
    """The schema check is real: a misspelt field fails it."""
    bad = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"},
           "spec": {"containers": [{"name": "c", "image": "i", "imagePullPolicyy": "x"}]}}
    assert validate_objects([bad], tmp_path).returncode != 0


# -- multi-node training --------------------------------------------------------------------


@pytest.fixture
def dummy_kubeconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """KubernetesJobOperator asks its hook whether it runs in-cluster while building the Job;
    a kubeconfig file answers that offline (no API server is contacted)."""
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "offline",
        "clusters": [{"name": "offline", "cluster": {"server": "https://127.0.0.1:1"}}],
        "users": [{"name": "offline", "user": {"token": "none"}}],
        "contexts": [{"name": "offline", "context": {"cluster": "offline", "user": "offline"}}],
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_training_job_and_rendezvous_service_are_valid_kubernetes_1_32(
    cluster_dag: Any, dummy_kubeconfig: str, tmp_path: Path
) -> None:
    from kubernetes.client import ApiClient

    train = cluster_dag.get_task("train")
    assert train.nodes == "{{ params.train_nodes }}"  # the trigger form's value ...
    train.nodes = "3"  # ... as rendered: the Job's size follows it
    train.config_file = dummy_kubeconfig
    job = train.build_job_request_obj(None)
    service = train.build_rendezvous_service(job)
    objects = [ApiClient().sanitize_for_serialization(o) for o in (job, service)]
    objects[0].update(apiVersion="batch/v1", kind="Job")
    validate_strict(objects, tmp_path)

    job_d, service_d = objects
    spec = job_d["spec"]
    nodes = 3
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == nodes
    assert spec["backoffLimit"] == 0 and spec["suspend"] is True  # Kueue admits the whole gang
    assert job_d["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "llm-training"
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service_d["metadata"]["name"] and pod["priorityClassName"] == "llm-training"
    assert pod["restartPolicy"] == "Never"
    container = pod["containers"][0]
    assert container["command"] == ["python", "-m", "tasks.lib.torchrun"]  # is_host from the completion index
    assert spec["podFailurePolicy"] == {"rules": [{"action": "FailJob", "onExitCodes": {
        "containerName": container["name"], "operator": "In", "values": [2]}}]}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in pod["volumes"]
    args = container["args"]
    assert f"--nnodes={nodes}" in args and "--rdzv-backend=c10d" in args
    assert f"--rdzv-endpoint={service_d['metadata']['name']}.llm-pipeline.svc:29400" in args
    assert args[args.index("-m") + 1] == "tasks.train"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    # the headless Service resolves to the index-0 pod even before it is ready
    assert service_d["spec"]["clusterIP"] == "None" and service_d["spec"]["publishNotReadyAddresses"] is True
    assert service_d["spec"]["selector"] == {
        "llm-pipeline/job": job_d["metadata"]["name"], "batch.kubernetes.io/job-completion-index": "0"}
    assert spec["template"]["metadata"]["labels"]["llm-pipeline/job"] == job_d["metadata"]["name"]


def test_local_training_runs_one_torchrun_agent_per_node() -> None:
    op = launcher.LocalTorchrunOperator(task_id="t", module="tasks.train", arguments=["--dataset", "d"],
                                        nodes=2, procs_per_node=1, max_restarts=2)
    commands = op.commands({})
    assert len(commands) == 2 and commands[0] == commands[1]
    command = commands[0]
    assert command[1:3] == ["-m", "tasks.lib.torchrun"] and "--nnodes=2" in command and "--max-restarts=2" in command
    assert any(a.startswith("--rdzv-endpoint=127.0.0.1:") for a in command)
    assert command[-3:] == ["tasks.train", "--dataset", "d"]
    assert op.process_env()["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))


@pytest.mark.torchrun
def test_bad_input_under_torchrun_fails_once_without_retries(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """torchrun would restart a worker that exits 2 (``--max-restarts``) and then exit 1, which
    Airflow retries: the worker stops its agent, which exits 2 (tasks.lib.torchrun)."""
    op = launcher.LocalTorchrunOperator(
        task_id="t", module="tasks.train", nodes=2, procs_per_node=1, max_restarts=2,
        arguments=["--dataset", str(tmp_path / "nothing"), "--checkpoints", str(tmp_path / "ckpt"),
                   "--output", str(tmp_path / "model")],
        env_vars={"MLFLOW_TRACKING_URI": ""})
    with pytest.raises(AirflowFailException, match=r"^ERROR python -m tasks.train: .*not a complete"):
        op.execute(context={})
    logged = capfd.readouterr()
    errors = [line for line in (logged.out + logged.err).splitlines() if "] ERROR python -m tasks.train" in line]
    assert len(errors) == 2, errors  # once per node: no worker group was restarted
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "model").exists()


def test_a_killed_task_takes_its_step_processes_with_it(tmp_path: Path) -> None:
    """SIGKILL of the task process (no on_kill, no finally) must not leave the step running:
    an orphaned torchrun agent would keep writing what the retry writes."""
    import psutil

    script = (f"import sys; sys.path[:0] = [{str(REPO_ROOT / 'plugins')!r}]\n"
              "import launcher\n"
              "launcher.LocalStepOperator(task_id='t', module='http.server', "
              "arguments=['0', '--bind', '127.0.0.1']).execute(context={})\n")
    task = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT)
    deadline = time.monotonic() + 60
    children: list[psutil.Process] = []
    while not children and time.monotonic() < deadline:
        children = [c for c in psutil.Process(task.pid).children() if "http.server" in " ".join(c.cmdline())]
        time.sleep(0.2)
    assert children, "the step process never started"
    task.kill()
    task.wait()
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, [p.pid for p in alive]


def test_training_job_waits_for_kueue_admission_at_a_steady_pace(cluster_dag: Any, dummy_kubeconfig: str) -> None:
    """A suspended Job has no pods until Kueue admits it: the operator keeps checking every
    poll interval instead of failing after the provider's tight retry loop. (No cluster here:
    the API's pod list is played by a stand-in that admits the Job on the third look.)"""
    from kubernetes.client import models as k8s

    train = cluster_dag.get_task("train")
    train.config_file, train.job_poll_interval, train.admission_timeout_s = dummy_kubeconfig, 0.05, 5
    train.nodes = "2"  # rendered from the trigger form
    train.job = train.build_job_request_obj(None)
    pods = [k8s.V1Pod(metadata=k8s.V1ObjectMeta(name=f"p{i}", namespace="llm-pipeline")) for i in range(2)]
    answers = iter([[], [], pods])
    looks = []

    class PodList:
        def list_namespaced_pod(self, namespace: str, label_selector: str) -> Any:
            looks.append(time.monotonic())
            return k8s.V1PodList(items=next(answers))

    train.__dict__["client"] = PodList()
    train.log_matching_pod = lambda pod, context: None
    train._build_find_pod_label_selector = lambda context, exclude_checked=True: "llm-pipeline/job=x"
    found = train.get_pods(train.job.spec.template, {})
    assert len(found) == 2 and len(looks) == 3
    assert min(b - a for a, b in itertools.pairwise(looks)) >= 0.05
    answers = iter([[]] * 1000)  # never admitted: a clear error once the admission timeout passes
    train.admission_timeout_s = 0.2
    with pytest.raises(AirflowException, match="not admitted"):
        train.get_pods(train.job.spec.template, {})


def test_a_training_retry_deletes_the_earlier_attempts_job_first(cluster_dag: Any, dummy_kubeconfig: str,
                                                                  tmp_path: Path) -> None:
    """An attempt whose worker died may still train: the retry deletes its Job (and waits until
    it is gone) before creating its own. (No cluster here: the Jobs API is a stand-in.)"""
    from types import SimpleNamespace

    from k8s_job import ATTEMPT_OF_LABEL
    from kubernetes.client import ApiClient
    from kubernetes.client import models as k8s

    train = cluster_dag.get_task("train")
    train.config_file, train.job_poll_interval, train.nodes = dummy_kubeconfig, 0.01, "2"  # nodes: as rendered
    ti = SimpleNamespace(dag_id="llm_retrain", task_id="train", map_index=-1, try_number=2)
    context = {"ti": ti, "run_id": "manual__2026-11-22T05:40:08+00:00", "dag": cluster_dag}
    job = train.build_job_request_obj(context)
    owner = job.metadata.labels[ATTEMPT_OF_LABEL]
    job_d = ApiClient().sanitize_for_serialization(job)
    job_d.update(apiVersion="batch/v1", kind="Job")
    validate_strict([job_d], tmp_path)  # a valid label value, whatever the run id holds

    jobs = {"train-old1": owner}
    deleted = []

    class Jobs:
        def list_namespaced_job(self, namespace: str, label_selector: str) -> Any:
            wanted = label_selector.split("=", 1)[1]
            return k8s.V1JobList(items=[k8s.V1Job(metadata=k8s.V1ObjectMeta(name=n)) for n, o in jobs.items() if o == wanted])

        def delete_namespaced_job(self, name: str, namespace: str, propagation_policy: str) -> None:
            assert propagation_policy == "Foreground"
            deleted.append(name)
            jobs.pop(name)

    class Services:
        def delete_namespaced_service(self, name: str, namespace: str) -> None:
            pass

    train.__dict__["hook"] = SimpleNamespace(batch_v1_client=Jobs(), core_v1_client=Services())
    assert train.delete_earlier_attempts(context) == ["train-old1"] and deleted == ["train-old1"]
    other_run = {**context, "run_id": "scheduled__2026-11-15T00:00:00+00:00"}
    jobs["train-first-run"] = owner  # the first run's Job, running again
    assert train.delete_earlier_attempts(other_run) == []  # another run never touches it
    assert "train-first-run" in jobs


@pytest.mark.parametrize(("exit_code", "retried"), [(2, False), (1, True), (137, True)])
def test_a_step_pod_that_exits_2_is_not_retried(cluster_dag: Any, dummy_kubeconfig: str, exit_code: int,
                                                 retried: bool) -> None:
    """Bad input fails the task for good in a cluster too; a crash or an OOM kill is retried.
    (No cluster: the pod as the API would report it after the step ended.)"""
    from airflow.sdk.exceptions import AirflowException, AirflowFailException
    from kubernetes.client import models as k8s

    task = cluster_dag.get_task("validate")
    task.config_file, task.log_events_on_failure = dummy_kubeconfig, False
    task.process_pod_deletion = lambda pod, reraise=True: None  # nothing to delete: no cluster
    task.patch_already_checked = lambda pod, reraise=True: None
    task.is_istio_enabled = lambda pod: False  # (it asks the API, with retries)
    # FallbackToLogsOnError: the kubelet keeps the failed container's log tail as its message
    message = "2026-11-25 INFO tasks: reading s3://raw/x\nERROR python -m tasks.validate: s3://raw/x: no records\n"
    terminated = k8s.V1ContainerStateTerminated(exit_code=exit_code, reason="Error", message=message)
    remote = k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(name="validate-x", namespace="llm-pipeline"),
        status=k8s.V1PodStatus(phase="Failed", container_statuses=[k8s.V1ContainerStatus(
            name="base", image="i", image_id="", ready=False, restart_count=0,
            state=k8s.V1ContainerState(terminated=terminated))]),
    )
    ti = RecordingTaskInstance()
    assert task.termination_message_policy == "FallbackToLogsOnError"
    with pytest.raises(AirflowException) as raised:
        task.cleanup(remote, remote, context={"ti": ti})
    assert isinstance(raised.value, AirflowFailException) is not retried, raised.value
    # the step's line leads the task's error (the alert's text) and is kept for the run report
    assert str(raised.value).startswith("ERROR python -m tasks.validate: s3://raw/x: no records"), raised.value
    assert ti.pushed == {ERROR_XCOM_KEY: "ERROR python -m tasks.validate: s3://raw/x: no records"}


def test_a_pod_killed_before_its_error_line_is_reported_by_how_it_ended() -> None:
    """Out of memory or killed, a step writes no ERROR line: the report gets the exit code, the
    kubelet's reason and the last line, not a log line passed off as the error."""
    from k8s_job import termination_error_line
    from kubernetes.client import models as k8s

    def pod(message: str | None) -> Any:
        terminated = k8s.V1ContainerStateTerminated(exit_code=137, reason="OOMKilled", message=message)
        return k8s.V1Pod(status=k8s.V1PodStatus(container_statuses=[k8s.V1ContainerStatus(
            name="base", image="i", image_id="", ready=False, restart_count=0,
            state=k8s.V1ContainerState(terminated=terminated))]))

    assert termination_error_line(pod("INFO step 120/300, loss 5.1\n"), "base") == (
        "exit 137 (OOMKilled); last output: INFO step 120/300, loss 5.1")
    assert termination_error_line(pod(None), "base") == "exit 137 (OOMKilled)"
    assert termination_error_line(pod(None), "other") is None  # (no such container: nothing to say)


def test_a_training_job_failed_by_bad_input_is_not_retried(cluster_dag: Any, dummy_kubeconfig: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A Job that its pod failure policy ended (a pod exited 2) fails the task for good; any
    other failure of the Job is retried. (No cluster: the Job as the API reports it, and the
    provider's error for a failed Job.)"""
    from airflow.providers.cncf.kubernetes.operators.job import KubernetesJobOperator
    from kubernetes.client import models as k8s

    train = cluster_dag.get_task("train")
    train.config_file, train.nodes = dummy_kubeconfig, "2"
    train._delete_service = lambda: None

    def failed_job(reason: str, message: str) -> Any:
        def execute(self: Any, context: Any) -> Any:
            self.job = k8s.V1Job(metadata=k8s.V1ObjectMeta(name="train-x"), status=k8s.V1JobStatus(conditions=[
                k8s.V1JobCondition(type="Failed", status="True", reason=reason, message=message)]))
            raise AirflowException(f"Kubernetes job 'train-x' is failed with error '{message}'")
        return execute

    monkeypatch.setattr(KubernetesJobOperator, "execute", failed_job(
        "PodFailurePolicy", "Container base for pod llm-pipeline/train-x-0 failed with exit code 2 "
                            "matching FailJob rule at index 0"))
    with pytest.raises(AirflowFailException, match="exit code 2 matching FailJob"):
        train.execute({})
    monkeypatch.setattr(KubernetesJobOperator, "execute", failed_job(
        "BackoffLimitExceeded", "Job has reached the specified backoff limit"))
    with pytest.raises(AirflowException) as raised:
        train.execute({})
    assert not isinstance(raised.value, AirflowFailException)
