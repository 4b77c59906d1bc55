"""The demo corpus's reader (tasks/seed.py), in this process: the raw partitions the local stack
is seeded with (written and versioned on the real stack: tests/tasks/test_data_steps.py)."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

from tasks import seed

SOURCE = textwrap.dedent('''
    """A module docstring."""
    import sys

    if sys.platform:
        class InIf:
            """A class in an if."""
            def method(self):
                """A method."""
                def inner():
                    """A function in a method."""
    try:
        def in_try():
            """In a try."""
    except ImportError:
        def in_handler():
            """In an exception handler."""
    else:
        pass
    finally:
        async def in_finally():
            """In a finally."""
    match sys.argv:
        case [_]:
            def in_case():
                """In a match case."""
    with open(__file__) as f:
        for line in f:
            while line:
                class Deep:
                    """Nested in with, for, while."""
    values = [lambda: None for _ in range(3)]
    def last():
        """At the top, after the others."""
''')
DEFINED = {"InIf", "method", "inner", "in_try", "in_handler", "in_finally", "in_case", "Deep", "last"}


def test_statements_find_every_definition_in_ast_walks_order() -> None:
    """Only statement lists are walked (a definition is a statement); the corpus keeps the order
    ``ast.walk`` gives, or the demo data would change."""
    tree = ast.parse(SOURCE)
    kinds = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    walked = [node.name for node in ast.walk(tree) if isinstance(node, kinds)]
    assert [node.name for node in seed.statements(tree) if isinstance(node, kinds)] == walked
    assert sorted(walked) == sorted(DEFINED)
    assert not any(isinstance(node, ast.expr) for node in seed.statements(tree))


def test_docstrings_name_each_definition_by_module(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "mod.py").write_text(SOURCE.replace('."""', '.' + " and some more words" * 4 + '"""'))
    (package / "broken.py").write_text("def (:\n")
    names = [name for name, _ in seed.docstrings(package / "mod.py", tmp_path)]
    assert names[0] == "pkg.mod" and len(names) == 10
    assert {name.removeprefix("pkg.mod.") for name in names[1:]} == DEFINED
    assert list(seed.docstrings(package / "broken.py", tmp_path)) == []
