"""How the GPT is distributed: one :class:`Engine` class per ``train.engine``, chosen once from
:data:`ENGINES`.

- ``fsdp2`` (default): ``fully_shard`` on every block, then on the root (tied embedding/head
  stay together in the root's group); on CPUs, unless blocks free their weights, the root alone
  (:func:`per_block_units`). bf16 parameters with fp32 reduction on accelerators. Whether a block
  frees its gathered weights after its forward: :func:`reshard_after_forward`.
- ``ddp``: ``DistributedDataParallel``, for small models.
- ``deepspeed``: DeepSpeed ZeRO (stage 2 or 3, ``train.deepspeed_stage``), its config generated
  from the settings; runs on CPUs with gloo too (DeepSpeed's CPU accelerator).
- ``single``: one process, no wrapper (the baseline the benchmark compares against). fsdp2 and
  ddp in a world of one process are ``single``: there is nothing to shard or synchronize.

The trainer talks to an engine only: forward (``engine.model``), backward, the gradient sync of
accumulation, the optimizer step with clipping, the learning rate, the full weights, the memory a
model needs, and the checkpoint format that fits it. It never asks which engine it has.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from tasks.config import TrainSettings
from tasks.lib.parallel import Dist, bf16_weights
from tasks.train.checkpoint import CheckpointFormat, DCPFormat, DeepSpeedFormat

BYTES_PER_PARAM_TRAINING = 16  # fp32 weights + grads + two AdamW moments

MakeOptimizer = Callable[[nn.Module], torch.optim.Optimizer]


class Engine:
    """One process's view of a wrapped model and its optimizer. This class is ``single``: the
    model as it is; the others override what their wrapper does differently."""

    name: ClassVar[str] = "single"

    def __init__(self, model: nn.Module, settings: TrainSettings, env: Dist, make_optimizer: MakeOptimizer) -> None:
        self.settings, self.env = settings, env
        self.model = self.wrap(model.to(env.device))  # call it for logits: the wrapper's forward runs its hooks
        self.optimizer = make_optimizer(self.model)

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    @contextlib.contextmanager
    def gradient_sync(self, sync: bool) -> Iterator[None]:
        """Around one micro-batch's forward and backward: gradients are reduced across ranks
        only on the last micro-batch of a step (``sync``); the others accumulate locally."""
        yield

    def backward(self, loss: torch.Tensor, grad_accum: int) -> None:
        (loss / grad_accum).backward()

    def step(self, grad_clip: float) -> float:
        """Finish an optimizer step (after ``grad_accum`` backward calls); the gradient norm.
        A non-finite norm raises FloatingPointError before the update (no checkpoint follows).
        The norm is global, so every rank raises together."""
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), grad_clip)
        if not math.isfinite(float(norm)):
            raise FloatingPointError(f"gradient norm {float(norm)}")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded weights on CPU (collective: every rank calls it; rank 0 uses the result)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {key: value for key, value in get_model_state_dict(self.model, options=options).items()}  # type: ignore[misc]

    def checkpoint_format(self, async_save: bool) -> CheckpointFormat:
        """How this engine's training state is saved and resumed."""
        return DCPFormat(async_save)

    @classmethod
    def state_bytes(cls, n_params: int, n_layers: int, settings: TrainSettings, env: Dist) -> float:
        """Per process: weights, gradients and optimizer state this engine holds."""
        return float(n_params * BYTES_PER_PARAM_TRAINING)


class DDPEngine(Engine):
    name = "ddp"

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        device = self.env.device
        return DistributedDataParallel(model, device_ids=[self.env.local_rank] if device.type == "cuda" else None)

    @contextlib.contextmanager
    def gradient_sync(self, sync: bool) -> Iterator[None]:
        if sync:
            yield
        else:
            with self.model.no_sync():  # type: ignore[operator]
                yield


