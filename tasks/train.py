"""Train the GPT on the tokenized dataset: FSDP2 (default) / DDP / single process, launched by
``torchrun`` (c10d rendezvous), with sharded, resumable checkpoints and MLflow tracking.

    torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT \\
        -m tasks.train --dataset URI --checkpoints URI --output URI [--set engine=ddp ...]

Every start (first run, torchrun restart after a worker died, Airflow retry) resumes from the
newest complete checkpoint under ``--checkpoints`` (model, optimizer, step, data position).
Rank 0 logs to the MLflow run of the DAG run (found by tag, so retries reuse it) and writes the
consolidated model: ``model.safetensors`` (state dict) + ``config.json`` (architecture, tokenizer).

A retrain continues from the production model (``train.init_from: champion``, ``--init-from``
naming the version the tokenizer step pinned) when it has this run's architecture and
vocabulary; otherwise, or with ``init_from: scratch``, it starts from a random initialization.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tasks.lib import parallel, storage
from tasks.lib.checkpoint import TRAINER_FIELDS, Checkpointer, list_complete
from tasks.lib.data import BatchSampler, TokenSplit, open_split
from tasks.lib.errors import StepError
from tasks.lib.model import FORMAT_VERSION, GPT, GPTConfig
from tasks.lib.model_store import WEIGHTS_FILE, save_model_files
from tasks.lib.params import step_params
from tasks.lib.step import log, run_step, step_parser
from tasks.lib.torchrun import malloc_in_use
from tasks.lib.tracking import Tracker

BYTES_PER_PARAM_TRAINING = 16  # fp32 weights + grads + two AdamW moments


def model_config(params: dict[str, Any], vocab_size: int) -> GPTConfig:
    presets = params["presets"]
    if params["preset"] not in presets:
        raise StepError(f"train.preset {params['preset']!r}: unknown (presets: {', '.join(presets)})")
    try:
        return GPTConfig(vocab_size=vocab_size, **presets[params["preset"]])
    except (TypeError, ValueError) as exc:
        raise StepError(f"train.presets.{params['preset']}: {exc}") from None


def check_data(split: TokenSplit, config: GPTConfig, name: str) -> None:
    """Token ids must fit the model's vocabulary (catches dtype/vocab mix-ups before step 0)."""
    top = int(split.tokens.max())
    if top >= config.vocab_size:
        raise StepError(f"{name} split: token id {top} >= model vocab {config.vocab_size} (dtype/vocab mismatch)")


def check_fits(config: GPTConfig, params: dict[str, Any], env: parallel.Dist, train: BatchSampler) -> None:
    """Refuse a preset/batch that cannot fit memory or the data, before any training step."""
    fully_sharded = params["engine"] == "fsdp2" or (params["engine"] == "deepspeed" and params["deepspeed_stage"] == 3)
    if fully_sharded:
        state_bytes = config.num_params() * BYTES_PER_PARAM_TRAINING / env.world
        if params["engine"] == "fsdp2":  # blocks that keep their gathered weights for the backward
            kept = parallel.reshard_after_forward(params["reshard_after_forward"], env.device, config.n_layers).count(False)
            state_bytes += config.num_params() * kept / config.n_layers * (
                2 if parallel.bf16_weights(env.device, params["precision"]) else 4)
    elif params["engine"] == "deepspeed":  # ZeRO-2: weights whole, gradients and optimizer state sharded
        state_bytes = config.num_params() * (4 + (BYTES_PER_PARAM_TRAINING - 4) / env.world)
    else:
        state_bytes = config.num_params() * BYTES_PER_PARAM_TRAINING
    # activations kept for backward: ~34 * d_model bytes per token and layer, plus the logits
    per_token = (34 * config.d_model * config.n_layers) / (4 if params["activation_checkpointing"] else 1)
    act_bytes = params["micro_batch"] * config.seq_len * (per_token + 8 * config.vocab_size)
    need = state_bytes + act_bytes
    if env.device.type == "cuda":
        available = torch.cuda.mem_get_info(env.device)[0]  # free, not total: the GPU may be shared
    else:
        import psutil

        available = psutil.virtual_memory().available / max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    if need > 0.9 * available:
        raise StepError(
            f"preset {params['preset']} ({config.num_params() / 1e6:.0f}M params) with micro_batch "
            f"{params['micro_batch']} needs ~{need / 2**30:.1f} GiB per process, {available / 2**30:.1f} GiB available"
        )
    global_batch = params["micro_batch"] * params["grad_accum"] * env.world
    if global_batch > train.windows:
        raise StepError(
            f"global batch of {global_batch} sequences exceeds the {train.windows} sequences of "
            f"{config.seq_len} tokens in the train split"
        )


