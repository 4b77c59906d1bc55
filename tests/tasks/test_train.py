"""The train step under real torchrun: 2 "nodes" (two agents, c10d rendezvous, gloo) on one
machine. Reproducibility, resume after a killed worker, resharding, retention, bad input."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from helpers import REPO_ROOT, RUNTIME_PY, error_lines, run_module, step_result, write_dataset

from tasks.config import load
from tasks.contract import TORCHRUN_MODULE, Rendezvous, torchrun_args
from tasks.lib import parallel, storage
from tasks.lib.errors import StepError
from tasks.lib.model import GPT, GPTConfig
from tasks.train import checkpoint, engines
from tasks.train.trainer import TrainState

pytestmark = pytest.mark.torchrun

FAST = ["--set", "log_every=5", "--set", "eval_every=10", "--set", "checkpoint_every=10",
        "--set", "warmup_steps=5", "--set", "micro_batch=2", "--set", "eval_batches=2"]
NO_MLFLOW = {"MLFLOW_TRACKING_URI": ""}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_nodes(nodes: int, args: list[str], logs: Path, env: dict[str, str] | None = None) -> list[subprocess.Popen[bytes]]:
    """One torchrun agent per node, like separate machines meeting on a rendezvous endpoint."""
    port = free_port()
    logs.mkdir(parents=True, exist_ok=True)
    return [
        subprocess.Popen(
            [str(RUNTIME_PY), "-m", TORCHRUN_MODULE,
             *torchrun_args(nodes=nodes, procs_per_node=1, rendezvous=Rendezvous(f"127.0.0.1:{port}", f"test-{port}"),
                            max_restarts=2, module="tasks.train", arguments=args)],
            cwd=REPO_ROOT, stdout=(logs / f"node{i}.log").open("wb"), stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(env or {})},
            start_new_session=True,
        )
        for i in range(nodes)
    ]


def finish(procs: list[subprocess.Popen[bytes]], logs: Path) -> dict[str, Any]:
    for proc in procs:
        proc.wait(timeout=600)
    text = (logs / "node0.log").read_text()
    assert all(p.returncode == 0 for p in procs), text[-4000:]
    line = next(x for x in reversed(text.splitlines()) if " result {" in x)
    loaded: dict[str, Any] = json.loads(line.split(" result ", 1)[1])
    return loaded


def train(tmp: Path, dataset: Path, nodes: int, steps: int, *extra: str, ckpt: Path | None = None) -> dict[str, Any]:
    args = ["--dataset", str(dataset), "--checkpoints", str(ckpt or tmp / "ckpt"), "--output", str(tmp / "model"),
            "--set", f"max_steps={steps}", *FAST, *extra]
    return finish(start_nodes(nodes, args, tmp / "logs", NO_MLFLOW), tmp / "logs")


def weights(model_dir: str) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(Path(model_dir) / "model.safetensors")


@pytest.fixture(scope="module")
def reference(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """An uninterrupted 2-node FSDP2 run of 30 steps, checkpoints every 10."""
    root = tmp_path_factory.mktemp("reference")
    return root, train(root, dataset, 2, 30)


def test_two_node_fsdp2_trains_and_loss_falls(reference: tuple[Path, dict[str, Any]]) -> None:
    root, result = reference
    assert result["world_size"] == 2 and result["engine"] == "fsdp2" and result["steps"] == 30
    assert result["malloc"] == "tcmalloc"  # the torchrun agent's CPU workers (tasks.lib.torchrun)
    # model FLOPs utilization against a matmul probe of the same process: a share, measured here
    assert 0.001 < result["mfu"] < 1 and result["peak_source"].startswith("measured fp32 matmul")
    log = (root / "logs" / "node0.log").read_text()
    losses = [float(x) for x in re.findall(r"step \d+/30 loss ([\d.]+)", log)]
    assert not re.search(r"step \d+/30 loss", (root / "logs" / "node1.log").read_text())  # rank 0 only
    uniform = math.log(1000)  # the test tokenizer's vocabulary: loss of a model that knows nothing
    assert losses[-1] < uniform - 0.8 and losses[-1] < losses[0], losses
    config = json.loads((Path(result["model_uri"]) / "config.json").read_text())
    model = GPT(GPTConfig(**config["config"]))
    # the consolidated model loads unsharded (the tied head is stored once, as the embedding)
    assert set(weights(result["model_uri"])) == set(model.state_dict()) - {"head.weight"}
    safetensors.torch.load_model(model, Path(result["model_uri"]) / "model.safetensors", strict=True)


def test_same_seed_data_and_world_give_bit_identical_weights(
    reference: tuple[Path, dict[str, Any]], dataset: Path, tmp_path: Path
) -> None:
    again = train(tmp_path, dataset, 2, 30)
    ref, new = weights(reference[1]["model_uri"]), weights(again["model_uri"])
    assert all(torch.equal(ref[k], new[k]) for k in ref)


def test_bf16_autocast_on_cpus_keeps_fp32_weights(
    reference: tuple[Path, dict[str, Any]], dataset: Path, tmp_path: Path
) -> None:
    """train.precision bf16 on CPUs: the 2-node FSDP2 step computes in bf16 autocast (its loss
    differs from the fp32 reference's, close to it), the weights it saves are fp32, and its MFU is
    against a bf16 matmul probe."""
    result = train(tmp_path, dataset, 2, 30, "--set", "precision=bf16")
    assert reference[1]["precision"] == "fp32" and result["precision"] == "bf16"
    assert result["final_loss"] != reference[1]["final_loss"]
    assert abs(result["final_loss"] - reference[1]["final_loss"]) < 0.1, (result["final_loss"], reference[1]["final_loss"])
    assert "bf16" in result["peak_source"]
    assert {w.dtype for w in weights(result["model_uri"]).values()} == {torch.float32}


def test_freeing_weights_after_forward_changes_communication_not_the_math(
    reference: tuple[Path, dict[str, Any]], dataset: Path, tmp_path: Path
) -> None:
    """The reference keeps the gathered weights for the backward (auto on CPUs: the whole model one
    FSDP2 unit); freeing each block's after its forward takes a unit per block and gathers them
    again: other collectives, the same values, so the same weights, bit for bit."""
    freed = train(tmp_path, dataset, 2, 30, "--set", "reshard_after_forward=true")
    ref, new = weights(reference[1]["model_uri"]), weights(freed["model_uri"])
    assert all(torch.equal(ref[k], new[k]) for k in ref)


@pytest.mark.parametrize("engine", ["fsdp2", "ddp"])
def test_gradient_accumulation_without_sync_matches_one_big_batch(dataset: Path, tmp_path: Path, engine: str) -> None:
    """2 micro-batches of 2 (gradients reduced on the second only) give the weights of 1 batch of 4:
    no micro-batch's gradient is lost by skipping its reduction. (Float summation order differs:
    ~1.5e-5 after 6 steps with or without the skipped reductions; reducing after the wrong
    micro-batch instead: 2.3e-2.)"""
    common = ["--set", f"engine={engine}", "--set", "max_steps=6", "--set", "warmup_steps=2"]
    big = train(tmp_path / "big", dataset, 2, 6, *common, "--set", "micro_batch=4", "--set", "grad_accum=1")
    accumulated = train(tmp_path / "acc", dataset, 2, 6, *common, "--set", "micro_batch=2", "--set", "grad_accum=2")
    ref, new = weights(big["model_uri"]), weights(accumulated["model_uri"])
    assert max((ref[k] - new[k]).abs().max().item() for k in ref) < 1e-4


def test_killed_worker_restarts_and_resumes_to_the_same_result(
    reference: tuple[Path, dict[str, Any]], dataset: Path, tmp_path: Path
) -> None:
    args = ["--dataset", str(dataset), "--checkpoints", str(tmp_path / "ckpt"), "--output", str(tmp_path / "model"),
            "--set", "max_steps=30", *FAST]
    procs = start_nodes(2, args, tmp_path / "logs", NO_MLFLOW)
    node0 = tmp_path / "logs" / "node0.log"  # rank 0 logs the progress of all
    deadline = time.monotonic() + 300
    while "step 15/30" not in node0.read_text(errors="replace"):  # past the step-10 checkpoint
        assert time.monotonic() < deadline and procs[1].poll() is None, node0.read_text()[-3000:]
        time.sleep(0.2)
    worker = psutil.Process(procs[1].pid).children(recursive=True)[0]
    worker.send_signal(signal.SIGKILL)
    result = finish(procs, tmp_path / "logs")
    assert result["resumed_from"] and result["resumed_from"].endswith("step-00000010")
    assert abs(result["final_loss"] - reference[1]["final_loss"]) < 1e-4
    ref, new = weights(reference[1]["model_uri"]), weights(result["model_uri"])
    assert max((ref[k] - new[k]).abs().max().item() for k in ref) < 1e-5


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no GPU: run on a GPU machine (pinned buffers, background copy)"))])
def test_a_save_returns_before_its_write_and_holds_the_state_of_its_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    """In one process (no process group) as in many, a save only copies the state and returns:
    the write happens while the next steps update the weights in place, and must not see them."""
    release = threading.Event()

    class HeldWriter(dcp.FileSystemWriter):  # the storage takes its time: until the test lets it
        def write_data(self, plan: Any, planner: Any) -> Any:
            assert release.wait(timeout=60), "the write was not released"
            return super().write_data(plan, planner)

    monkeypatch.setattr(checkpoint, "_writer", HeldWriter)
    size = 2048 if device == "cuda" else 4  # on a GPU: big enough for the background copy to take time
    model = torch.nn.Linear(size, size).to(device)
    engine = engines.Engine(model, load().train, parallel.Dist(0, 1, 0, torch.device(device)),
                            lambda m: torch.optim.AdamW(m.parameters()))
    saver = checkpoint.Checkpointer(checkpoint.CheckpointStore(str(tmp_path), keep_last=2, rank=0),
                                    checkpoint.DCPFormat(async_save=True))
    at_save = {k: v.cpu().clone() for k, v in model.state_dict().items()}
    saver.save(engine, TrainState(step=1).state_dict())  # returns with the write held
    saver.before_update()  # as the loop does before its next optimizer step
    with torch.no_grad():
        model.weight.add_(1.0)  # the next optimizer step
    release.set()
    saver.close()
    assert len(saver.save_seconds) == 1 and saver.stalls[0] < saver.save_seconds[0]
    restored = torch.nn.Linear(size, size)
    checkpoint.load_model_weights(checkpoint.list_complete(str(tmp_path))[-1].uri, restored)
    assert all(torch.equal(restored.state_dict()[k], at_save[k]) for k in at_save)


def test_checkpoint_of_two_ranks_resumes_on_one_and_back(
    reference: tuple[Path, dict[str, Any]], dataset: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    # 2 -> 1: continue the reference run's checkpoints in a single process
    import shutil

    shutil.copytree(reference[0] / "ckpt", ckpt)
    one = train(tmp_path / "a", dataset, 1, 40, ckpt=ckpt)
    assert one["world_size"] == 1 and one["resumed_from"].endswith("step-00000030") and one["steps"] == 40
    # 1 -> 2
    two = train(tmp_path / "b", dataset, 2, 50, ckpt=ckpt)
    assert two["world_size"] == 2 and two["resumed_from"].endswith("step-00000040")
    # and a checkpoint loads without any process group, into a plain model
    config = GPTConfig(**json.loads((Path(two["model_uri"]) / "config.json").read_text())["config"])
    plain = GPT(config)
    checkpoint.load_model_weights(checkpoint.list_complete(str(ckpt))[-1].uri, plain)
    final = weights(two["model_uri"])
    assert all(torch.equal(plain.state_dict()[k], final[k]) for k in final)


def test_retrain_starts_from_the_given_model_and_keeps_that_on_resume(
    reference: tuple[Path, dict[str, Any]], dataset: Path, tmp_path: Path
) -> None:
    """train.init_from: champion loads the named model before sharding (lr 0: the weights come
    out as they went in); the checkpoint remembers it, so a resumed run still reports it; a
    model of another architecture, or init_from: scratch, starts from the seeded random init."""
    parent = reference[1]["model_uri"]
    frozen = ["--set", "lr=0", "--set", "warmup_steps=0", "--init-from", parent]
    started = train(tmp_path / "a", dataset, 2, 10, *frozen, ckpt=tmp_path / "ckpt")
    assert started["initialized_from"] == parent
    ref, new = weights(parent), weights(started["model_uri"])
    assert all(torch.equal(ref[k], new[k]) for k in ref)
    resumed = train(tmp_path / "b", dataset, 2, 20, *frozen, ckpt=tmp_path / "ckpt")
    assert resumed["resumed_from"].endswith("step-00000010") and resumed["initialized_from"] == parent
    assert json.loads((Path(resumed["model_uri"]) / "config.json").read_text())["initialized_from"] == parent

    other = train(tmp_path / "c", dataset, 1, 1, *frozen, "--set", "presets.cpu-tiny.n_layers=2")
    assert other["initialized_from"] is None
    assert "not starting from" in (tmp_path / "c" / "logs" / "node0.log").read_text()
    scratch = train(tmp_path / "d", dataset, 1, 1, *frozen, "--set", "init_from=scratch")
    assert scratch["initialized_from"] is None
    assert not torch.equal(weights(scratch["model_uri"])["embed.weight"], ref["embed.weight"])

    # a champion of the old layout (format 1: no format_version, GELU MLP) loads, and a retrain
    # from it starts from scratch with one line saying why
    legacy = write_legacy_model(Path(parent), tmp_path / "legacy")
    from tasks.lib.model_store import load_model_dir

    with storage.scratch() as folder:
        assert load_model_dir(str(legacy), folder).model.config.layout == "gpt-v1"
    fresh = train(tmp_path / "e", dataset, 1, 1, *frozen[:-1], str(legacy))
    assert fresh["initialized_from"] is None
    assert "it is a format 1 model (gpt-v1 layout) and this run trains the llama layout" in \
        (tmp_path / "e" / "logs" / "node0.log").read_text()


def write_legacy_model(model_dir: Path, out: Path) -> Path:
    """A train step's output as code before the Llama layout wrote it: config.json without a
    format version (mlp_ratio, no layout), the gpt-v1 module's weights."""
    description = json.loads((model_dir / "config.json").read_text())
    del description["format_version"]
    config = description["config"]
    legacy = {k: config[k] for k in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "rope_theta")}
    description["config"] = {**legacy, "mlp_ratio": 4}
    model = GPT(GPTConfig.from_saved(description["config"], 1))
    with storage.staged_output(str(out)) as staged:
        torch.save(model.state_dict(), staged / "model.pt")
        (staged / "config.json").write_text(json.dumps(description))
    return out


