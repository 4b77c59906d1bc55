"""How the GPT is distributed: process group setup and the engines.

- ``fsdp2`` (default): ``fully_shard`` on every block, then on the root (tied embedding/head
  stay together in the root's group). bf16 parameters with fp32 reduction on accelerators.
- ``ddp``: ``DistributedDataParallel``, for small models.
- ``single``: one process, no wrapper (the baseline the benchmark compares against).

``torchrun`` sets RANK / WORLD_SIZE / LOCAL_RANK; a plain ``python -m tasks.train`` runs single.
NCCL on GPUs, gloo on CPUs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ENGINES = ("fsdp2", "ddp", "single")


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


def use_bf16(device: torch.device) -> bool:
    """bf16 only where it is fast: CUDA with bf16 support (on AVX2 CPUs it is ~19x slower)."""
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def wrap(model: nn.Module, engine: str, env: Dist) -> nn.Module:
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: expected one of {', '.join(ENGINES)}")
    model.to(env.device)
    if engine == "single" or env.world == 1:  # nothing to shard or synchronize
        return model
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if use_bf16(env.device) else MixedPrecisionPolicy()
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


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
