"""The Trainer in this process (the fast tier: no torchrun, no servers): a tiny model on the
plain engine, a hand-made dataset, checkpoints in a temporary folder, no MLflow. What the
torchrun tests (test_train.py) show across processes, shown here for the loop itself."""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path
from typing import Any, get_args

import numpy as np
import pytest
import torch
from helpers import write_dataset

from tasks.config import Engine as EngineName
from tasks.config import TrainSettings, load
from tasks.lib import parallel
from tasks.lib.data import BatchSampler, open_split
from tasks.lib.errors import StepError
from tasks.lib.model import GPT
from tasks.lib.tracking import Tracker
from tasks.train import engines, meters
from tasks.train.checkpoint import Checkpointer, CheckpointStore, DCPFormat, DeepSpeedFormat, list_complete
from tasks.train.trainer import (
    Batches,
    RunOutputs,
    TrainedModel,
    Trainer,
    TrainState,
    build_optimizer,
    check_fits,
    lr_at,
    model_config,
)

VOCAB = 64
CPU = parallel.Dist(rank=0, world=1, local_rank=0, device=torch.device("cpu"))


def tiny_settings(**changes: Any) -> TrainSettings:
    tiny = {"seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 2}
    settings = load(section="train", overrides=[*(f"presets.cpu-tiny.{k}={v}" for k, v in tiny.items()),
                                                "engine=single", "max_steps=12", "warmup_steps=2", "micro_batch=4",
                                                "log_every=3", "eval_every=6", "checkpoint_every=6", "eval_batches=2",
                                                "lr=0.01"]).train
    return dataclasses.replace(settings, **changes)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A token stream with structure to learn: a repeating ramp with noise."""
    rng = np.random.default_rng(0)
    ramp = np.tile(np.arange(VOCAB, dtype=np.uint16), 200)
    noisy = np.where(rng.random(ramp.size) < 0.1, rng.integers(0, VOCAB, ramp.size), ramp).astype(np.uint16)
    return write_dataset(tmp_path_factory.mktemp("tiny") / "dataset", noisy, VOCAB)


def make_trainer(settings: TrainSettings, dataset: Path, checkpoints: Path) -> Trainer:
    """As tasks.train.trainer.train builds one, in this process."""
    split = open_split(dataset, "train")
    config = model_config(settings, split.vocab_size)
    torch.manual_seed(settings.seed)
    engine = engines.build_engine(GPT(config), settings, CPU, lambda m: build_optimizer(m, settings))
    store = CheckpointStore(str(checkpoints), settings.keep_last, CPU.rank)
    checkpointer = Checkpointer(store, engine.checkpoint_format(settings.async_checkpoint))
    train_data = BatchSampler(split.tokens, config.seq_len, settings.micro_batch, settings.seed)
    val_data = BatchSampler(open_split(dataset, "val").tokens, config.seq_len, settings.micro_batch, settings.seed + 1)
    trainer = Trainer(settings, CPU, TrainedModel(config, engine), Batches(train_data, val_data),
                      RunOutputs(checkpointer, Tracker(False, settings, "")))
    latest = store.latest()
    if latest is not None:
        trainer.load_state_dict(checkpointer.load(latest, engine, trainer.state_dict()))
    return trainer


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return trainer.engine.full_state_dict()


def test_the_loop_learns_and_reports_its_figures(dataset: Path, tmp_path: Path) -> None:
    trainer = make_trainer(tiny_settings(), dataset, tmp_path / "ckpt")
    first = trainer.evaluate()
    figures = trainer.fit()
    assert figures["steps"] == 12 and trainer.state.step == 12
    assert figures["val_loss"] < first - 0.5 and first > math.log(VOCAB) - 0.5  # from about uniform, down
    assert trainer.state.best_val_loss == min(trainer.state.best_val_loss, figures["val_loss"])
    assert figures["tokens_seen"] == 12 * 4 * 16
    assert 0 < figures["mfu"] < 1 and figures["tokens_per_s"] > 0
    assert len(figures["checkpoint_stalls_s"]) == 2  # steps 6 and 12
    assert [c.step for c in list_complete(str(tmp_path / "ckpt"))] == [6, 12]


def test_a_resumed_trainer_continues_to_the_same_weights_bit_for_bit(dataset: Path, tmp_path: Path) -> None:
    """Stopped after its step-6 checkpoint and built again from it (a restart), the loop ends
    where an uninterrupted one does: model, optimizer, step and data position all came back."""
    straight = make_trainer(tiny_settings(), dataset, tmp_path / "straight")
    straight.fit()
    stopped = make_trainer(tiny_settings(), dataset, tmp_path / "resumed")
    for _ in range(6):  # the same run (its schedule spans 12 steps), ended after its checkpoint at 6
        stopped.train_step()
    stopped.checkpointer.save(stopped.engine, stopped.state_dict())
    stopped.checkpointer.close()
    resumed = make_trainer(tiny_settings(), dataset, tmp_path / "resumed")
    assert resumed.state.step == 6 and resumed.state.samples_seen == 6 * 4
    resumed.fit()
    expected, got = weights(straight), weights(resumed)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert resumed.state.loss == straight.state.loss


def test_train_state_round_trips_and_ignores_what_it_does_not_know() -> None:
    state = TrainState(step=3, samples_seen=12, loss=1.5, initialized_from="models:/m/1")
    again = TrainState()
    again.load_state_dict({**state.state_dict(), "from_a_newer_version": 1})
    assert again == state


def test_learning_rate_warms_up_then_decays_to_its_floor() -> None:
    settings = tiny_settings(lr=1.0, warmup_steps=4, max_steps=20, min_lr_ratio=0.1)
    rates = [lr_at(step, settings) for step in range(20)]
    assert rates[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in itertools.pairwise(rates[3:]))
    assert lr_at(10**6, settings) == pytest.approx(0.1)


def test_the_engine_table_names_every_allowed_engine() -> None:
    """train.engine's allowed values (the settings, the DAG's form) and the engine classes agree."""
    assert set(engines.ENGINES) == set(get_args(EngineName))
    assert engines.engine_class(tiny_settings(engine="fsdp2"), CPU) is engines.Engine  # one process: nothing to shard
    assert engines.engine_class(tiny_settings(engine="ddp"), CPU) is engines.Engine
    two = dataclasses.replace(CPU, world=2)
    assert engines.engine_class(tiny_settings(engine="fsdp2"), two) is engines.FSDP2Engine
    assert engines.engine_class(tiny_settings(engine="deepspeed"), CPU) is engines.DeepSpeedEngine


def test_each_engine_names_its_checkpoint_format(dataset: Path) -> None:
    settings = tiny_settings()
    engine = engines.build_engine(GPT(model_config(settings, VOCAB)), settings, CPU, lambda m: build_optimizer(m, settings))
    assert isinstance(engine.checkpoint_format(True), DCPFormat)
    assert isinstance(engines.DeepSpeedEngine.checkpoint_format(engine, True), DeepSpeedFormat)  # type: ignore[arg-type]


def test_memory_estimate_follows_the_engine() -> None:
    """Fully sharded state shrinks with the world; whole state does not."""
    settings, config = tiny_settings(), model_config(tiny_settings(), VOCAB)
    four = dataclasses.replace(CPU, world=4)
    n = config.num_params()
    whole = engines.Engine.state_bytes(n, config.n_layers, settings, four)
    sharded = engines.FSDP2Engine.state_bytes(n, config.n_layers, dataclasses.replace(settings, reshard_after_forward=True),
                                              four)
    zero3 = engines.DeepSpeedEngine.state_bytes(n, config.n_layers, dataclasses.replace(settings, deepspeed_stage=3), four)
    zero2 = engines.DeepSpeedEngine.state_bytes(n, config.n_layers, dataclasses.replace(settings, deepspeed_stage=2), four)
    assert whole == 16 * n and sharded == zero3 == 4 * n and zero3 < zero2 < whole


def test_a_batch_bigger_than_the_data_is_refused(dataset: Path) -> None:
    settings = tiny_settings(grad_accum=10**5)
    split = open_split(dataset, "train")
    config = model_config(settings, VOCAB)
    with pytest.raises(StepError, match="sequences exceeds the"):
        check_fits(config, settings, CPU, BatchSampler(split.tokens, config.seq_len, settings.micro_batch, 0))


def test_reshard_after_forward_policy() -> None:
    """auto: GPUs free every block's weights after its forward but the last one's (the backward
    starts there); CPUs keep them all (one all-gather per step instead of two over gloo)."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert engines.reshard_after_forward("auto", cuda, 4) == [True, True, True, False]
    assert engines.reshard_after_forward("auto", cpu, 4) == [False] * 4
    assert engines.reshard_after_forward(True, cpu, 3) == [True] * 3
    assert engines.reshard_after_forward(False, cuda, 3) == [False] * 3


