"""``python -m tasks.config``: check params.yaml and the model lines; ``--markdown``, ``--update-docs
PAGE``: its reference; ``--get KEY``: one setting of the current line."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from tasks.config.base import SettingsError
from tasks.config.lines import DEMO, current_line, line_path
from tasks.config.load import every_line, load, params_path
from tasks.config.reference import reference, with_reference


def setting(settings: object, key: str) -> str:
    """The value of a dotted settings key (``pipeline.dag_id``), as a shell reads it; a key that
    names no setting, or a whole section, raises :class:`SettingsError`."""
    value = settings
    for part in key.split("."):
        if not dataclasses.is_dataclass(value) or part not in {f.name for f in dataclasses.fields(value)}:
            raise SettingsError(f"--get {key}: no such setting")
        value = getattr(value, part)
    if dataclasses.is_dataclass(value):
        raise SettingsError(f"--get {key}: a section, not a setting")
    return json.dumps(value) if isinstance(value, (list, tuple, dict, bool)) or value is None else str(value)


def main(argv: Sequence[str]) -> int:
    """``python -m tasks.config``: check params.yaml, the line ``PIPELINE_LINE`` names and every
    line file, together (exit 2 and one line if a setting cannot be used); ``--markdown``: print
    the reference; ``--update-docs PAGE``: rewrite PAGE's reference; ``--get KEY``: print one
    setting of the line ``PIPELINE_LINE`` names (the Makefile's targets read a line's DAG id and
    raw data so)."""
    if len(argv) == 2 and argv[0] == "--get":
        try:
            print(setting(load(), argv[1]))
        except SettingsError as exc:
            print(f"ERROR {exc}", file=sys.stderr)
            return 2
        return 0
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