def initial_weights(uri: str, config: GPTConfig, tokenizer_hash: str) -> dict[str, torch.Tensor] | None:
    """The weights to start from: those of ``uri`` (``models:/NAME/VERSION`` or a train step's
    model folder) when its architecture and tokenizer are this run's, else None (logged): a
    changed preset or vocabulary starts from scratch rather than failing the retrain."""
    from tasks.lib.model_store import load_model_dir, load_version

    with storage.scratch() as scratch:
        if uri.startswith("models:/"):
            name, _, version = uri.removeprefix("models:/").rpartition("/")
            if not name or not version.isdigit():
                raise StepError(f"--init-from {uri!r}: expected models:/NAME/VERSION or a model folder URI")
            loaded = load_version(name, version)
        else:
            loaded = load_model_dir(uri, scratch)
    if loaded.model.config.layout != config.layout:
        log.warning("not starting from %s: it is a format %d model (%s layout) and this run trains the %s "
                    "layout (format %d): a new architecture starts from scratch", uri,
                    loaded.description.get("format_version", 1), loaded.model.config.layout, config.layout,
                    FORMAT_VERSION)
        return None
    if loaded.model.config != config:
        log.warning("not starting from %s: its architecture %s is not this run's %s", uri,
                    loaded.model.config.to_dict(), config.to_dict())
        return None
    if loaded.description["tokenizer_hash"] != tokenizer_hash:
        log.warning("not starting from %s: its tokenizer %s is not the dataset's %s", uri,
                    loaded.description["tokenizer_hash"][:12], tokenizer_hash[:12])
        return None
    return loaded.model.state_dict()


def lr_at(step: int, params: dict[str, Any]) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio * lr``."""
    lr, warmup, total = float(params["lr"]), int(params["warmup_steps"]), int(params["max_steps"])
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    floor = lr * float(params["min_lr_ratio"])
    return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, params: dict[str, Any]) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": float(params["weight_decay"])}, {"params": no_decay, "weight_decay": 0.0}],
        lr=float(params["lr"]),
        betas=tuple(params["betas"]),
        # one kernel per operation over all parameters: PyTorch's default on GPUs only; on CPUs
        # the per-parameter loop cost FSDP2's sharded parameters ~9 ms a step (2x the foreach step)
        foreach=True,
    )


def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; through the wrapper's forward (FSDP2 / DDP hooks)."""
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))


@torch.no_grad()
def evaluate(model: torch.nn.Module, sampler: BatchSampler, params: dict[str, Any], env: parallel.Dist) -> float:
    """Mean loss over the same ``eval_batches`` val batches every time."""
    model.eval()
    total = torch.zeros((), device=env.device)
    for i in range(int(params["eval_batches"])):
        x, y = sampler.batch(i * params["micro_batch"] * env.world, env.rank, env.world)
        with torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=parallel.use_bf16(env.device, params["precision"])):
            total += loss_fn(model, x.to(env.device), y.to(env.device))
    model.train()
    return float(parallel.all_reduce_mean(total / int(params["eval_batches"]), env))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


DATASET_CACHE = Path(tempfile.gettempdir()) / "llm-pipeline-datasets"


def local_dataset(uri: str) -> Path:
    """The dataset folder on local disk (memory-mapping needs files; S3 is downloaded once per
    node). The node's copy is named by its manifest's hash, so it is only ever reused for the
    same content (a retry on this node skips the download); a failed download leaves nothing."""
    if not storage.is_s3(uri):
        storage.require_complete(uri)
        return Path(uri)
    manifest = storage.read_manifest(uri)
    manifest_text = json.dumps(manifest, indent=1, sort_keys=True).encode()
    cache = DATASET_CACHE / hashlib.sha256(manifest_text).hexdigest()[:24]
    if not (cache / storage.SUCCESS_MARKER).exists():
        # ranks of a node race to the same folder: each downloads aside, the first rename wins
        cache.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{cache.name}-", dir=cache.parent))
        try:
            storage.download_tree(uri, staging, manifest)
            (staging / storage.SUCCESS_MARKER).write_bytes(manifest_text)
            staging.rename(cache)
        except OSError as exc:
            if not (cache / storage.SUCCESS_MARKER).exists():
                raise RuntimeError(f"{uri}: node-local copy failed ({exc})") from None
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # the loser's copy, or a failed download's
    return cache