def test_precision_policy() -> None:
    """auto: bf16 autocast on CUDA only (CPUs with AMX gain, AVX2 ones lose ~19x: asked for, not
    guessed); weights gathered in bf16 on GPUs only (gloo's collectives stay fp32)."""
    cpu = torch.device("cpu")
    assert not parallel.use_bf16(cpu, "auto") and parallel.use_bf16(cpu, "bf16")
    assert not parallel.use_bf16(torch.device("cuda"), "fp32")
    assert not parallel.bf16_weights(cpu, "bf16")


def test_fsdp2_units_per_block_on_gpus_or_where_blocks_free_their_weights() -> None:
    """CPUs keeping the weights shard the whole model as one unit (one all-gather and one
    reduce-scatter a step); a block that frees its weights needs a unit of its own; GPUs overlap
    per-block collectives with compute."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not engines.per_block_units([False] * 4, cpu)
    assert engines.per_block_units([True, True, True, False], cpu)
    assert engines.per_block_units([False] * 4, cuda)


def test_the_peak_probe_shrinks_its_matmul_to_fit_its_time_budget() -> None:
    """MFU's CPU peak is a matmul probe; bf16 on a CPU without bf16 instructions is emulated
    ~100x slower than fp32 (a 1024-square matmul took 10 s on an AVX2 core), so the probe takes
    the largest size whose repeats fit its budget: all of it with room, its smallest with none."""
    cpu = torch.device("cpu")
    for bf16 in (False, True):
        kind = "bf16" if bf16 else "fp32"
        assert meters.matmul_probe(cpu, 256, 2, bf16, budget_s=1e9)[1].startswith(f"measured {kind} matmul (256x256)")
        flops, source = meters.matmul_probe(cpu, 256, 2, bf16, budget_s=0.0)
        assert source.startswith(f"measured {kind} matmul (128x128)") and flops > 0
