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
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from tasks.lib.step import BAD_INPUT_EXIT_CODE, BAD_INPUT_FILE_ENV


def with_rendezvous_host(argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """``argv`` with ``--rdzv-conf=is_host=`` set from the Job completion index, if any."""
    index = env.get("JOB_COMPLETION_INDEX")
    if index is None or any(arg.startswith("--rdzv-conf") for arg in argv):
        return list(argv)
    return [f"--rdzv-conf=is_host={'true' if index == '0' else 'false'}", *argv]


def run(argv: Sequence[str]) -> int:
    """Run torchrun in this process; the exit code: 2 if a worker reported bad input."""
    from torch.distributed import run as torch_run

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
