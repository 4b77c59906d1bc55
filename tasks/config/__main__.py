"""``python -m tasks.config``: check params.yaml and the model lines; ``--markdown``, ``--update-docs
PAGE``: its reference."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from tasks.config.base import SettingsError
from tasks.config.lines import DEMO, current_line, line_path
from tasks.config.load import every_line, load, params_path
from tasks.config.reference import reference, with_reference


def main(argv: Sequence[str]) -> int:
    """``python -m tasks.config``: check params.yaml, the line ``PIPELINE_LINE`` names and every
    line file, together (exit 2 and one line if a setting cannot be used); ``--markdown``: print
    the reference; ``--update-docs PAGE``: rewrite PAGE's reference."""
    if list(argv) == ["--markdown"]:
        print(reference(load(line=DEMO)), end="")  # params.yaml's, whatever the line
        return 0
    if len(argv) == 2 and argv[0] == "--update-docs":
        page = Path(argv[1])
        page.write_text(with_reference(page.read_text(), load(line=DEMO)))
        return 0
    try:
        load()
        checked = every_line()
    except SettingsError as exc:
        print(f"ERROR {exc}", file=sys.stderr)
        return 2
    for line in checked:  # the demo line (params.yaml) first
        print(f"{params_path()}: ok" if line == DEMO else f"{line_path(line)}: ok")
    if current_line() != DEMO:
        print(f"PIPELINE_LINE={current_line()}: this process reads {line_path(current_line())} over {params_path()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
