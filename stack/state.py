"""The stack's folder (``.stack/`` or ``$STACK_DIR``: data, logs, PIDs, keys), its ports, and
how a private file in it is written."""

from __future__ import annotations

import os
from pathlib import Path

from tasks.config import load

REPO_ROOT = Path(__file__).resolve().parents[1]


def state_dir() -> Path:
    path = Path(os.environ.get("STACK_DIR", REPO_ROOT / ".stack"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def ports() -> dict[str, int]:
    configured = load().stack.ports
    return {name: int(os.environ.get(f"STACK_PORT_{name.upper()}", port)) for name, port in configured.items()}


def write_private(path: Path, text: str, mode: int = 0o600) -> None:
    """A file only its owner can read (or ``mode``), from its first byte (its mode set before
    anything is written, not chmod'ed after), replaced atomically: a reader sees the old file or
    the new one, each readable as it should be."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, mode)  # exactly mode, whatever the umask
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(staged, path)


def triton_repository() -> Path:
    return state_dir() / "triton" / "models"


def router_dir() -> Path:
    return state_dir() / "router"
