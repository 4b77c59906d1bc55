"""``params.yaml`` for the steps: its typed settings (``tasks/config/``), refusals as bad input."""

from __future__ import annotations

from collections.abc import Sequence

from tasks.config import Settings, SettingsError, load
from tasks.lib.errors import StepError


def load_settings(section: str | None = None, overrides: Sequence[str] = ()) -> Settings:
    """The typed settings, a step's ``--set`` overrides applied to its ``section``: a setting that
    cannot be used is bad input (exit 2, one line naming it)."""
    try:
        return load(section=section, overrides=overrides)
    except SettingsError as exc:
        raise StepError(str(exc)) from None

