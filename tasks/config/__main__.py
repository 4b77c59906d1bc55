"""``python -m tasks.config``: check params.yaml; ``--markdown``, ``--update-docs PAGE``: its reference."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from tasks.config.base import SettingsError
from tasks.config.load import load, params_path
from tasks.config.reference import reference, with_reference


def main(argv: Sequence[str]) -> int:
    """``python -m tasks.config``: check params.yaml (exit 2 and one line if a setting cannot be
    used); ``--markdown``: print the reference; ``--update-docs PAGE``: rewrite PAGE's reference."""
    if list(argv) == ["--markdown"]:
        print(reference(load()), end="")
        return 0
    if len(argv) == 2 and argv[0] == "--update-docs":
        page = Path(argv[1])
        page.write_text(with_reference(page.read_text(), load()))
        return 0
    try:
        load()
    except SettingsError as exc:
        print(f"ERROR {exc}", file=sys.stderr)
        return 2
    print(f"{params_path()}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
