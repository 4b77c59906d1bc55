"""How the GPT is distributed: process group setup and the engines.

- ``fsdp2`` (default): ``fully_shard`` on every block, then on the root (tied embedding/head
  stay together in the root's group); on CPUs, unless blocks free their weights, the root alone
  (``per_block_units``). bf16 parameters with fp32 reduction on accelerators. Whether a block
  frees its gathered weights after its forward: ``reshard_after_forward``.
- ``ddp``: ``DistributedDataParallel``, for small models.
- ``deepspeed``: DeepSpeed ZeRO (stage 2 or 3, ``train.deepspeed_stage``), its config
  generated from params.yaml; runs on CPUs with gloo too (DeepSpeed's CPU accelerator).
- ``single``: one process, no wrapper (the baseline the benchmark compares against).

The training loop talks to an :class:`Engine` only: forward, backward, optimizer step, the
learning rate, the full weights. It never needs to know which wrapper is underneath.

``torchrun`` sets RANK / WORLD_SIZE / LOCAL_RANK; a plain ``python -m tasks.train`` runs single.
NCCL on GPUs, gloo on CPUs.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ENGINES = ("fsdp2", "ddp", "deepspeed", "single")


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None)
    return Dist(rank=rank, world=world, local_rank=local_rank, device=device)


# dense bf16 tensor-core peaks from the vendors' data sheets (FLOP/s per GPU, no sparsity)
GPU_BF16_PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12}


def peak_flops(device: torch.device, bf16: bool = False, probe_size: int = 1024, repeats: int = 8) -> tuple[float, str]:
    """The FLOP/s that model FLOPs utilization is measured against, and where it came from: a
    GPU's bf16 data-sheet peak, else a matmul probe in this process (on CPUs in the dtype the
    step computes in, ``bf16`` or fp32: what this process's threads can do, measured in the same
    run as the training it is compared with)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for model, peak in GPU_BF16_PEAK.items():
            if model in name:
                return peak, f"bf16 data sheet ({name})"
    return matmul_probe(device, probe_size, repeats, bf16)


def best_peak(*measured: tuple[float, str]) -> tuple[float, str]:
    """The highest of several peak measurements: on a shared machine a probe that ran while the
    neighbours were busy reads low (one such read put a step at 111% MFU), and what the cores
    reached once is what they can do. The train step probes before and after its loop."""
    return max(measured, key=lambda m: m[0])


def matmul_probe(device: torch.device, probe_size: int, repeats: int, bf16: bool = False) -> tuple[float, str]:
    """FLOP/s of the best of ``repeats`` square matmuls (bf16 on GPUs, on CPUs fp32 unless
    ``bf16``) and what ran."""
    dtype = torch.bfloat16 if device.type == "cuda" or bf16 else torch.float32
    a = torch.randn(probe_size, probe_size, device=device, dtype=dtype)
    b = torch.randn(probe_size, probe_size, device=device, dtype=dtype)
    torch.matmul(a, b)  # warm-up: thread pool, kernels
    best = math.inf
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    kind = "bf16" if dtype == torch.bfloat16 else "fp32"
    return 2 * probe_size**3 / best, f"measured {kind} matmul, {torch.get_num_threads()} thread(s)"


PRECISIONS = ("auto", "bf16", "fp32")


def use_bf16(device: torch.device, precision: str = "auto") -> bool:
    """Whether the step computes in bf16 autocast (train.precision; weights, gradients and the
    optimizer state stay fp32). auto: on CUDA GPUs with bf16. On CPUs only when asked: AVX2 CPUs
    run bf16 ~19x slower than fp32, those with AMX 1.2-2x faster (cpu-tiny, cpu-small: docs/benchmarks.md), and auto
    keeps a run's numbers from depending on the CPU model its pod lands on."""
    if precision == "auto":
        return device.type == "cuda" and torch.cuda.is_bf16_supported()
    return precision == "bf16"


def bf16_weights(device: torch.device, precision: str = "auto") -> bool:
    """Whether FSDP2 gathers (and DeepSpeed keeps) the weights in bf16: on GPUs that compute in
    bf16; CPU collectives (gloo) stay fp32, autocast casting each weight where it is used."""
    return device.type == "cuda" and use_bf16(device, precision)


