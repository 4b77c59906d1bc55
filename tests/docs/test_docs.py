"""README and docs/ stay true to the tree: every relative link and anchor resolves, every path of
the repository they name exists, every `make` target, step module and `python -m stack` command
they name is real, and each step module they name answers `--help`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO_ROOT

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
TOP_DIRS = ("dags", "plugins", "tasks", "stack", "observability", "containers", "benchmarks", "tests", "docs",
            "requirements", "examples", "evaluation")
TOP_FILES = ("params.yaml", "docker-compose.yaml", "dvc.yaml", "airflow.cfg", "pyproject.toml", ".ci/run")


def prose(page: Path) -> str:
    """The page without its fenced code blocks (diagrams, shell sessions)."""
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)


def anchors(page: Path) -> set[str]:
    """GitHub's ids of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#{1,6} (.+)$", prose(page), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def test_every_relative_link_and_anchor_resolves() -> None:
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(page)):
            if re.match(r"^[a-z]+://|^mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken
    assert anchors(REPO_ROOT / "docs" / "benchmarks.md") >= {"llm-serving-benchmarksserve_llmpy"}  # the slug rule


def test_every_repository_path_the_docs_name_exists() -> None:
    """A backticked path under one of the tree's folders (`tasks/lib/step.py`, `observability/`):
    a renamed file leaves no stale name behind. Placeholders (`<step>`, `*`) are skipped."""
    missing, named = [], 0
    pattern = re.compile(r"`((?:" + "|".join(TOP_DIRS) + r")/[\w./-]*|" + "|".join(map(re.escape, TOP_FILES)) + ")`")
    for page in PAGES:
        for path in pattern.findall(page.read_text()):
            named += 1
            if not (REPO_ROOT / path).exists():
                missing.append(f"{page.name}: {path}")
    assert not missing, missing
    assert named > 50  # the pattern finds what the pages name


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (REPO_ROOT / "Makefile").read_text(), flags=re.M))


def test_every_make_target_stack_command_and_step_module_named_exists() -> None:
    targets = makefile_targets()
    stack_doc = (REPO_ROOT / "stack" / "__main__.py").read_text()
    commands = set(re.search(r"choices=\[([^\]]+)\]", stack_doc, flags=re.S).group(1)  # type: ignore[union-attr]
                   .replace('"', "").replace("\n", "").replace(" ", "").split(","))
    wrong = []
    for page in PAGES:
        text = page.read_text()
        # `make x` in the prose, and `make x` commands in code blocks
        named = re.findall(r"`make ([a-z][\w-]*)", text) + re.findall(r"^\s*make ([a-z][\w-]*)", text, flags=re.M)
        wrong += [f"{page.name}: make {t}" for t in named if t not in targets]
        wrong += [f"{page.name}: python -m stack {c}" for c in re.findall(r"python -m stack ([a-z][\w-]*)", text)
                  if c not in commands]
        wrong += [f"{page.name}: {m}" for m in step_modules(text) if not module_file(m).exists()]
    assert not wrong, wrong


def step_modules(text: str) -> set[str]:
    """``tasks.<name>`` modules a page names (``tasks.lib...`` and ``tasks.serving...`` included),
    placeholders left out."""
    return set(re.findall(r"\btasks\.((?:(?:lib|serving)\.)?[a-z_]+)\b", text)) - {"lib", "serving"}


def module_file(name: str) -> Path:
    base = REPO_ROOT / "tasks" / Path(*name.split("."))
    return base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"


@pytest.mark.parametrize("module", sorted(m for m in step_modules((REPO_ROOT / "README.md").read_text())
                                          if not m.startswith("lib.")))
def test_each_step_the_readme_names_answers_help(module: str) -> None:
    proc = subprocess.run([sys.executable, "-m", f"tasks.{module}", "--help"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr[-2000:]