class FSDP2Engine(Engine):
    name = "fsdp2"

    def wrap(self, model: nn.Module) -> nn.Module:
        settings, device = self.settings, self.env.device
        frees = reshard_after_forward(settings.reshard_after_forward, device, len(model.blocks))  # type: ignore[arg-type]
        return shard(model, frees, per_block_units(frees, device), device, bf16_weights(device, settings.precision))

    @contextlib.contextmanager
    def gradient_sync(self, sync: bool) -> Iterator[None]:
        if sync:
            yield
            return
        self.model.set_requires_gradient_sync(False)  # type: ignore[operator]  # the root's reaches every block
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)  # type: ignore[operator]

    @classmethod
    def state_bytes(cls, n_params: int, n_layers: int, settings: TrainSettings, env: Dist) -> float:
        sharded = n_params * BYTES_PER_PARAM_TRAINING / env.world
        # blocks that keep their gathered weights for the backward hold them unsharded
        kept = reshard_after_forward(settings.reshard_after_forward, env.device, n_layers).count(False)
        return sharded + n_params * kept / n_layers * (2 if bf16_weights(env.device, settings.precision) else 4)


class DeepSpeedEngine(Engine):
    """DeepSpeed ZeRO: ``self.model`` is DeepSpeed's engine (its forward runs ZeRO's hooks);
    it scales, accumulates, clips and steps by its own config."""

    name = "deepspeed"

    def __init__(self, model: nn.Module, settings: TrainSettings, env: Dist, make_optimizer: MakeOptimizer) -> None:
        import deepspeed
        import deepspeed.ops

        # DeepSpeed's shared-memory all-reduce serves its inference alone, yet on CPUs every process
        # compiles it with g++ at its first start (~30 s, in each training pod too): training's
        # collectives go through torch.distributed either way
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        self.settings, self.env = settings, env
        model.to(env.device)
        self.model, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=make_optimizer(model), config=deepspeed_config(settings, env))

    def backward(self, loss: torch.Tensor, grad_accum: int) -> None:
        self.model.backward(loss)  # type: ignore[operator]  # scales by its gradient_accumulation_steps itself
        self.model.step()  # type: ignore[operator]  # applies the update only at the accumulation boundary

    def step(self, grad_clip: float) -> float:
        """The update already happened in ``backward`` (DeepSpeed clips by its config); a
        non-finite norm still raises, after it: no checkpoint follows."""
        norm = self.model.get_global_grad_norm()  # type: ignore[operator]
        if norm is not None and not math.isfinite(float(norm)):
            raise FloatingPointError(f"gradient norm {float(norm)}")
        return float(norm) if norm is not None else float("nan")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        import deepspeed

        module: nn.Module = self.model.module  # type: ignore[assignment]
        stage3 = self.model.zero_optimization_stage() == 3  # type: ignore[operator]
        with deepspeed.zero.GatheredParameters(list(module.parameters()), enabled=stage3):
            return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}

    def checkpoint_format(self, async_save: bool) -> CheckpointFormat:
        return DeepSpeedFormat()  # ZeRO's own partitioned files, written synchronously

    @classmethod
    def state_bytes(cls, n_params: int, n_layers: int, settings: TrainSettings, env: Dist) -> float:
        if settings.deepspeed_stage == 3:  # everything sharded
            return n_params * BYTES_PER_PARAM_TRAINING / env.world
        return n_params * (4 + (BYTES_PER_PARAM_TRAINING - 4) / env.world)  # ZeRO-2: weights whole


# train.engine -> its class (tasks/config/training.py's Engine Literal names the same four: a test checks)
ENGINES: dict[str, type[Engine]] = {cls.name: cls for cls in (FSDP2Engine, DDPEngine, DeepSpeedEngine, Engine)}


def engine_class(settings: TrainSettings, env: Dist) -> type[Engine]:
    """The class of ``train.engine``; fsdp2 and ddp on one process are the plain engine."""
    if env.world == 1 and settings.engine in ("fsdp2", "ddp"):
        return Engine
    return ENGINES[settings.engine]


