"""What every section of the settings shares: the repository (relative settings resolve against it),
the error a setting that cannot be used raises, and the checks of the sections' ``__post_init__``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


class SettingsError(ValueError):
    """A setting that cannot be used: the message names it (``train.lr``) and says why."""


def check(ok: bool, name: str, value: Any, expectation: str) -> None:
    if not ok:
        raise SettingsError(f"{name} {value!r}: {expectation}")


def positive(section: Any, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        check(value > 0, name, value, "expected > 0")


def at_least_zero(section: Any, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        check(value >= 0, name, value, "expected >= 0")


def fractions(section: Any, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        check(0 <= value <= 1, name, value, "expected a fraction in [0, 1]")
