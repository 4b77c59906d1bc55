"""The training loop and what it is built from: :class:`Trainer` (one process's loop over an
:class:`~tasks.train.engines.Engine`), :class:`TrainState` (what a checkpoint resumes), and
:func:`train` (the step: data, model, engine, checkpoints, tracking, the consolidated model).

Every start (first run, torchrun restart after a worker died, Airflow retry) resumes from the
newest complete checkpoint (model, optimizer, step, data position). A retrain continues from the
production model (``train.init_from: champion``) when it has this run's architecture and
vocabulary (or the run's tokenizer grew from the champion's: its embeddings grow with it);
otherwise, or with ``init_from: scratch``, it starts from a random initialization.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import random
import time
from typing import Any

import numpy as np
import torch

from tasks.config import TrainSettings
from tasks.contract import to_json
from tasks.lib import parallel, storage
from tasks.lib.data import BatchSampler, TokenSplit, drop_local_dataset, local_dataset, open_split
from tasks.lib.errors import StepError
from tasks.lib.model import FORMAT_VERSION, GPT, GPTConfig
from tasks.lib.model_store import WEIGHTS_FILE, save_model_files
from tasks.lib.provenance import training_record
from tasks.lib.step import log
from tasks.lib.torchrun import malloc_in_use
from tasks.lib.tracking import Tracker
from tasks.lib.vocabulary_growth import Growth, grown_rows, growth_of
from tasks.results import TrainResult
from tasks.train.checkpoint import Checkpointer, CheckpointStore, list_complete
from tasks.train.engines import Engine, build_engine, compile_blocks, compile_wanted, engine_class
from tasks.train.meters import CheckpointTimes, Meters, best_peak, peak_flops


@dataclasses.dataclass
class TrainState:
    """What the loop keeps besides model and optimizer; saved inside every checkpoint."""

    step: int = 0
    samples_seen: int = 0  # global sequences consumed: the data position (tasks.lib.data)
    loss: float | None = None  # of the last logged step, averaged over ranks
    val_loss: float | None = None
    best_val_loss: float | None = None
    initialized_from: str | None = None  # the model training started from (train.init_from), for lineage

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for field in dataclasses.fields(self):
            if field.name in state:
                setattr(self, field.name, state[field.name])


def lr_at(step: int, settings: TrainSettings) -> float:
    """Linear warmup, then cosine decay to ``min_lr_ratio * lr``."""
    lr, warmup = settings.lr, settings.warmup_steps
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min((step - warmup) / max(settings.max_steps - warmup, 1), 1.0)
    floor = lr * settings.min_lr_ratio
    return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, settings: TrainSettings) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr,
        betas=settings.betas,
        # one kernel per operation over all parameters: PyTorch's default on GPUs only; on CPUs
        # the per-parameter loop cost FSDP2's sharded parameters ~9 ms a step (2x the foreach step)
        foreach=True,
    )


def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; through the wrapper's forward (FSDP2 / DDP hooks)."""
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))


@dataclasses.dataclass(frozen=True)
class TrainedModel:
    """The model being trained: its architecture, and the engine that holds its weights and
    optimizer (and hides how they are distributed)."""

    config: GPTConfig
    engine: Engine


@dataclasses.dataclass(frozen=True)
class Batches:
    """Where the loop's batches come from: the train split's sampler, and the validation split's
    (the same batches at every evaluation)."""

    train: BatchSampler
    val: BatchSampler


@dataclasses.dataclass(frozen=True)
class RunOutputs:
    """Where the loop's results go: its state (the checkpointer) and its figures (the tracker);
    either may be the in-process kind (a local folder, no MLflow)."""

    checkpointer: Checkpointer
    tracker: Tracker