def test_retention_keeps_last_two_and_best(reference: tuple[Path, dict[str, Any]]) -> None:
    complete = checkpoint.list_complete(str(reference[0] / "ckpt"))
    steps = [c.step for c in complete]
    best = min(complete, key=lambda c: c.trainer["val_loss"]).step
    assert steps[-2:] == [20, 30] and set(steps) == {20, 30, best}
    assert all((reference[0] / "ckpt" / f"step-{s:08d}" / ".metadata").exists() for s in steps)


@pytest.mark.parametrize(
    ("setup", "extra", "message"),
    [
        ("missing", [], "not a complete step output"),
        ("vocab", [], "token id 200 >= model vocab 100 (dtype/vocab mismatch)"),
        ("ok", ["--set", "grad_accum=100000"], "sequences exceeds the"),
        ("ok", ["--set", "preset=gpu-1b", "--set", "micro_batch=64"], "needs ~"),
        ("ok", ["--set", "preset=nope"], "train.preset 'nope': expected one of cpu-tiny,"),
        ("ok", ["--set", "reshard_after_forward=sometimes"], "train.reshard_after_forward 'sometimes': expected"),
        ("ok", ["--set", "precision=half"], "train.precision 'half': expected one of auto, bf16, fp32"),
        ("ok", ["--set", "precision=bf16", "--set", "engine=deepspeed"], "train.precision bf16 on CPUs: use engine"),
        # a learning rate that blows the weights up: stopped at the first non-finite gradient
        ("ok", ["--set", "lr=1e30", "--set", "warmup_steps=0", "--set", "max_steps=50"], "training diverged at step"),
    ],
    ids=["missing-dataset", "vocab-mismatch", "batch-bigger-than-data", "preset-does-not-fit", "unknown-preset",
         "unknown-reshard-setting", "unknown-precision", "bf16-deepspeed-on-cpu", "diverging-loss"],
)
def test_bad_input_fails_before_any_step(
    dataset: Path, tmp_path: Path, setup: str, extra: list[str], message: str
) -> None:
    import numpy as np

    data = {"missing": tmp_path / "none", "ok": dataset,
            "vocab": write_dataset(tmp_path / "v", np.full(5000, 200, dtype=np.uint16), 100)}[setup]
    proc = run_module("tasks.train", "--dataset", str(data), "--checkpoints", str(tmp_path / "ckpt"),
                      "--output", str(tmp_path / "model"), *extra, env=NO_MLFLOW)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in error_lines(proc)[0]
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "model").exists()


