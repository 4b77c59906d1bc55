"""What training measures: throughput per logging window, where the time went (data, evaluation,
checkpoints), and model FLOPs utilization against the peak this process can reach."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

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
    reached once is what they can do. The trainer probes before and after its loop."""
    return max(measured, key=lambda m: m[0])


def matmul_probe(device: torch.device, probe_size: int, repeats: int, bf16: bool = False,
                 budget_s: float = 2.0) -> tuple[float, str]:
    """FLOP/s of the best of ``repeats`` square matmuls (bf16 on GPUs, on CPUs fp32 unless
    ``bf16``) and what ran. The size is ``probe_size`` unless the repeats would take longer than
    ``budget_s``: a CPU without bf16 instructions emulates them ~40-100x slower than fp32 (a
    1024-square bf16 matmul took 10 s on an AVX2 core, and a bf16 run probed for minutes), so
    the size is the largest whose repeats fit the budget."""
    dtype = torch.bfloat16 if device.type == "cuda" or bf16 else torch.float32

    def timed(a: torch.Tensor, b: torch.Tensor) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - started

    def pair(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        torch.matmul(a, b)  # warm-up: thread pool, kernels
        return a, b

    # from a small size up: the cost goes with the cube of the size, so a size is tried only when
    # its repeats, estimated from the size below, fit the budget
    size = min(128, probe_size)
    a, b = pair(size)
    first = timed(a, b)
    while size < probe_size and first * 8 * repeats <= budget_s:
        size = min(size * 2, probe_size)
        a, b = pair(size)
        first = timed(a, b)
    best = min([first, *(timed(a, b) for _ in range(repeats - 1))])
    kind = "bf16" if dtype == torch.bfloat16 else "fp32"
    return 2 * size**3 / best, f"measured {kind} matmul ({size}x{size}), {torch.get_num_threads()} thread(s)"


@dataclass(frozen=True)
class CheckpointTimes:
    """What the run's checkpoints cost (:class:`~tasks.train.checkpoint.Checkpointer`'s): per
    save, how long the loop waited (``stalls``) and how long until the checkpoint was complete
    (``save_seconds``); and the loop's whole wait on checkpoints (``blocking_seconds``)."""

    stalls: list[float]
    save_seconds: list[float]
    blocking_seconds: float


class Meters:
    """Timers of one training run: a window between two logged steps, and the run as a whole."""

    def __init__(self, tokens_per_step: int, started_step: int, max_steps: int) -> None:
        self.tokens_per_step, self.started_step, self.max_steps = tokens_per_step, started_step, max_steps
        self.started = time.perf_counter()
        self.stopped: float | None = None
        self.data_seconds = self.eval_seconds = 0.0
        self._reset_window()

    def _reset_window(self) -> None:
        self.window_start, self.window_steps, self.window_data_seconds = time.perf_counter(), 0, 0.0

    def loaded(self, seconds: float) -> None:
        """A micro-batch's loading time."""
        self.data_seconds += seconds
        self.window_data_seconds += seconds

    def stepped(self) -> None:
        self.window_steps += 1

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.eval_seconds += time.perf_counter() - started

    def stop(self) -> None:
        """The run's clock stops (what follows, e.g. a second peak probe, is not training)."""
        self.stopped = time.perf_counter()

    def window(self, step: int) -> dict[str, float]:
        """The window since the last call: its rate, step time, data share, and the run's ETA."""
        elapsed = time.perf_counter() - self.window_start
        done = step - self.started_step
        figures = {
            "tokens_per_s": self.window_steps * self.tokens_per_step / elapsed,
            "step_time_s": elapsed / max(self.window_steps, 1),
            "data_loading_share": self.window_data_seconds / elapsed,
            "eta_s": (self.max_steps - step) * (time.perf_counter() - self.started) / max(done, 1),
        }
        self._reset_window()
        return figures

    def summary(self, step: int, world: int, flops_per_token: float, peak: tuple[float, str],
                checkpoints: CheckpointTimes) -> dict[str, Any]:
        """The run's figures: throughput, MFU of this process (its share of the tokens against its
        device's peak), and the shares of data loading, evaluation and checkpoint stalls."""
        stalls, save_seconds = checkpoints.stalls, checkpoints.save_seconds
        seconds = (self.stopped or time.perf_counter()) - self.started
        trained_tokens = (step - self.started_step) * self.tokens_per_step
        process_rate = trained_tokens / seconds / world if trained_tokens else 0.0
        return {
            "tokens_per_s": trained_tokens / seconds if trained_tokens else 0.0,
            "mfu": process_rate * flops_per_token / peak[0],
            "peak_flops": peak[0],
            "peak_source": peak[1],
            "data_loading_share": self.data_seconds / seconds,
            "eval_share": self.eval_seconds / seconds,
            "checkpoint_share": checkpoints.blocking_seconds / seconds,
            # per save: how long the loop waited (the median, and each: the first save also
            # allocates the staging buffers), and how long until the checkpoint was complete
            "checkpoint_stall_s": float(np.median(stalls)) if stalls else 0.0,
            "checkpoint_stalls_s": tuple(round(s, 4) for s in stalls),
            "checkpoint_save_s": float(np.mean(save_seconds)) if save_seconds else 0.0,
        }