def drop_local_dataset(dataset_dir: Path, env: parallel.Dist) -> None:
    """After a successful run: the node's copy goes (one process per node, once all are done)."""
    if DATASET_CACHE in dataset_dir.parents and env.local_rank == 0:
        shutil.rmtree(dataset_dir, ignore_errors=True)


def train(args: argparse.Namespace) -> dict[str, Any]:
    params = step_params("train", args.overrides)
    env = parallel.init_distributed()
    try:
        return _train(args, params, env)
    finally:
        parallel.shutdown()


def _train(args: argparse.Namespace, params: dict[str, Any], env: parallel.Dist) -> dict[str, Any]:
    if params["engine"] not in parallel.ENGINES:
        raise StepError(f"train.engine {params['engine']!r}: expected one of {', '.join(parallel.ENGINES)}")
    if params["precision"] not in parallel.PRECISIONS:
        raise StepError(f"train.precision {params['precision']!r}: expected one of {', '.join(parallel.PRECISIONS)}")
    if params["init_from"] not in ("champion", "scratch"):
        raise StepError(f"train.init_from {params['init_from']!r}: expected champion or scratch")
    for switch in ("compile", "reshard_after_forward"):  # settings decided per device by auto
        if params[switch] not in (True, False, "auto"):
            raise StepError(f"train.{switch} {params[switch]!r}: expected true, false or auto")
    bf16 = parallel.use_bf16(env.device, params["precision"])
    if bf16 and params["engine"] == "deepspeed" and env.device.type != "cuda":
        raise StepError("train.precision bf16 on CPUs: use engine fsdp2, ddp or single (DeepSpeed runs fp32 there)")
    if params["engine"] == "deepspeed" and "WORLD_SIZE" not in os.environ:
        raise StepError("train.engine deepspeed runs under torchrun (no WORLD_SIZE in the environment)")
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))))
    dataset_dir = local_dataset(args.dataset)
    train_split, val_split = open_split(dataset_dir, "train"), open_split(dataset_dir, "val")
    config = model_config(params, train_split.vocab_size)
    check_data(train_split, config, "train")
    check_data(val_split, config, "val")
    train_sampler = BatchSampler(train_split.tokens, config.seq_len, params["micro_batch"], params["seed"])
    val_sampler = BatchSampler(val_split.tokens, config.seq_len, params["micro_batch"], params["seed"] + 1)
    check_fits(config, params, env, train_sampler)

    checkpointer = Checkpointer(args.checkpoints, int(params["keep_last"]), bool(params["async_checkpoint"]), env.rank)
    latest = checkpointer.latest()
    seed_everything(int(params["seed"]))
    gpt = GPT(config)
    # a resumed run takes its weights from the checkpoint: the starting point matters only once
    init_uri = args.init_from if params["init_from"] == "champion" and latest is None else ""
    start_weights = initial_weights(init_uri, config, train_split.tokenizer_hash) if init_uri else None
    if start_weights is not None:
        gpt.load_state_dict(start_weights)
    gpt.activation_checkpointing = bool(params["activation_checkpointing"])
    if parallel.compile_wanted(params["compile"], env.device):
        parallel.compile_blocks(gpt)
    engine = parallel.build_engine(gpt, params["engine"], params, env, lambda m: build_optimizer(m, params))

    state: dict[str, Any] = {**TRAINER_FIELDS, "initialized_from": init_uri if start_weights is not None else None}
    if latest is not None:
        state.update(checkpointer.load(latest, engine))
    tracker = Tracker(env.is_main, params, args.mlflow_run_tag)
    tracker.start(config, env, resumed_from=latest.uri if latest else None, dataset=args.dataset,
                  initialized_from=state["initialized_from"])

    max_steps, accum = int(params["max_steps"]), int(params["grad_accum"])
    global_batch = params["micro_batch"] * accum * env.world
    tokens_per_step = global_batch * config.seq_len
    malloc = malloc_in_use()
    log.info(
        "training %s (%.2fM params) engine=%s rank %d/%d pid %d on %s (%s, malloc: %s): %d steps x %d tokens, from step %d of %s",
        params["preset"], config.num_params() / 1e6, params["engine"], env.rank, env.world, os.getpid(),
        env.device, "bf16" if bf16 else "fp32", malloc, max_steps, tokens_per_step, state["step"],
        latest.uri if latest else state["initialized_from"] or "a random initialization",
    )
    peak_before = parallel.peak_flops(env.device, bf16)  # MFU's peak: probed before and after the loop
    window_start, window_tokens, data_seconds, window_steps = time.perf_counter(), 0, 0.0, 0
    total_data_seconds = eval_seconds = 0.0
    train_start = time.perf_counter()
    started_step = state["step"]
    while state["step"] < max_steps:
        step = state["step"]
        engine.set_lr(lr_at(step, params))
        step_loss = torch.zeros((), device=env.device)
        for micro in range(accum):
            t0 = time.perf_counter()
            x, y = train_sampler.batch(state["samples_seen"] + micro * params["micro_batch"] * env.world, env.rank, env.world)
            x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
            loading = time.perf_counter() - t0
            data_seconds += loading
            total_data_seconds += loading
            with engine.gradient_sync(micro == accum - 1):
                with torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=bf16):
                    loss = loss_fn(engine.model, x, y)
                engine.backward(loss, accum)
            step_loss += loss.detach() / accum
        checkpointer.before_update()  # the last save's background copy of the weights must be done
        try:
            grad_norm = engine.step(float(params["grad_clip"]))
        except FloatingPointError as exc:  # retrying from the last checkpoint would diverge again
            raise StepError(f"training diverged at step {step + 1}: {exc} (loss {float(step_loss):.4g} on rank "
                            f"{env.rank}); not applied, nothing saved from it: lower train.lr or check the data") from None
        state["step"] = step + 1
        state["samples_seen"] += global_batch
        window_tokens += tokens_per_step
        window_steps += 1

        if state["step"] % int(params["log_every"]) == 0 or state["step"] == max_steps:
            loss_value = state["loss"] = float(parallel.all_reduce_mean(step_loss, env))
            elapsed = time.perf_counter() - window_start
            rate = window_tokens / elapsed
            done = state["step"] - started_step
            eta = (max_steps - state["step"]) * (time.perf_counter() - train_start) / max(done, 1)
            metrics = {
                "loss": loss_value,
                "lr": lr_at(step, params),
                "grad_norm": float(grad_norm),
                "tokens_per_s": rate,
                "step_time_s": elapsed / window_steps,
                "data_loading_share": data_seconds / elapsed,
                "checkpoint_time_s": checkpointer.blocking_seconds,
                "epoch": train_sampler.epoch_of(state["samples_seen"]),
            }
            if env.is_main:  # the loss is already averaged over ranks: one line per step, not one per node
                log.info(
                    "step %d/%d loss %.4f lr %.2e %.0f tok/s step %.3fs data %.1f%% ETA %.0fs",
                    state["step"], max_steps, loss_value, metrics["lr"], rate, metrics["step_time_s"],
                    100 * metrics["data_loading_share"], eta,
                )
            tracker.log_metrics(metrics, state["step"])
            window_start, window_tokens, data_seconds, window_steps = time.perf_counter(), 0, 0.0, 0

        last = state["step"] == max_steps
        if state["step"] % int(params["eval_every"]) == 0 or last:
            eval_started = time.perf_counter()
            state["val_loss"] = evaluate(engine.model, val_sampler, params, env)
            eval_seconds += time.perf_counter() - eval_started
            if state["best_val_loss"] is None or state["val_loss"] < state["best_val_loss"]:
                state["best_val_loss"] = state["val_loss"]
            if env.is_main:
                log.info("step %d val_loss %.4f", state["step"], state["val_loss"])
            tracker.log_metrics({"val_loss": state["val_loss"]}, state["step"])
        if state["step"] % int(params["checkpoint_every"]) == 0 or last:
            checkpointer.save(engine, state)
    checkpointer.close()

    final_loss = state["loss"]  # the last step always logs, so this is the final step's loss
    seconds = time.perf_counter() - train_start
    trained_tokens = (state["step"] - started_step) * tokens_per_step
    # model FLOPs utilization of this process: its share of the tokens against its device's peak
    peak, peak_source = parallel.best_peak(peak_before, parallel.peak_flops(env.device, bf16))
    process_rate = trained_tokens / seconds / env.world if trained_tokens else 0.0
    mfu = process_rate * config.flops_per_token() / peak
    result = export_model(engine, config, train_split, args, state, env, tracker)
    result.update(
        final_loss=final_loss,
        val_loss=state["val_loss"],
        tokens_seen=state["samples_seen"] * config.seq_len,
        steps=state["step"],
        tokens_per_s=trained_tokens / seconds if trained_tokens else 0.0,
        mfu=mfu,
        peak_flops=peak,
        peak_source=peak_source,
        data_loading_share=total_data_seconds / seconds,
        eval_share=eval_seconds / seconds,
        checkpoint_share=checkpointer.blocking_seconds / seconds,
        # per save: how long the loop waited (the median, and each: the first save also allocates
        # the staging buffers), and how long until the checkpoint was complete
        checkpoint_stall_s=float(np.median(checkpointer.stalls)) if checkpointer.stalls else 0.0,
        checkpoint_stalls_s=[round(s, 4) for s in checkpointer.stalls],
        checkpoint_save_s=float(np.mean(checkpointer.save_seconds)) if checkpointer.save_seconds else 0.0,
        checkpoints=[c.uri for c in list_complete(args.checkpoints)],
        resumed_from=latest.uri if latest else None,
        initialized_from=state["initialized_from"],
        world_size=env.world,
        engine=params["engine"],
        precision="bf16" if bf16 else "fp32",
        malloc=malloc,
    )
    tracker.finish(result)
    # every process reports rank 0's result (each pod of an Indexed Job hands one to Airflow)
    result = parallel.broadcast_object(result, env)
    del train_split, val_split, train_sampler, val_sampler  # their memory maps, before the files go
    drop_local_dataset(dataset_dir, env)
    return result