@pytest.mark.integration
def test_node_local_dataset_copy_is_content_keyed_and_leaves_nothing(stack_env: dict[str, str], dataset: Path,
                                                                     tmp_path: Path) -> None:
    """An S3 dataset is copied once per node under its manifest's hash; a failed copy leaves no
    staging folder, a successful run removes its copy."""
    from tasks.lib import storage
    from tasks.lib.data import DATASET_CACHE, local_dataset

    uri = f"s3://pipeline/tests/{time.time_ns()}/dataset"
    with storage.staged_output(uri) as out:
        for path in dataset.iterdir():
            if path.name != storage.SUCCESS_MARKER:
                (out / path.name).write_bytes(path.read_bytes())
    before = set(DATASET_CACHE.iterdir()) if DATASET_CACHE.exists() else set()
    copy = local_dataset(uri)
    assert copy.parent == DATASET_CACHE and (copy / "index.json").exists() and local_dataset(uri) == copy
    shutil.rmtree(copy)
    # a dataset whose file vanished: the copy fails, nothing is left behind
    bucket, key = storage.split_s3(storage.join(uri, "index.json"))
    storage.s3_client().delete_object(Bucket=bucket, Key=key)
    with pytest.raises(StepError, match=r"index\.json: missing or differs from its _SUCCESS manifest .* read twice"):
        local_dataset(uri)
    assert set(DATASET_CACHE.iterdir()) == before
    # a whole run from S3 removes its node-local copy at the end
    with storage.staged_output(uri) as out:
        for path in dataset.iterdir():
            if path.name != storage.SUCCESS_MARKER:
                (out / path.name).write_bytes(path.read_bytes())
    proc = run_module("tasks.train", "--dataset", uri, "--checkpoints", str(tmp_path / "ckpt"), "--output",
                      str(tmp_path / "model"), "--set", "max_steps=2", *FAST, env=NO_MLFLOW)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert set(DATASET_CACHE.iterdir()) == before


