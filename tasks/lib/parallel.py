"""The process group and its collectives, and the precision a device computes in.

``torchrun`` sets RANK / WORLD_SIZE / LOCAL_RANK; a plain ``python -m tasks.train`` runs alone.
NCCL on GPUs, gloo on CPUs. How the model is distributed over the group: tasks/train/engines.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


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