class Trainer:
    """One process's training loop, and the model it publishes at the end."""

    def __init__(self, settings: TrainSettings, env: parallel.Dist, model: TrainedModel, batches: Batches,
                 outputs: RunOutputs, state: TrainState | None = None) -> None:
        self.settings, self.env, self.config, self.engine = settings, env, model.config, model.engine
        self.train_data, self.val_data = batches.train, batches.val
        self.checkpointer, self.tracker = outputs.checkpointer, outputs.tracker
        self.state = state or TrainState()
        self.bf16 = parallel.use_bf16(env.device, settings.precision)
        self.global_batch = settings.micro_batch * settings.grad_accum * env.world
        self.meters = self._start_meters()

    def _start_meters(self) -> Meters:
        """Timers from now and from the current step (fit starts its own: the run's time)."""
        return Meters(self.global_batch * self.config.seq_len, self.state.step, self.settings.max_steps)

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.load_state_dict(state)

    def _batch(self, sampler: BatchSampler, samples_seen: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = sampler.batch(samples_seen, self.env.rank, self.env.world)
        return x.to(self.env.device, non_blocking=True), y.to(self.env.device, non_blocking=True)

    def _autocast(self) -> torch.autocast:
        return torch.autocast(self.env.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def train_step(self) -> tuple[torch.Tensor, float]:
        """One optimizer step over ``grad_accum`` micro-batches: this rank's mean loss (a tensor:
        reading it would synchronize) and the global gradient norm."""
        settings, engine, step = self.settings, self.engine, self.state.step
        engine.set_lr(lr_at(step, settings))
        step_loss = torch.zeros((), device=self.env.device)
        for micro in range(settings.grad_accum):
            started = time.perf_counter()
            x, y = self._batch(self.train_data, self.state.samples_seen + micro * settings.micro_batch * self.env.world)
            self.meters.loaded(time.perf_counter() - started)
            # the backward inside: FSDP2 reads whether to reduce-scatter while it runs
            with engine.gradient_sync(micro == settings.grad_accum - 1):
                with self._autocast():
                    loss = loss_fn(engine.model, x, y)
                engine.backward(loss, settings.grad_accum)
            step_loss += loss.detach() / settings.grad_accum
        self.checkpointer.before_update()  # the last save's background copy of the weights must be done
        try:
            grad_norm = engine.step(settings.grad_clip)
        except FloatingPointError as exc:  # retrying from the last checkpoint would diverge again
            raise StepError(f"training diverged at step {step + 1}: {exc} (loss {float(step_loss):.4g} on rank "
                            f"{self.env.rank}); not applied, nothing saved from it: lower train.lr or check the data") from None
        self.state.step = step + 1
        self.state.samples_seen += self.global_batch
        self.meters.stepped()
        return step_loss, grad_norm

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the same ``eval_batches`` validation batches every time."""
        model, batches = self.engine.model, self.settings.eval_batches
        model.eval()
        total = torch.zeros((), device=self.env.device)
        for i in range(batches):
            x, y = self._batch(self.val_data, i * self.settings.micro_batch * self.env.world)
            with self._autocast():
                total += loss_fn(model, x, y)
        model.train()
        return float(parallel.all_reduce_mean(total / batches, self.env))

    def log(self, step_loss: torch.Tensor, grad_norm: float) -> None:
        state = self.state
        state.loss = float(parallel.all_reduce_mean(step_loss, self.env))
        window = self.meters.window(state.step)
        metrics = {"loss": state.loss, "lr": lr_at(state.step - 1, self.settings), "grad_norm": grad_norm,
                   "tokens_per_s": window["tokens_per_s"], "step_time_s": window["step_time_s"],
                   "data_loading_share": window["data_loading_share"],
                   "checkpoint_time_s": self.checkpointer.blocking_seconds,
                   "epoch": self.train_data.epoch_of(state.samples_seen)}
        if self.env.is_main:  # the loss is already averaged over ranks: one line per step, not one per node
            log.info("step %d/%d loss %.4f lr %.2e %.0f tok/s step %.3fs data %.1f%% ETA %.0fs", state.step,
                     self.settings.max_steps, state.loss, metrics["lr"], metrics["tokens_per_s"],
                     metrics["step_time_s"], 100 * metrics["data_loading_share"], window["eta_s"])
        self.tracker.log_metrics(metrics, state.step)

    def validate(self) -> None:
        with self.meters.evaluating():
            self.state.val_loss = self.evaluate()
        if self.state.best_val_loss is None or self.state.val_loss < self.state.best_val_loss:
            self.state.best_val_loss = self.state.val_loss
        if self.env.is_main:
            log.info("step %d val_loss %.4f", self.state.step, self.state.val_loss)
        self.tracker.log_metrics({"val_loss": self.state.val_loss}, self.state.step)

    def fit(self) -> dict[str, Any]:
        """Train to ``max_steps``, logging, evaluating and checkpointing at their cadences (and
        all three at the last step); the run's figures."""
        settings, state = self.settings, self.state
        peak_before = peak_flops(self.env.device, self.bf16)  # MFU's peak: probed before and after the loop
        self.meters = self._start_meters()
        while state.step < settings.max_steps:
            step_loss, grad_norm = self.train_step()
            last = state.step == settings.max_steps
            if state.step % settings.log_every == 0 or last:
                self.log(step_loss, grad_norm)
            if state.step % settings.eval_every == 0 or last:
                self.validate()
            if state.step % settings.checkpoint_every == 0 or last:
                self.checkpointer.save(self.engine, self.state_dict())
        self.checkpointer.close()
        self.meters.stop()  # the run's time ends here, before the second probe
        checkpoints = self.checkpointer
        times = CheckpointTimes(checkpoints.stalls, checkpoints.save_seconds, checkpoints.blocking_seconds)
        peak = best_peak(peak_before, peak_flops(self.env.device, self.bf16))
        return {"final_loss": state.loss, "val_loss": state.val_loss, "steps": state.step,
                "tokens_seen": state.samples_seen * self.config.seq_len,
                **self.meters.summary(state.step, self.env.world, self.config.flops_per_token(), peak, times)}

    def export_model(self, split: TokenSplit, run: TrainRun, line: Line | None) -> dict[str, Any]:
        """Gather the full weights on rank 0 and publish model.safetensors + config.json at the
        run's output (with what a replay needs to train it again: the settings, layout and runtime)."""
        full = self.engine.full_state_dict()
        env, state, config, output = self.env, self.state, self.config, run.output
        if not env.is_main:
            return {"model_uri": output}
        with storage.staged_output(output) as out:
            description = {
                "architecture": "gpt",
                "format_version": FORMAT_VERSION,
                "config": config.to_dict(),
                "tokenizer_uri": split.tokenizer_uri,
                "tokenizer_hash": split.tokenizer_hash,
                "eos_id": split.eos_id,
                "special_tokens": split.special_tokens.to_dict(),
                "base": line.base if line else None,
                "dataset_uri": run.dataset,
                "step": state.step,
                "tokens_seen": state.samples_seen * config.seq_len,
                "initialized_from": state.initialized_from,
                "training": training_record(self.settings, env.world, env.device, split.index),
            }
            save_model_files(full, description, out)
            self.tracker.log_model_files(out)
        return {"model_uri": output, "model_file": storage.join(output, WEIGHTS_FILE),
                "mlflow_run_id": self.tracker.run_id}


# -- building a run -----------------------------------------------------------------------------


def model_config(settings: TrainSettings, vocab_size: int) -> GPTConfig:
    try:
        return GPTConfig(vocab_size=vocab_size, **dataclasses.asdict(settings.model))
    except (TypeError, ValueError) as exc:
        raise StepError(f"train.presets.{settings.preset}: {exc}") from None


@dataclasses.dataclass(frozen=True)
class TrainRun:
    """What one train step reads and writes, as its command line names them: the tokenize step's
    dataset, the checkpoints (resumed from), the consolidated model's folder, the model it may
    start from (``train.init_from: champion``; empty: a random initialization), and the tag
    (dag_run) that names the DAG run's MLflow run."""

    dataset: str
    checkpoints: str
    output: str
    init_from: str = ""
    mlflow_run_tag: str = ""


@dataclasses.dataclass(frozen=True)
class Line:
    """A model line started from a Hugging Face base (train.base): every run of it trains the
    base's architecture, whatever the preset, and records the base."""

    config: GPTConfig
    base: dict[str, str]


def start_description(uri: str) -> dict[str, Any]:
    """The description (config.json) of the model ``--init-from`` names, without its weights."""
    from tasks.lib.registry import DESCRIPTION_FILE, registered_version

    if uri.startswith("models:/"):
        name, _, version = uri.removeprefix("models:/").rpartition("/")
        if not name or not version.isdigit():
            raise StepError(f"--init-from {uri!r}: expected models:/NAME/VERSION or a model folder URI")
        return registered_version(name, version)[1]
    storage.require_complete(uri)
    description: dict[str, Any] = storage.read_json(storage.join(uri, DESCRIPTION_FILE))
    return description


def line_of(uri: str) -> Line | None:
    """The base line ``uri``'s model belongs to; None for a model of the presets."""
    description = start_description(uri)
    if not description.get("base"):
        return None
    try:
        config = GPTConfig.from_saved(description["config"], int(description["format_version"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise StepError(f"--init-from {uri}: its description cannot be read by this code ({exc})") from None
    return Line(config, dict(description["base"]))


def check_data(split: TokenSplit, config: GPTConfig, name: str) -> None:
    """Token ids must fit the model's vocabulary (catches dtype/vocab mix-ups before step 0)."""
    top = int(split.tokens.max())
    if top >= config.vocab_size:
        raise StepError(f"{name} split: token id {top} >= model vocab {config.vocab_size} (dtype/vocab mismatch)")


def check_fits(config: GPTConfig, settings: TrainSettings, env: parallel.Dist, train: BatchSampler) -> None:
    """Refuse a preset/batch that cannot fit memory or the data, before any training step."""
    state_bytes = engine_class(settings, env).state_bytes(config.num_params(), config.n_layers, settings, env)
    # activations kept for backward: ~34 * d_model bytes per token and layer, plus the logits
    per_token = (34 * config.d_model * config.n_layers) / (4 if settings.activation_checkpointing else 1)
    act_bytes = settings.micro_batch * config.seq_len * (per_token + 8 * config.vocab_size)
    need = state_bytes + act_bytes
    if env.device.type == "cuda":
        available = torch.cuda.mem_get_info(env.device)[0]  # free, not total: the GPU may be shared
    else:
        import psutil

        available = psutil.virtual_memory().available / max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    if need > 0.9 * available:
        raise StepError(
            f"preset {settings.preset} ({config.num_params() / 1e6:.0f}M params) with micro_batch "
            f"{settings.micro_batch} needs ~{need / 2**30:.1f} GiB per process, {available / 2**30:.1f} GiB available"
        )
    global_batch = settings.micro_batch * settings.grad_accum * env.world
    if global_batch > train.windows:
        raise StepError(
            f"global batch of {global_batch} sequences exceeds the {train.windows} sequences of "
            f"{config.seq_len} tokens in the train split"
        )


def check_settings(settings: TrainSettings, env: parallel.Dist) -> None:
    """What the settings alone cannot know: the device and the launcher."""
    bf16 = parallel.use_bf16(env.device, settings.precision)
    if bf16 and settings.engine == "deepspeed" and env.device.type != "cuda":
        raise StepError("train.precision bf16 on CPUs: use engine fsdp2, ddp or single (DeepSpeed runs fp32 there)")
    if settings.engine == "deepspeed" and "WORLD_SIZE" not in os.environ:
        raise StepError("train.engine deepspeed runs under torchrun (no WORLD_SIZE in the environment)")


def initial_weights(uri: str, config: GPTConfig, tokenizer_hash: str, line: Line | None, growth: Growth | None
                    ) -> dict[str, torch.Tensor] | None:
    """The weights to start from: those of ``uri`` (``models:/NAME/VERSION`` or a train step's
    model folder) when its architecture and tokenizer are this run's, else None (logged): a
    changed preset or vocabulary starts from scratch rather than failing the retrain. A base
    line's model must start from its weights: another tokenizer fails the step. A tokenizer
    grown from the model's (``growth``) starts from its weights with the embeddings (and an
    untied head) grown by the new tokens' rows."""
    from tasks.lib.model_store import load_model_dir, load_version

    with storage.scratch() as scratch:
        if uri.startswith("models:/"):
            name, _, version = uri.removeprefix("models:/").rpartition("/")
            if not name or not version.isdigit():
                raise StepError(f"--init-from {uri!r}: expected models:/NAME/VERSION or a model folder URI")
            loaded = load_version(name, version)
        else:
            loaded = load_model_dir(uri, scratch)
    if growth is not None and loaded.description["tokenizer_hash"] == growth.parent_hash:
        return grown_weights(uri, loaded.model, config, growth)
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
    if loaded.description["tokenizer_hash"] != tokenizer_hash and line is not None:
        raise StepError(f"--init-from {uri}: its tokenizer {loaded.description['tokenizer_hash'][:12]} is not the "
                        f"dataset's {tokenizer_hash[:12]}: a model of the base {line.base['uri']} reads its own "
                        "tokenizer's ids (tokenize without --tokenizer)")
    if loaded.description["tokenizer_hash"] != tokenizer_hash:
        log.warning("not starting from %s: its tokenizer %s is not the dataset's %s", uri,
                    loaded.description["tokenizer_hash"][:12], tokenizer_hash[:12])
        return None
    return loaded.model.state_dict()


def grown_weights(uri: str, model: GPT, config: GPTConfig, growth: Growth) -> dict[str, torch.Tensor] | None:
    """``model``'s weights with a row per token the run's tokenizer added to the model's (the
    mean of its pieces' rows); None (logged) when the model is not this run's architecture."""
    if dataclasses.replace(model.config, vocab_size=growth.vocab_size) != config:
        log.warning("not starting from %s: its architecture %s grown to %d tokens is not this run's %s", uri,
                    model.config.to_dict(), growth.vocab_size, config.to_dict())
        return None
    weights = model.state_dict()
    weights["embed.weight"] = grown_rows(weights["embed.weight"], growth)
    weights["head.weight"] = weights["embed.weight"] if config.tie_embeddings else grown_rows(weights["head.weight"], growth)
    log.info("starting from %s with its vocabulary grown %d -> %d tokens (new rows: the mean of their pieces')", uri,
             growth.first_id, growth.vocab_size)
    return weights


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train(settings: TrainSettings, run: TrainRun) -> TrainResult:
    """The train step in this process (one rank of a torchrun group, or alone): its result."""
    env = parallel.init_distributed()
    try:
        # the run's objects live in a frame of their own, gone before the process group: a DDP
        # reducer freed after its group deadlocks in gloo's destructor (rank 0 hung at exit), and
        # a DeepSpeed engine (reference cycles: freed by the collector) aborted the process at exit
        return _train(settings, env, run)
    finally:
        gc.collect()
        parallel.shutdown()


def _train(settings: TrainSettings, env: parallel.Dist, run: TrainRun) -> TrainResult:
    check_settings(settings, env)
    dataset, init_from = run.dataset, run.init_from
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))))
    dataset_dir = local_dataset(dataset)
    train_split, val_split = open_split(dataset_dir, "train"), open_split(dataset_dir, "val")
    # a base line's architecture comes with the model it starts from; init_from scratch trains the
    # preset from a random initialization, as its replay (initialized_from "scratch") rebuilds it
    line = line_of(init_from) if init_from and settings.init_from == "champion" else None
    config = line.config if line else model_config(settings, train_split.vocab_size)
    check_data(train_split, config, "train")
    check_data(val_split, config, "val")
    train_data = BatchSampler(train_split.tokens, config.seq_len, settings.micro_batch, settings.seed)
    val_data = BatchSampler(val_split.tokens, config.seq_len, settings.micro_batch, settings.seed + 1)
    check_fits(config, settings, env, train_data)

    store = CheckpointStore(run.checkpoints, settings.keep_last, env.rank)
    latest = store.latest()
    seed_everything(settings.seed)
    gpt = GPT(config)
    # a resumed run takes its weights from the checkpoint: the starting point matters only once
    init_uri = init_from if settings.init_from == "champion" and latest is None else ""
    start_weights = (initial_weights(init_uri, config, train_split.tokenizer_hash, line,
                                     growth_of(train_split.tokenizer_uri)) if init_uri else None)
    started_from = init_uri if start_weights is not None else None
    if start_weights is not None:
        gpt.load_state_dict(start_weights)
        del start_weights  # the loaded model's copy: one model in memory from here
    gpt.activation_checkpointing = settings.activation_checkpointing
    if compile_wanted(settings.compile, env.device):
        compile_blocks(gpt)
    engine = build_engine(gpt, settings, env, lambda m: build_optimizer(m, settings))
    checkpointer = Checkpointer(store, engine.checkpoint_format(settings.async_checkpoint))
    state = TrainState(initialized_from=started_from)
    if latest is not None:
        state.load_state_dict(checkpointer.load(latest, engine, state.state_dict()))
    tracker = Tracker(env.is_main, settings, run.mlflow_run_tag)
    tracker.start(config, env, resumed_from=latest.uri if latest else None, dataset=dataset,
                  initialized_from=state.initialized_from)
    trainer = Trainer(settings, env, TrainedModel(config, engine), Batches(train_data, val_data),
                      RunOutputs(checkpointer, tracker), state)
    malloc = malloc_in_use()
    log.info(
        "training %s (%.2fM params) engine=%s rank %d/%d pid %d on %s (%s, malloc: %s): %d steps x %d tokens, "
        "from step %d of %s", settings.preset if line is None else f"the base {line.base['uri']}", config.num_params() / 1e6, settings.engine, env.rank, env.world,
        os.getpid(), env.device, "bf16" if trainer.bf16 else "fp32", malloc, settings.max_steps,
        trainer.global_batch * config.seq_len, state.step,
        latest.uri if latest else state.initialized_from or "a random initialization",
    )
    figures = trainer.fit()
    result = TrainResult(
        **trainer.export_model(train_split, run, line),
        **figures,
        checkpoints=tuple(c.uri for c in list_complete(run.checkpoints)),
        resumed_from=latest.uri if latest else None,
        initialized_from=state.initialized_from,
        world_size=env.world,
        engine=settings.engine,
        precision="bf16" if trainer.bf16 else "fp32",
        malloc=malloc,
    )
    tracker.finish(to_json(result))
    # every process reports rank 0's result (each pod of an Indexed Job hands one to Airflow)
    result = parallel.broadcast_object(result, env)
    del train_split, val_split, train_data, val_data, trainer  # their memory maps, before the files go
    drop_local_dataset(dataset_dir, env)
    return result