@pytest.mark.integration
def test_mlflow_run_per_dag_run_with_metrics_curve_and_model(stack_env: dict[str, str], dataset: Path,
                                                              tmp_path: Path) -> None:
    from mlflow import MlflowClient

    tag = f"llm_retrain/test-{time.time_ns()}"
    args = ["--dataset", str(dataset), "--checkpoints", f"s3://pipeline/tests/{tag}/ckpt",
            "--output", f"s3://pipeline/tests/{tag}/model", "--mlflow-run-tag", tag, *FAST]
    first = step_result(run_module("tasks.train", *args, "--set", "max_steps=10"))
    again = step_result(run_module("tasks.train", *args, "--set", "max_steps=20"))  # a retry that continues
    assert first["mlflow_run_id"] == again["mlflow_run_id"]
    assert str(again["resumed_from"]).endswith("step-00000010")
    client = MlflowClient()
    run = client.get_run(str(again["mlflow_run_id"]))
    assert run.data.tags["dag_run"] == tag and run.data.params["engine"] == "fsdp2"
    assert run.data.tags["malloc"] == "glibc"  # a plain python -m tasks.train: no agent preloaded tcmalloc
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [5, 10, 15, 20]
    for metric in ("tokens_per_s", "data_loading_share", "checkpoint_time_s", "val_loss", "step_time_s",
                   "checkpoint_stall_s", "checkpoint_save_s", "eval_share", "mfu"):
        assert metric in run.data.metrics
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"model", "loss_curve.png"} <= artifacts
    assert {a.path for a in client.list_artifacts(run.info.run_id, "model")} == {"model/config.json", "model/model.safetensors"}


