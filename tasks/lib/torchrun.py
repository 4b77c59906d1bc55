"""``torchrun`` for a step, keeping the step contract's exit codes.

    python -m tasks.lib.torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:PORT --rdzv-id=ID --max-restarts=2 -m tasks.train ...

torchrun loses a worker's exit code: it restarts the group ``--max-restarts`` times and then
exits 1, which an orchestrator retries. A step with bad input (exit 2: nothing a restart or a
retry fixes) leaves its first line in a file this agent names (``STEP_BAD_INPUT_FILE``) and
stops the agent; the agent then exits 2 itself, in a local process and in a Job's pod alike.

In a Kubernetes Indexed Job, the pod of completion index 0 hosts the c10d rendezvous store
(``--rdzv-conf=is_host=...`` from ``JOB_COMPLETION_INDEX``), instead of torchrun guessing it
by matching host names.

On CPUs the agent starts its workers with tcmalloc (``LD_PRELOAD``, where the library is
installed), as PyTorch's CPU performance guide advises: glibc's malloc hands blocks above its
mmap threshold (32 MB at most) back to the kernel when they are freed, so every training step
page-faults its logits and their gradients in again (cpu-tiny, one process: 35k faults per step,
sys time 3.7 s of a 7 s loop; tcmalloc: 0.7 s). An ``LD_PRELOAD`` already in the environment,
even an empty one, is left as it is: that is how an operator keeps glibc or picks another.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
import tempfile
from collections.abc import Mapping, MutableMapping, Sequence
from pathlib import Path

from tasks.contract import BAD_INPUT_EXIT_CODE, BAD_INPUT_FILE_ENV


def with_rendezvous_host(argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """``argv`` with ``--rdzv-conf=is_host=`` set from the Job completion index, if any."""
    index = env.get("JOB_COMPLETION_INDEX")
    if index is None or any(arg.startswith("--rdzv-conf") for arg in argv):
        return list(argv)
    return [f"--rdzv-conf=is_host={'true' if index == '0' else 'false'}", *argv]


ALLOCATOR = "tcmalloc_minimal"  # Debian/Ubuntu: libtcmalloc-minimal4 (the Makefile and the runtime image install it)
# tcmalloc reports every allocation above 1 GB on stderr by default (a big model's state dict)
ALLOCATOR_ENV = {"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40)}


def preload_allocator(env: MutableMapping[str, str], on_gpu: bool) -> str | None:
    """Set ``env`` so the workers started with it run on tcmalloc (CPUs only: on a GPU the host
    allocator is off the hot path, and there it was not measured). Returns the library preloaded,
    None where the environment names its own ``LD_PRELOAD`` or tcmalloc is not installed."""
    if on_gpu or "LD_PRELOAD" in env:
        return None
    library = ctypes.util.find_library(ALLOCATOR)  # the soname the dynamic loader finds, e.g. libtcmalloc_minimal.so.4
    if library is None:
        print(f"lib{ALLOCATOR} is not installed (apt-get install libtcmalloc-minimal4): the workers use glibc's "
              "malloc, which re-faults large tensors every step", file=sys.stderr, flush=True)
        return None
    env.update({"LD_PRELOAD": library, **ALLOCATOR_ENV})
    return library


def malloc_in_use() -> str:
    """The allocator this process runs on: a preloaded tcmalloc or jemalloc, else glibc."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux
        return "system"
    return next((name for name in ("tcmalloc", "jemalloc") if f"lib{name}" in maps), "glibc")


def run(argv: Sequence[str]) -> int:
    """Run torchrun in this process; the exit code: 2 if a worker reported bad input."""
    import torch
    from torch.distributed import run as torch_run

    preload_allocator(os.environ, on_gpu=torch.cuda.is_available())  # the workers inherit the agent's env
    with tempfile.TemporaryDirectory(prefix="torchrun-step-") as scratch:
        bad_input = Path(scratch) / "bad-input"
        os.environ[BAD_INPUT_FILE_ENV] = str(bad_input)  # the workers inherit the agent's env
        try:
            torch_run.main(with_rendezvous_host(argv, os.environ))
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # ChildFailedError, SignalException: torchrun logged the cause
            if not bad_input.exists():
                raise
            code = 1
        if bad_input.exists():
            print(f"bad input, the worker group was not restarted: {bad_input.read_text().strip()}",
                  file=sys.stderr, flush=True)
            return BAD_INPUT_EXIT_CODE
        return code


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
