"""Waiting for a condition with a deadline: the one loop behind every "until ready" of the
steps and the stack (Triton versions loaded, a Deployment rolled out, a route accepted, the
router's new workers, a server healthy)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(ready: Callable[[], bool], timeout_s: float, interval_s: float,
               timed_out: Callable[[], Exception]) -> None:
    """Return once ``ready()``; raise ``timed_out()`` if it is still not after ``timeout_s``
    (``ready`` is asked once more at the deadline; what it raises goes through at once)."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise timed_out()
        time.sleep(interval_s)