@dataclass
class Engine:
    name: str
    model: nn.Module  # call it for logits: the wrapper's forward runs its hooks
    optimizer: torch.optim.Optimizer
    deepspeed: Any = None  # the DeepSpeed engine, when name == "deepspeed"

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def backward(self, loss: torch.Tensor, grad_accum: int) -> None:
        if self.deepspeed is not None:
            self.deepspeed.backward(loss)  # scales by its gradient_accumulation_steps itself
            self.deepspeed.step()  # applies the update only at the accumulation boundary
        else:
            (loss / grad_accum).backward()

    @contextlib.contextmanager
    def gradient_sync(self, sync: bool) -> Iterator[None]:
        """Around one micro-batch's forward and backward: gradients are reduced across ranks
        only on the last micro-batch of a step (``sync``); the others accumulate locally.
        DeepSpeed decides itself at its accumulation boundary."""
        if sync or self.deepspeed is not None or self.name == "single":
            yield
        elif self.name == "ddp":
            with self.model.no_sync():  # type: ignore[operator]
                yield
        else:  # fsdp2: the root's setting reaches every sharded block
            self.model.set_requires_gradient_sync(False)  # type: ignore[operator]
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)  # type: ignore[operator]

    def step(self, grad_clip: float) -> float:
        """Finish an optimizer step (after ``grad_accum`` backward calls); the gradient norm.
        A non-finite norm raises FloatingPointError before the update (DeepSpeed: after it; no
        checkpoint follows either way). The norm is global, so every rank raises together."""
        if self.deepspeed is not None:
            norm = self.deepspeed.get_global_grad_norm()  # clipped by DeepSpeed's config
            if norm is not None and not math.isfinite(float(norm)):
                raise FloatingPointError(f"gradient norm {float(norm)}")
            return float(norm) if norm is not None else float("nan")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), grad_clip)
        if not math.isfinite(float(norm)):
            raise FloatingPointError(f"gradient norm {float(norm)}")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded weights on CPU (collective: every rank calls it; rank 0 uses the result)."""
        if self.deepspeed is not None:
            import deepspeed

            params = list(self.deepspeed.module.parameters())
            with deepspeed.zero.GatheredParameters(params, enabled=self.deepspeed.zero_optimization_stage() == 3):
                return {k: v.detach().cpu().clone() for k, v in self.deepspeed.module.state_dict().items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {key: value for key, value in get_model_state_dict(self.model, options=options).items()}  # type: ignore[misc]


def deepspeed_config(params: dict[str, Any], env: Dist) -> dict[str, Any]:
    """DeepSpeed's JSON config, generated from params.yaml ``train``."""
    return {
        "train_micro_batch_size_per_gpu": int(params["micro_batch"]),
        "gradient_accumulation_steps": int(params["grad_accum"]),
        "gradient_clipping": float(params["grad_clip"]),
        "zero_optimization": {"stage": int(params["deepspeed_stage"]), "overlap_comm": env.device.type == "cuda"},
        "bf16": {"enabled": bf16_weights(env.device, params["precision"])},
        "zero_allow_untested_optimizer": True,  # torch AdamW, built by build_optimizer
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def build_engine(model: nn.Module, name: str, params: dict[str, Any], env: Dist,
                 make_optimizer: Any) -> Engine:
    """Wrap ``model`` for ``name`` and build its optimizer with ``make_optimizer(module)``."""
    if name == "deepspeed":
        import deepspeed

        model.to(env.device)
        ds_engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=make_optimizer(model), config=deepspeed_config(params, env)
        )
        return Engine(name, ds_engine, ds_optimizer, ds_engine)
    wrapped = wrap(model, name, env, params["reshard_after_forward"], params["precision"])
    return Engine(name, wrapped, make_optimizer(wrapped))


def compile_wanted(setting: bool | str, device: torch.device) -> bool:
    """train.compile (true, false or auto; the train step refuses anything else): auto compiles on
    GPUs, where it pays (benchmarks/train.py on an H100: 1.37-1.46x the eager step's steady rate
    for ~10 s of compiling), not on CPUs (no faster here once compiled, ~18 s per process)."""
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
    them again in the backward (train.reshard_after_forward: true, false or auto; the train step
    refuses anything else). Keeping them saves one all-gather of the whole model per step and
    holds the unsharded weights through the step (gradients and optimizer state stay sharded).
    auto: on GPUs every block but the last, whose weights the backward needs first (torchtitan's
    default; NCCL overlaps the gathers with compute); on CPUs none: gloo's all-gathers run on the
    critical path (benchmarks/train.py, docs/benchmarks.md)."""
    if setting == "auto":
        return [device.type == "cuda" and i < blocks - 1 for i in range(blocks)]
    return [bool(setting)] * blocks


def wrap(model: nn.Module, engine: str, env: Dist, reshard: bool | str = "auto", precision: str = "auto") -> nn.Module:
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: expected one of {', '.join(ENGINES)}")
    model.to(env.device)
    if engine == "single" or env.world == 1:  # nothing to shard or synchronize
        return model
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None)
    frees = reshard_after_forward(reshard, env.device, len(model.blocks))  # type: ignore[arg-type]
    return shard(model, frees, per_block_units(frees, env.device), env.device, bf16_weights(env.device, precision))


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


def unwrap(model: nn.Module) -> nn.Module:
    inner = getattr(model, "module", model)
    assert isinstance(inner, nn.Module)
    return inner


def all_reduce_mean(value: torch.Tensor, env: Dist) -> torch.Tensor:
    if env.world > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= env.world
    return value


def broadcast_object(value: Any, env: Dist) -> Any:
    """Rank 0's ``value`` on every rank."""
    if env.world == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def barrier(env: Dist) -> None:
    if env.world > 1:
        dist.barrier()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