@pytest.mark.integration
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_trains_checkpoints_to_s3_and_resumes(
    stack_env: dict[str, str], dataset: Path, tmp_path: Path, stage: int
) -> None:
    ckpt = f"s3://pipeline/tests/deepspeed-{time.time_ns()}/ckpt"
    extra = ["--set", "engine=deepspeed", "--set", f"deepspeed_stage={stage}"]
    args = ["--dataset", str(dataset), "--checkpoints", ckpt, "--output", str(tmp_path / "model"), *FAST, *extra]
    first = finish(start_nodes(2, [*args, "--set", "max_steps=10"], tmp_path / "a", NO_MLFLOW), tmp_path / "a")
    assert first["engine"] == "deepspeed" and first["steps"] == 10 and first["resumed_from"] is None
    second = finish(start_nodes(2, [*args, "--set", "max_steps=20"], tmp_path / "b", NO_MLFLOW), tmp_path / "b")
    assert second["resumed_from"].endswith("step-00000010") and second["steps"] == 20
    assert second["final_loss"] < math.log(1000) - 0.5
    # ZeRO partitions of both ranks and the completion marker are on S3
    from tasks.lib import storage

    names = {u.rsplit("/", 1)[1] for u in storage.list_files(f"{ckpt}/step-00000020")}
    assert {".metadata", "trainer.json"} <= names
    assert sum("zero_pp_rank_" in n for n in names) >= 2
    config = GPTConfig(**json.loads((tmp_path / "model" / "config.json").read_text())["config"])
    safetensors.torch.load_model(GPT(config), tmp_path / "model" / "model.safetensors")  # consolidated, unsharded


