"""docs/tutorial.md's commands, in order: its code blocks are the tutorial. The page run as
written against the live stack (its stand-ins made, `make import`, `make retrain`, the chat), for
both families, is tests/dags/test_tutorial_path.py."""

from __future__ import annotations

from helpers import tutorial_commands


def test_the_tutorial_is_env_corpus_model_import_retrain_chat() -> None:
    kinds = [c.split()[1] if c.startswith("make ") else c.split()[2] for c in tutorial_commands()]
    assert kinds == ["env", "examples.make_corpus", "examples.tiny_base", "import", "retrain", "examples.chat"]
