"""README and docs/ stay true to the tree: every relative link and anchor resolves, every path of
the repository they name exists, every `make` target, step module and `python -m stack` command
they name is real, and each step module they name answers `--help`. The lists they give are the
code's (stack commands, step sub-commands, environment variables, make targets, launcher modes,
apt packages, where the exit codes live), read from the code, the Makefile and the parsers, and
the sample output of configuration.md is what its commands print."""

from __future__ import annotations

import argparse
import ast
import os
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


def test_every_docs_page_is_on_the_index_which_the_readme_links() -> None:
    """docs/index.md maps the pages by layer: a new page is put on it, and README leads there."""
    index = REPO_ROOT / "docs" / "index.md"
    linked = {(index.parent / target.partition("#")[0]).resolve()
              for target in re.findall(r"\]\(([^)\s]+)\)", prose(index)) if not re.match(r"^[a-z]+://", target)}
    pages = {page.resolve() for page in (REPO_ROOT / "docs").glob("*.md")} - {index.resolve()}
    assert len(pages) > 20  # the glob sees the pages
    assert not pages - linked, f"docs/index.md does not link {sorted(page.name for page in pages - linked)}"
    assert "docs/index.md" in re.findall(r"\]\(([^)\s#]+)", prose(REPO_ROOT / "README.md")), "README does not link docs/index.md"


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


def stack_commands() -> set[str]:
    """The ``command`` choices of ``python -m stack``'s parser (stack/__main__.py), read from its code."""
    tree = ast.parse((REPO_ROOT / "stack" / "__main__.py").read_text())
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
                and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "command"):
            return set(next(ast.literal_eval(k.value) for k in node.keywords if k.arg == "choices"))
    raise AssertionError("stack/__main__.py: no add_argument('command', choices=...)")


def test_every_make_target_stack_command_and_step_module_named_exists() -> None:
    targets = makefile_targets()
    commands = stack_commands()
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


# -- what the pages say about the code: each list they give is the code's ---------------------


def layout_entry(path: str) -> str:
    """README's Layout line for ``path`` with its continuation lines, joined by single spaces."""
    block = re.search(r"^## Layout\n+```\n(.*?)^```", (REPO_ROOT / "README.md").read_text(), flags=re.M | re.S)
    entry = re.search(rf"^{re.escape(path)} +(.*?)(?=^\S|\Z)", block.group(1), flags=re.M | re.S)  # type: ignore[union-attr]
    assert entry, f"README's Layout has no {path} line"
    return " ".join(entry.group(1).split())


def usage_commands(module: str) -> set[str]:
    """The commands a module's docstring shows as ``python -m MODULE COMMAND`` lines."""
    doc = ast.get_docstring(ast.parse((REPO_ROOT / Path(*module.split("."))).with_suffix(".py").read_text())) or ""
    return set(re.findall(rf"^\s*python -m {re.escape(module.removesuffix('.__main__'))} ([a-z][\w-]*)", doc, flags=re.M))


def test_every_stack_command_is_in_its_usage_and_the_readmes_layout() -> None:
    commands = stack_commands()
    assert usage_commands("stack.__main__") == commands, "stack/__main__.py's usage lines differ from its parser"
    named = set(re.findall(r"[a-z][\w-]*", layout_entry("stack/").partition("python -m stack")[2]))
    assert not commands - named, f"README's Layout (stack/) does not name {sorted(commands - named)}"


def step_module_names() -> set[str]:
    """The ``tasks/<step>.py`` modules run as steps: those building a step parser."""
    return {path.stem for path in (REPO_ROOT / "tasks").glob("*.py") if "\ndef parser(" in path.read_text()}


def sub_commands(module: str) -> set[str]:
    """A step module's sub-commands, from its argparse parser (empty: it has none)."""
    import importlib

    parser = importlib.import_module(f"tasks.{module}").parser()
    return {name for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for name in action.choices}


def test_the_readmes_layout_names_every_step_module_and_each_sub_command() -> None:
    named = {m: set(filter(None, re.split(r"\s*/\s*", subs))) for m, subs in
             re.findall(r"(\w+)(?: \(([^)]*)\))?(?:,|$)", layout_entry("tasks/<step>.py"))}
    steps = step_module_names()
    assert set(named) == steps, f"README's Layout (tasks/<step>.py) lacks {sorted(steps - set(named))}, " \
                                f"names {sorted(set(named) - steps)}"
    wrong = {m: sorted(commands) for m in named if (commands := sub_commands(m)) != named[m]}
    assert not wrong, f"README's Layout names other sub-commands than the parsers': {wrong}"
    assert named["deploy"] >= {"canary", "finish", "release"}  # the parse sees the sub-commands