def test_ddp_engine_matches_fsdp2(reference: tuple[Path, dict[str, Any]], dataset: Path, tmp_path: Path) -> None:
    """Same model, data and seed: DDP and FSDP2 follow the same loss curve, up to the order of
    floating-point reductions (all-reduce vs reduce-scatter): 0.005 apart after 30 steps here."""
    ddp = train(tmp_path, dataset, 2, 30, "--set", "engine=ddp")
    assert ddp["engine"] == "ddp" and ddp["world_size"] == 2
    assert abs(ddp["final_loss"] - reference[1]["final_loss"]) < 0.02


def test_compiled_blocks_train_the_same_model_under_the_same_names(reference: tuple[Path, dict[str, Any]],
                                                                   dataset: Path, tmp_path: Path) -> None:
    """train.compile: inductor kernels for each block, FSDP2 over them. The loss curve is the
    eager one up to the order of floating-point operations, and the saved names are the same
    (checkpoints, warm starts and the export read them)."""
    compiled = train(tmp_path, dataset, 2, 30, "--set", "compile=true")
    assert abs(compiled["final_loss"] - reference[1]["final_loss"]) < 0.02
    assert weights(compiled["model_uri"]).keys() == weights(reference[1]["model_uri"]).keys()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU: run on a GPU machine (docs/testing.md)")