def build_engine(model: nn.Module, settings: TrainSettings, env: Dist, make_optimizer: MakeOptimizer) -> Engine:
    """Wrap ``model`` for ``train.engine`` and build its optimizer with ``make_optimizer(module)``."""
    return engine_class(settings, env)(model, settings, env, make_optimizer)


def deepspeed_config(settings: TrainSettings, env: Dist) -> dict[str, Any]:
    """DeepSpeed's JSON config, generated from the ``train`` settings."""
    return {
        "train_micro_batch_size_per_gpu": settings.micro_batch,
        "gradient_accumulation_steps": settings.grad_accum,
        "gradient_clipping": settings.grad_clip,
        "zero_optimization": {"stage": settings.deepspeed_stage, "overlap_comm": env.device.type == "cuda"},
        "bf16": {"enabled": bf16_weights(env.device, settings.precision)},
        "zero_allow_untested_optimizer": True,  # torch AdamW, built by the trainer
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def compile_wanted(setting: bool | str, device: torch.device) -> bool:
    """train.compile (true, false or auto): auto compiles on GPUs, where it pays
    (benchmarks/train.py on an H100: 1.37-1.46x the eager step's steady rate for ~10 s of
    compiling), not on CPUs (no faster here once compiled, ~18 s per process)."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


def compile_blocks(model: nn.Module) -> None:
    """``torch.compile`` each transformer block in place, before sharding (as torchtitan does):
    the module tree and its ``state_dict`` keys stay as they were, so checkpoints, resharding,
    warm starts and the export read and write the same names; FSDP2 shards compiled blocks.
    Inductor's CPU backend needs a C++ compiler (the Makefile installs g++ where missing)."""
    for block in model.blocks:  # type: ignore[union-attr]
        block.compile()


def reshard_after_forward(setting: bool | str, device: torch.device, blocks: int) -> list[bool]:
    """Per block, whether FSDP2 frees its gathered weights after the block's forward and gathers
    them again in the backward (train.reshard_after_forward: true, false or auto). Keeping them
    saves one all-gather of the whole model per step and holds the unsharded weights through the
    step (gradients and optimizer state stay sharded). auto: on GPUs every block but the last,
    whose weights the backward needs first (torchtitan's default; NCCL overlaps the gathers with
    compute); on CPUs none: gloo's all-gathers run on the critical path (docs/benchmarks.md)."""
    if setting == "auto":
        return [device.type == "cuda" and i < blocks - 1 for i in range(blocks)]
    return [bool(setting)] * blocks


def shard(model: nn.Module, frees: list[bool], per_block: bool, device: torch.device, bf16: bool = False) -> nn.Module:
    """FSDP2 over ``model`` (on ``device``): a unit per block (``frees[i]``: block i drops its
    gathered weights after its forward) when ``per_block``, and the root's unit over the rest;
    ``bf16``: the weights gathered in bf16, gradients reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    if per_block:
        for block, free in zip(model.blocks, frees, strict=True):  # type: ignore[arg-type]
            fully_shard(block, mp_policy=policy, reshard_after_forward=free)
    fully_shard(model, mp_policy=policy)  # the root keeps its weights for the backward (FSDP2's default)
    return model


def per_block_units(frees: list[bool], device: torch.device) -> bool:
    """Whether FSDP2 gathers and reduces each block on its own (torchtitan's layout) or the whole
    model as one unit. Per block pays on GPUs, where NCCL overlaps one block's all-gather and
    reduce-scatter with its neighbours' compute, and wherever a block frees its weights after its
    forward (that needs a unit of its own). On CPUs keeping the weights, every unit only adds a
    gloo collective on the critical path, Python hooks and a wait for the slower rank: one unit
    per model ran 1.14-1.32x the per-block layout on cpu-tiny (benchmarks/fsdp_units.py). The
    shards, checkpoints and the math are the same either way; one unit holds the whole model's
    unsharded gradients until the end of the backward, as DDP does."""
    return device.type == "cuda" or any(frees)
