"""docs/tutorial.md's commands, as written: its code blocks in order are the tutorial. Here its
stand-ins are made for real (the corpus and the checkpoint, into a temporary folder instead of
/tmp/tutorial), the checkpoint is one the tokenize step imports, `make import` expands (`make -n`)
to the import the page says and `make retrain`'s variables to the run configuration it says; the
import, the DAG run and the chat against a live stack are the manual run recorded in the closing
notes (a second stack in `make test` would not fit its time)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from helpers import REPO_ROOT, RUNTIME_PY, run_module, step_result

PAGE = REPO_ROOT / "docs" / "tutorial.md"


def commands() -> list[str]:
    blocks = re.findall(r"^```bash\n(.*?)^```", PAGE.read_text(), flags=re.M | re.S)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def test_the_tutorial_is_env_corpus_model_import_retrain_chat() -> None:
    kinds = [c.split()[1] if c.startswith("make ") else c.split()[2] for c in commands()]
    assert kinds == ["env", "examples.make_corpus", "examples.tiny_base", "import", "retrain", "examples.chat"]


@pytest.mark.torchrun  # the stand-ins take ~30 s to make
def test_the_tutorials_stand_ins_are_made_and_import_as_a_base(tmp_path: Path) -> None:
    steps = [c.replace("/tmp/tutorial", str(tmp_path)) for c in commands()]
    for command in steps[1:3]:  # the corpus, the checkpoint
        argv = shlex.split(command)
        assert argv[0] == ".venvs/runtime/bin/python"
        proc = subprocess.run([str(RUNTIME_PY), *argv[1:]], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(list((tmp_path / "corpus").glob("*.txt"))) == 1500
    assert len((tmp_path / "heldout.jsonl").read_text().splitlines()) == 200
    snapshot = tmp_path / "snapshot.jsonl"
    snapshot.write_text("".join(json.dumps({"text": p.read_text(), "content_hash": f"{i:064x}"}) + "\n"
                                for i, p in enumerate(sorted((tmp_path / "corpus").glob("*.txt"))[:50])))
    prepared = step_result(run_module(
        "tasks.tokenize", "prepare", "--snapshot", str(snapshot), "--base", str(tmp_path / "tiny-llama"),
        "--output", str(tmp_path / "prepare"), "--set", f"tokenizer_store={tmp_path / 'tok'}",
        "--set", f"base_store={tmp_path / 'bases'}", env={"MLFLOW_TRACKING_URI": ""}))
    assert prepared["tokenizer_source"] == "base"

    # the import expands to what the page says (a dry run: no stack here), and the retrain's
    # variables make the run configuration it says
    argv = shlex.split(steps[3])
    proc = subprocess.run([*argv[:2], "-n", *argv[2:]], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and f'-m tasks.ingest import "{tmp_path}/corpus"' in proc.stdout, proc.stderr[-2000:]
    variables = dict(arg.split("=", 1) for arg in shlex.split(steps[4])[2:])
    conf = json.loads(subprocess.run([str(RUNTIME_PY), "-m", "stack", "retrain-conf"], cwd=REPO_ROOT, text=True,
                                     capture_output=True, check=True, env={"PATH": "/usr/bin:/bin", **variables}).stdout)
    assert conf["train_base"] == str(tmp_path / "tiny-llama") and conf["eval_set_uri"] == str(tmp_path / "heldout.jsonl")
    assert conf["lookback_days"] == 1 and conf["end_date"]