def test_on_a_gpu_a_killed_worker_resumes_the_bf16_compiled_run(tmp_path: Path) -> None:
    """gpu-125m as a GPU pod trains it: FSDP2 over NCCL, bf16 autocast, compiled blocks, checkpoints
    staged on a side stream. A worker SIGKILLed once the step-20 checkpoint is complete (written in
    the background: on a GPU the loop is steps ahead by then, and a worker killed earlier resumes
    from step 10) is restarted by torchrun, resumes there and ends where an uninterrupted run
    ends, up to the GPU kernels' own nondeterminism (atomics in the embedding's backward)."""
    rng = np.random.default_rng(0)
    vocab = 4096
    ramp = np.tile(np.arange(vocab, dtype=np.uint16), 300)
    tokens = np.where(rng.random(ramp.size) < 0.1, rng.integers(0, vocab, ramp.size), ramp).astype(np.uint16)
    dataset = write_dataset(tmp_path / "dataset", tokens, vocab)
    gpu = ["--set", "preset=gpu-125m", "--set", "micro_batch=8", "--set", "max_steps=40", "--set", "log_every=5",
           "--set", "eval_every=10", "--set", "checkpoint_every=10", "--set", "warmup_steps=5", "--set", "eval_batches=2"]

    def run(name: str, kill_after: str | None = None) -> dict[str, Any]:
        args = ["--dataset", str(dataset), "--checkpoints", str(tmp_path / name / "ckpt"),
                "--output", str(tmp_path / name / "model"), *gpu]
        procs = start_nodes(1, args, tmp_path / name / "logs", NO_MLFLOW)
        log_file = tmp_path / name / "logs" / "node0.log"
        deadline = time.monotonic() + 600
        while kill_after and kill_after not in log_file.read_text(errors="replace"):
            assert time.monotonic() < deadline and procs[0].poll() is None, log_file.read_text()[-3000:]
            time.sleep(0.2)
        if kill_after:
            psutil.Process(procs[0].pid).children(recursive=True)[0].send_signal(signal.SIGKILL)
        return finish(procs, tmp_path / name / "logs")

    whole, again = run("whole"), run("again")
    resumed = run("resumed", kill_after="checkpoint step 20 complete")
    assert whole["precision"] == "bf16" and whole["engine"] == "fsdp2" and whole["resumed_from"] is None
    assert resumed["resumed_from"] and resumed["resumed_from"].endswith("step-00000020")

    def apart(other: dict[str, Any]) -> tuple[float, float]:
        ref, new = weights(whole["model_uri"]), weights(other["model_uri"])
        return abs(other["final_loss"] - whole["final_loss"]), max((ref[k] - new[k]).abs().max().item() for k in ref)

    # the GPU's own nondeterminism: how far a second uninterrupted run ends from the first
    (noise_loss, noise_weight), (loss_diff, weight_diff) = apart(again), apart(resumed)
    print(f"gpu resume: final loss {whole['final_loss']:.4f}; an uninterrupted rerun ends {noise_loss:.2e} / "
          f"{noise_weight:.2e} away (loss / largest weight difference), the resumed run {loss_diff:.2e} / "
          f"{weight_diff:.2e}; {whole['tokens_per_s']:.0f} tokens/s")
    assert loss_diff <= 2 * max(noise_loss, 1e-3) and weight_diff <= 2 * max(noise_weight, 1e-3)
