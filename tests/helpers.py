"""Helpers of the test suite (both environments: stdlib + pytest only at import)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
# The runtime venv; on a machine without one (a GPU machine's image holding torch and the
# runtime's other packages) the Python running the tests.
RUNTIME_PY = REPO_ROOT / ".venvs" / "runtime" / "bin" / "python"
if not RUNTIME_PY.exists() and os.environ.get("TESTS_ON_THIS_PYTHON") == "1":
    RUNTIME_PY = Path(sys.executable)
SESSION_DIR = Path(tempfile.mkdtemp(prefix="llm-pipeline-tests-"))

# Ports of the test stack: apart from the defaults (8333, 9333, 5000, ...) of a dev stack.
# TEST_PORT_OFFSET shifts them all, for two checkouts testing at once on one machine (by 200 or
# more); each pytest-xdist worker of make test's slow tier starts a stack of its own, 50 further,
# and make test's timed tests one 100 further (beside the orchestrator half's two)
_OFFSET = int(os.environ.get("TEST_PORT_OFFSET", "0")) + 50 * int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
TEST_PORTS = {
    name: port + _OFFSET
    for name, port in {
        "s3": 8433,
        "seaweedfs_master": 9433,
        "seaweedfs_volume": 18180,
        "seaweedfs_filer": 18988,
        "mlflow": 5100,
        "airflow": 8180,
        "triton_http": 8200,
        "triton_grpc": 8201,
        "triton_metrics": 8202,
        "openai_api": 8203,
        "router": 8290,
        "router_internal": 8291,
        "prometheus": 9190,
        "pushgateway": 9191,
    }.items()
}

# Modules whose tests share a session fixture that is a whole DAG run (tests/dags/conftest.py's
# end-to-end retrain): under pytest-xdist they run in one process, so the run is made once.
SHARED_RUN_MODULES = {f"tests/dags/{name}.py": "retrain_run"
                      for name in ("test_llm_retrain", "test_llm_drift", "test_llm_replay")}

# Raw demo data the integration tests share: 14 days ending on SEED_END, a week per run.
SEED_URI = "s3://raw/test-seed"
SEED_END = "2026-11-21"
SEED_DOCUMENTS = 3000


def run_module(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m MODULE ARGS`` in the runtime venv from the repo root, output captured."""
    return subprocess.run(
        [str(RUNTIME_PY), "-m", module, *args],
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )


def run_measuring_peak_rss(module: str, *args: str, peak: Path) -> subprocess.CompletedProcess[str]:
    """``python -m module args`` whose peak RSS (KiB) is written to ``peak`` when it exits. The
    process's own high-water mark (VmHWM): ``ru_maxrss`` keeps the parent's RSS across the
    fork and exec, so it would read the test process's memory."""
    hwm = "next(line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM:'))"
    code = ("import atexit, runpy, sys\n"
            f"atexit.register(lambda: open({str(peak)!r}, 'w').write({hwm}))\n"
            f"sys.argv = [{module!r}, *{list(args)!r}]\n"
            f"runpy.run_module({module!r}, run_name='__main__')")
    proc = subprocess.run([str(RUNTIME_PY), "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**os.environ})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def mlflow_rest(path: str) -> Any:
    """GET an MLflow REST path as the pipeline's user (the server asks for a login), as JSON."""
    import urllib.request

    from tasks.lib.metrics import basic_auth

    request = urllib.request.Request(f"{os.environ['MLFLOW_TRACKING_URI']}{path}", headers=basic_auth(
        os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]))
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read())