def top_level_assignments(path: Path) -> dict[str, ast.expr]:
    """What a module assigns to a name at its top level: name -> the value's expression (read, not imported)."""
    return {target.id: node.value for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(target, ast.Name)}


def environment_reads(*folders: str) -> set[str]:
    """The variables code in ``folders`` reads from ``os.environ`` by name (``os.environ[NAME]``,
    ``.get(NAME)``, ``os.getenv(NAME)``, ``NAME in os.environ``; NAME a literal or a module-level
    constant); what it only sets (``setdefault``, assignment) is left out."""
    names = set()
    for path in (p for folder in folders for p in sorted((REPO_ROOT / folder).rglob("*.py"))):
        constants = {name: value.value for name, value in top_level_assignments(path).items()
                     if isinstance(value, ast.Constant) and isinstance(value.value, str)}
        for node in ast.walk(ast.parse(path.read_text())):
            key: ast.expr | None = None
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and ast.unparse(node.value) == "os.environ":
                key = node.slice
            elif isinstance(node, ast.Call) and node.args and ast.unparse(node.func) in ("os.environ.get", "os.getenv"):
                key = node.args[0]
            elif (isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn))
                  and ast.unparse(node.comparators[0]) == "os.environ"):
                key = node.left
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                names.add(key.value)
            elif isinstance(key, ast.Name) and key.id in constants:
                names.add(constants[key.id])
    return names


# set for a step's process by whoever starts it, not by people: torchrun, the local launcher, Kubernetes
SET_FOR_THE_PROCESS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS",
                       "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"}


def environment_table() -> set[str]:
    """The variables configuration.md's Environment table names (``STACK_PORT_<NAME>`` as written)."""
    page = (REPO_ROOT / "docs" / "configuration.md").read_text()
    section = page[page.index("## Environment\n"):page.index("## Reference\n")]
    return {name for row in re.findall(r"^\| (.*?) \|", section, flags=re.M) for name in re.findall(r"`([A-Z][\w<>]*)`", row)}