def export_model(
    engine: parallel.Engine, config: GPTConfig, split: TokenSplit, args: argparse.Namespace,
    state: dict[str, Any], env: parallel.Dist, tracker: Tracker,
) -> dict[str, Any]:
    """Gather the full weights on rank 0 and publish model.safetensors + config.json at ``--output``."""
    full = engine.full_state_dict()
    if not env.is_main:
        return {"model_uri": args.output}
    with storage.staged_output(args.output) as out:
        description = {
            "architecture": "gpt",
            "format_version": FORMAT_VERSION,
            "config": config.to_dict(),
            "tokenizer_uri": split.tokenizer_uri,
            "tokenizer_hash": split.tokenizer_hash,
            "eos_id": split.eos_id,
            "dataset_uri": args.dataset,
            "step": state["step"],
            "tokens_seen": state["samples_seen"] * config.seq_len,
            "initialized_from": state["initialized_from"],
        }
        save_model_files(full, description, out)
        tracker.log_model_files(out)
    return {"model_uri": args.output, "model_file": storage.join(args.output, WEIGHTS_FILE), "mlflow_run_id": tracker.run_id}


def main(args: argparse.Namespace) -> dict[str, Any]:
    return train(args)


def parser() -> argparse.ArgumentParser:
    p = step_parser("train", __doc__.splitlines()[0])
    p.add_argument("--dataset", required=True, help="URI of the tokenize step's dataset folder")
    p.add_argument("--checkpoints", required=True, help="run-scoped URI for DCP checkpoints (resumed from)")
    p.add_argument("--output", required=True, help="run-scoped URI for the consolidated model")
    p.add_argument("--mlflow-run-tag", default="", help="tag value (dag_run) that names this DAG run's MLflow run")
    p.add_argument("--init-from", default="", help="models:/NAME/VERSION or a model folder URI to start from "
                   "(train.init_from: champion); empty: a random initialization")
    return p


if __name__ == "__main__":
    run_step(parser(), main)