def prometheus_query(expr: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Prometheus' answer to ``expr`` (its ``/api/v1/query`` JSON), asked with the stack's login
    (``PROMETHEUS_URL`` / ``_USERNAME`` / ``_PASSWORD`` of ``env``, default this process's)."""
    import urllib.parse
    import urllib.request

    from tasks.lib.metrics import basic_auth

    env = env or dict(os.environ)
    request = urllib.request.Request(f"{env['PROMETHEUS_URL']}/api/v1/query?{urllib.parse.urlencode({'query': expr})}",
                                     headers=basic_auth(env["PROMETHEUS_USERNAME"], env["PROMETHEUS_PASSWORD"]))
    with urllib.request.urlopen(request, timeout=60) as resp:
        loaded: dict[str, Any] = json.loads(resp.read())
    return loaded


def step_result(proc: subprocess.CompletedProcess[str]) -> dict[str, object]:
    """The result JSON a step logged (``... result {json}``)."""
    for line in reversed(proc.stderr.splitlines()):
        if " result {" in line:
            loaded: dict[str, object] = json.loads(line.split(" result ", 1)[1])
            return loaded
    raise AssertionError(f"no result line; rc={proc.returncode}\n{proc.stderr[-3000:]}")


def error_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("ERROR ")]



def tokenize(snapshot: Path, tokenizer: str, out: Path, num_shards: int) -> dict[str, object]:
    for i in range(num_shards):
        proc = run_module(
            "tasks.tokenize", "encode", "--snapshot", str(snapshot), "--tokenizer", tokenizer,
            "--shard-index", str(i), "--num-shards", str(num_shards), "--output", str(out / "shards" / f"{i:05d}"),
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
    proc = run_module(
        "tasks.tokenize", "merge", "--snapshot", str(snapshot), "--tokenizer", tokenizer,
        "--num-shards", str(num_shards), "--shards", str(out / "shards"), "--output", str(out / "dataset"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return step_result(proc)



def write_dataset(root: Path, tokens: Any, vocab: int, claimed: int | None = None) -> Path:
    """A hand-made dataset folder (for the checks that must reject it)."""
    root.mkdir(parents=True, exist_ok=True)
    for split in ("train", "val"):
        tokens.tofile(root / f"{split}.bin")
    index = {"dtype": tokens.dtype.name, "vocab_size": vocab, "eos_id": 0, "tokenizer_uri": "t", "tokenizer_hash": "h",
             "splits": {s: {"tokens": claimed if claimed is not None else len(tokens), "bin": f"{s}.bin"}
                        for s in ("train", "val")}}
    (root / "index.json").write_text(json.dumps(index))
    (root / "_SUCCESS").write_text("{}")  # as if committed by the tokenize step
    return root


def write_eval_text(folder: Path, first: int, last: int) -> Path:
    """Held-out text as the seed writes it: installed docstrings ``[first, last)`` (a training
    snapshot of the first ``first`` never saw them)."""
    from tasks import seed

    docs = list(seed.documents(last))[first:]
    path = folder / "eval.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "text": d}) + "\n" for i, (_, d) in enumerate(docs)))
    return path


def params_with_model_name(prefix: str, folder: Path) -> dict[str, str]:
    """params.yaml with a registered-model name of the caller's own, so test modules' aliases
    stay apart: ``{"PIPELINE_PARAMS": path, "MODEL_NAME": name}``."""
    import time

    import yaml

    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["pipeline"]["model_name"] = f"{prefix}-{time.time_ns()}"
    path = folder / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return {"PIPELINE_PARAMS": str(path), "MODEL_NAME": params["pipeline"]["model_name"]}


# -- Kubernetes objects, validated offline --------------------------------------------------

KUBERNETES_VALIDATE = [str(REPO_ROOT / ".venvs" / "orchestrator" / "bin" / "kubernetes-validate"), "--strict"]
GATEWAY_VALIDATE = ["node", str(REPO_ROOT / "tests" / "plugins" / "gateway_api" / "validate.mjs")]


def validate_objects(objects: list[dict[str, Any]], folder: Path,
                     kubernetes_version: str = "1.32.0") -> subprocess.CompletedProcess[str]:
    """Core objects against a Kubernetes minor's schema (strict: no unknown fields), Gateway API
    objects against the schemas generated from its CRDs. Returns the failing run, or the last."""
    import yaml

    gateway = [o for o in objects if o["apiVersion"].startswith("gateway.networking.k8s.io/")]
    core = [o for o in objects if o not in gateway]
    proc = subprocess.CompletedProcess[str]([], 0, "", "")
    if core:
        (folder / "core.yaml").write_text(yaml.safe_dump_all(core))
        proc = subprocess.run([*KUBERNETES_VALIDATE, "-k", kubernetes_version, str(folder / "core.yaml")],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            return proc
    if gateway:
        (folder / "gateway.json").write_text(json.dumps(gateway))
        proc = subprocess.run([*GATEWAY_VALIDATE, str(folder / "gateway.json")], capture_output=True, text=True)
    return proc


def sync_dags_to_db() -> None:
    """The DAG folder's DAGs in the Airflow database, as the dag-processor writes them
    (orchestrator half only; dag.test() does the same for the DAG it runs)."""
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db

    DagBundlesManager().sync_bundles_to_db()
    sync_bag_to_db(DagBag(dag_folder=str(REPO_ROOT / "dags")), "dags-folder", None)


# a GPT small enough for serving tests: its export, Triton's load and generation take seconds
SMALL = {"vocab_size": 1000, "seq_len": 64, "d_model": 64, "n_layers": 2, "n_heads": 4}


def register_gpt(name: str, tokenizer_uri: str, seed: int, **overrides: int) -> str:
    """A GPT of a given seed and size, registered the way the register step does."""
    import mlflow
    import torch

    from tasks.lib.model import FORMAT_VERSION, GPT, GPTConfig
    from tasks.lib.model_store import log_model

    torch.manual_seed(seed)
    config = GPTConfig(**{**SMALL, **overrides})
    model = GPT(config).eval()
    token_hash = tokenizer_uri.rsplit("sha256-", 1)[1].split("/")[0]
    description = {"format_version": FORMAT_VERSION, "config": config.to_dict(), "tokenizer_uri": tokenizer_uri,
                   "tokenizer_hash": token_hash}
    with mlflow.start_run(run_name=f"serving test {name} seed {seed}"):
        model_uri = log_model(model, description)
    version = mlflow.register_model(model_uri, name, tags={"model_description": json.dumps(description)})
    return str(version.version)


def register_model_dir(name: str, folder: str) -> str:
    """A model folder of this pipeline's form (a train step's output, an imported base)
    registered the way the register step does."""
    import mlflow

    from tasks.lib import storage
    from tasks.lib.model_store import load_model_dir, log_model

    with storage.scratch() as scratch:
        loaded = load_model_dir(folder, scratch)
    with mlflow.start_run(run_name=f"serving test {name} of {folder}"):
        model_uri = log_model(loaded.model, loaded.description)
    version = mlflow.register_model(model_uri, name, tags={
        "model_description": json.dumps(loaded.description), "tokenizer_uri": loaded.description["tokenizer_uri"],
        "tokenizer_hash": loaded.description["tokenizer_hash"]})
    return str(version.version)


@contextlib.contextmanager
def served_alone(env: dict[str, str], version: str, export_dir: Path, scratch: Path) -> Iterator[None]:
    """An exported version loaded in the stack's Triton with all traffic routed to it; unloaded
    and the route emptied afterwards, as the next module expects the stack."""
    from tasks.lib import triton
    from tasks.lib.params import load_settings
    from tasks.serving.platforms import serve_versions, stage_version
    from tasks.serving.router import NginxRouter

    serve = load_settings().serve
    repository, client = Path(env["TRITON_REPOSITORY"]), triton.TritonClient(env["TRITON_URL"])
    router = NginxRouter(Path(env["ROUTER_DIR"]), env["ROUTER_URL"], env["ROUTER_INTERNAL_URL"])
    stage_version(str(export_dir), int(version), repository, serve, scratch)
    serve_versions(client, repository, serve, [int(version)])
    router.apply(int(version))
    try:
        yield
    finally:
        router.apply(None)
        serve_versions(client, repository, serve, [])


def export(version: str, out: Path, env: dict[str, str], eval_text: Path) -> dict[str, Any]:
    """``tasks.export`` of a registered version, its result."""
    proc = run_module("tasks.export", "--model-version", version, "--output", str(out),
                      "--eval-set", str(eval_text), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return step_result(proc)


def cuda_provider_present() -> bool:
    """A GPU, and ONNX Runtime's CUDA build to run on it (the engine's GPU tests)."""
    import onnxruntime as ort
    import torch

    return torch.cuda.is_available() and "CUDAExecutionProvider" in ort.get_available_providers()


def imported_base(family: str, snapshot: Path, folder: Path, env: dict[str, str]) -> dict[str, Any]:
    """A tiny base checkpoint of ``family`` (examples/tiny_base.py, built offline) imported by the
    tokenize step: its result (``init_model_uri``, ``tokenizer_uri``)."""
    from examples.tiny_base import make_base
    from tasks.lib import tokens

    base = make_base(family, [r["text"] for r in tokens.read_jsonl(snapshot)], folder / family)
    proc = run_module("tasks.tokenize", "prepare", "--snapshot", str(snapshot), "--base", str(base),
                      "--preset", "cpu-tiny", "--output", str(folder / f"{family}-prepare"),
                      "--set", f"tokenizer_store={folder / 'tokenizers'}", "--set", f"base_store={folder / 'bases'}",
                      env=env)
    assert proc.returncode == 0 and not error_lines(proc), proc.stderr[-2000:]
    return step_result(proc)


# an engine whose every fifth answer is changed (upper case): a broken text path behind a healthy
# logits model, which a shadow's text agreement catches
FIFTH_CHANGED = """
import itertools
_init, _add, _nth = Detokenizer.__init__, Detokenizer.add, itertools.count()
def _changing_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.changed = next(_nth) % 5 == 4
def _changing_add(self, token):
    text, stopped = _add(self, token)
    return (text.upper() if self.changed else text), stopped
Detokenizer.__init__, Detokenizer.add = _changing_init, _changing_add
"""


def clone_export(source: Path, version: str, out: Path, new_version: str, engine_fault: str = "",
                 models: tuple[str, str] = ("llm", "llm_generate")) -> Path:
    """The export of ``version`` as the export of ``new_version`` (same files, version folders of
    its Triton ``models`` renamed: logits, engine), its engine given ``engine_fault``, committed
    again: as if the export step had produced it (readers check files against the manifest)."""
    import shutil

    from tasks.lib import storage

    with storage.staged_output(str(out)) as staging:
        shutil.copytree(source, staging, dirs_exist_ok=True, ignore=shutil.ignore_patterns(storage.SUCCESS_MARKER))
        for model in models:
            (staging / "triton" / model / version).rename(staging / "triton" / model / new_version)
        engine = staging / "triton" / models[1] / new_version / "engine.py"
        engine.write_text(engine.read_text() + engine_fault)
    return out


def tutorial_commands() -> list[str]:
    """docs/tutorial.md's commands in the page's order: the lines of its bash blocks."""
    import re

    page = (REPO_ROOT / "docs" / "tutorial.md").read_text()
    blocks = re.findall(r"^```bash\n(.*?)^```", page, flags=re.M | re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def ti_states(run: Any) -> dict[str, str]:
    """A DAG run's task states by task id (a mapped task's instances as ``task[i]``)."""
    return {ti.task_id + (f"[{ti.map_index}]" if ti.map_index >= 0 else ""): ti.state for ti in run.get_task_instances()}


def xcom(run: Any, task_id: str, key: str = "return_value") -> Any:
    """What ``task_id`` of a DAG run pushed (its result, by default)."""
    return next(ti for ti in run.get_task_instances() if ti.task_id == task_id).xcom_pull(task_ids=task_id, key=key)