def test_the_environment_table_names_every_variable_the_pipeline_reads(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    """What stack.env gives the steps, what the cluster's Secrets hold, and what tasks/, plugins/
    and dags/ read from the environment by name."""
    from stack.credentials import steps_env

    monkeypatch.setenv("STACK_DIR", str(tmp_path))  # its generated keys, here
    secrets = ast.literal_eval(top_level_assignments(REPO_ROOT / "plugins" / "cluster.py")["SECRET_VARIABLES"])
    read = environment_reads("tasks", "plugins", "dags")
    assert {"LOG_LEVEL", "PIPELINE_ALERT_WEBHOOK_URL", "PIPELINE_GIT_COMMIT"} <= read  # the reads are seen
    wanted = (set(steps_env()) | {v for required, optional in secrets.values() for v in (*required, *optional)}
              | read) - SET_FOR_THE_PROCESS
    missing = wanted - environment_table()
    assert not missing, f"docs/configuration.md's Environment table lacks {sorted(missing)}"


def test_the_glossarys_launcher_modes_are_the_settings() -> None:
    from tasks.config import LauncherSettings, choices

    rows = [row for row in (REPO_ROOT / "docs" / "glossary.md").read_text().splitlines() if "`launcher.mode`" in row]
    assert len(rows) == 1, rows
    named, accepted = re.findall(r"`(\w+)`", rows[0].split("|")[1]), choices(LauncherSettings, "mode")
    assert named == accepted, f"the glossary's launcher modes are {named}, launcher.mode accepts {accepted}"


def make_help() -> str:
    return subprocess.run(["make", "-s", "help"], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout


def make_help_targets() -> set[str]:
    """The targets ``make help`` lists (``make up/down``: both)."""
    return {t for first in re.findall(r"^make (\S+)", make_help(), flags=re.M) for t in first.split("/")}


def test_make_help_lists_every_target_the_pages_name_and_the_readme_each_of_those() -> None:
    listed = make_help_targets()
    named = {page.name: set(re.findall(r"`make ([a-z][\w-]*)", page.read_text())
                            + re.findall(r"^\s*make ([a-z][\w-]*)", page.read_text(), flags=re.M)) for page in PAGES}
    missing = {page: sorted(targets - listed - {"help"}) for page, targets in named.items() if targets - listed - {"help"}}
    assert not missing, f"named by the pages, not in `make help`: {missing}"
    assert listed <= makefile_targets(), sorted(listed - makefile_targets())
    assert not listed - named["README.md"], f"in `make help`, not in README: {sorted(listed - named['README.md'])}"


def test_make_up_is_described_with_every_server_it_starts() -> None:
    """`make help`'s up/down entry and README's `make up` row name each server of the stack, the
    row with its port."""
    from stack.servers import SERVERS
    from tasks.config import load

    help_entry = re.search(r"^make up/down .*?(?=^make )", make_help(), flags=re.M | re.S).group(0)  # type: ignore[union-attr]
    row = next(line for line in (REPO_ROOT / "README.md").read_text().splitlines() if line.startswith("| `make up`"))
    ports = load().stack.ports
    for server in SERVERS:
        word = server.name.split("-")[0]
        assert re.search(word, help_entry, flags=re.I), f"`make help` (make up/down) does not name {server.name}"
        assert re.search(word, row, flags=re.I), f"README's `make up` row does not name {server.name}"
        assert server.port is None or f":{ports[server.port]}" in row, f"README's `make up` row: {server.name}'s port"


def test_the_exit_codes_are_defined_once_where_architecture_says() -> None:
    from tasks import contract

    defined = sorted(str(path.relative_to(REPO_ROOT)) for folder in ("tasks", "plugins", "dags")
                     for path in (REPO_ROOT / folder).rglob("*.py")
                     if any(name.endswith("_EXIT_CODE") for name in top_level_assignments(path)))
    assert defined == ["tasks/contract.py"], defined
    page = (REPO_ROOT / "docs" / "architecture.md").read_text()
    assert "defined once, in `tasks/contract.py`" in " ".join(page.split())
    table = {int(code) for code in re.findall(r"^\| (\d+) \|", page, flags=re.M)}
    codes = {getattr(contract, name) for name in dir(contract) if name.endswith("_EXIT_CODE")}
    assert codes and codes <= table, f"architecture.md's exit code table lacks {sorted(codes - table)}"


def test_configurations_sample_output_is_what_the_commands_print() -> None:
    """docs/configuration.md's first block, run: each ``$`` command prints the lines under it
    (the checkout's path written ``~/llm-pipeline``)."""
    block = re.search(r"^```\n(\$ .*?)^```", (REPO_ROOT / "docs" / "configuration.md").read_text(), flags=re.M | re.S)
    sessions = re.findall(r"^\$ (.*)\n((?:[^$].*\n)*)", block.group(1), flags=re.M)  # type: ignore[union-attr]
    assert len(sessions) == 3, sessions
    for command, expected in sessions:
        argv = command.split("#")[0].split()
        assert argv[0] == ".venvs/runtime/bin/python", command
        proc = subprocess.run([sys.executable, *argv[1:]], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                              env={k: v for k, v in os.environ.items() if k != "PIPELINE_PARAMS"})
        printed = (proc.stdout + proc.stderr).replace(str(REPO_ROOT), "~/llm-pipeline").splitlines()
        missing = [line for line in expected.splitlines() if line not in printed]
        assert not missing, f"{command}: printed {printed[-5:]}, not {missing}"


def test_the_compose_page_says_how_triton_is_built() -> None:
    import yaml

    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yaml").read_text())
    device = compose["services"]["triton"]["build"]["args"]["DEVICE"]
    default = re.search(r"^ARG DEVICE=(\w+)", (REPO_ROOT / "containers" / "Dockerfile.serving").read_text(), flags=re.M)
    page = " ".join((REPO_ROOT / "docs" / "compose.md").read_text().split())
    assert f"`DEVICE: {device}`" in page, f"compose.md does not say Triton is built with DEVICE {device}"
    assert f"`DEVICE: {default.group(1)}`" in page, "compose.md's GPU recipe does not name the GPU build"  # type: ignore[union-attr]


def test_the_quick_start_names_every_package_the_makefile_installs() -> None:
    makefile = (REPO_ROOT / "Makefile").read_text()
    installed = {pkg for args in re.findall(r"apt-get install (-y[^)]*)\)", makefile) for pkg in args.split()
                 if not pkg.startswith("-")}
    readme = " ".join((REPO_ROOT / "README.md").read_text().split())
    sentence = re.search(r"with apt-get where missing, (.*?)\. ", readme).group(1)  # type: ignore[union-attr]
    named = set(re.findall(r"`([^`]+)`", sentence))
    assert named == installed, f"README's quick start lacks {sorted(installed - named)}, names {sorted(named - installed)}"


def test_the_gates_regression_bound_is_quoted_as_params_yaml_sets_it() -> None:
    from tasks.config import load

    bound = round(load().evaluate.max_regression * 100, 6)
    quoted = [(page.name, float(pct)) for page in PAGES for pct in
              re.findall(r"(\d+(?:\.\d+)?) ?%[^`|]{0,40}`(?:evaluate\.)?max_regression`", page.read_text())
              + re.findall(r"`(?:evaluate\.)?max_regression` \((\d+(?:\.\d+)?) ?%\)", page.read_text())]
    assert len(quoted) >= 2, f"README and steps.md quote evaluate.max_regression as a percentage: {quoted}"
    assert all(pct == bound for _, pct in quoted), f"params.yaml's evaluate.max_regression is {bound} %: {quoted}"
