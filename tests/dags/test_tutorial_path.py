"""docs/tutorial.md run as written, against the session's stack, for both families a base
checkpoint may be: the tutorial's tiny Llama (grouped-query attention, an untied head, Llama 3's
tokens and template) and a tiny Qwen2 (q/k/v biases, ChatML, no BOS). Its stand-ins are made, the
corpus imported (`make import`), the line retrained from the checkpoint through its retrain DAG
(`make retrain`: the checkpoint's tokenizer and weights, perplexity on the held-out file and the
lm-eval demo suite, export, canary, promotion), then asked through the router with the openai SDK
(`examples.chat`), the model's own template rendering the messages.

Each family runs as a model line of its own (``LINE=tutorial-<family>``, a line file that only
shortens training and the canary): the session's demo line keeps the champion the other modules
read, and the page's commands are otherwise run unchanged."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import REPO_ROOT, RUNTIME_PY, step_result, ti_states, tutorial_commands, xcom

pytestmark = pytest.mark.integration
FAMILIES = ("llama", "qwen2")
# what the line file changes: a shorter run, judged as the tutorial's is
LINE_SETTINGS = {"train": {"nodes": 1, "max_steps": 60},
                 "evaluate": {"max_eval_tokens": 4096}, "export": {"parity_windows": 4},
                 "canary": {"step_duration_s": 3}}


@pytest.fixture(scope="module")
def lines_dir(stack_env: dict[str, str], airflow_db: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A lines folder with one tutorial line per family, in the environment while the module runs."""
    folder = tmp_path_factory.mktemp("tutorial-lines")
    for family in FAMILIES:
        settings = {**LINE_SETTINGS, "pipeline": {"model_name": f"tutorial-{family}-{time.time_ns()}"}}
        (folder / f"tutorial-{family}.yaml").write_text(yaml.safe_dump(settings))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PIPELINE_LINES_DIR", str(folder))
        yield folder


def as_run(command: str, folder: Path, family: str) -> list[str]:
    """A command of the page: its folder the test's, its Llama the family's, a make target on the line."""
    command = command.replace("/tmp/tutorial", str(folder)).replace("--family llama", f"--family {family}")
    argv = shlex.split(command.replace("tiny-llama", f"tiny-{family}"))
    if argv[0] == "make":
        return [*argv, f"LINE=tutorial-{family}"]
    assert argv[0] == ".venvs/runtime/bin/python", command
    return [str(RUNTIME_PY), *argv[1:]]


def run(argv: list[str], timeout_s: int) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"{shlex.join(argv)}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def newest_run(dag_id: str) -> Any:
    from airflow.models.dagrun import DagRun

    return max(DagRun.find(dag_id=dag_id), key=lambda r: r.run_after)


def chat_through_the_router(model: str) -> tuple[dict[str, Any], str]:
    """The tutorial's chat as a raw request: the answer and the version the router sent it to."""
    body = {"model": model, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "system", "content": "You answer in one line."},
                         {"role": "user", "content": "Return the number of items in a list"}]}
    request = urllib.request.Request(f"{os.environ['ROUTER_URL']}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read()), resp.headers["X-Model-Version"]


@pytest.mark.timeout(1800)  # the whole retrain DAG, beside the other process's runs on 2 cores
@pytest.mark.parametrize("family", FAMILIES)
def test_the_tutorial_retrains_a_base_on_an_imported_corpus_and_chats_with_it(
    family: str, lines_dir: Path, tmp_path: Path
) -> None:
    line = f"tutorial-{family}"
    model = yaml.safe_load((lines_dir / f"{line}.yaml").read_text())["pipeline"]["model_name"]
    make_env, corpus, checkpoint, import_corpus, retrain, chat = tutorial_commands()
    assert make_env == "make env"  # the session's environments
    for command in (corpus, checkpoint):
        run(as_run(command, tmp_path, family), timeout_s=600)
    assert len((tmp_path / "heldout.jsonl").read_text().splitlines()) == 200  # the page's held-out documents
    imported = step_result(run(as_run(import_corpus, tmp_path, family), timeout_s=600))
    assert imported["source"] == str(tmp_path / "corpus") and imported["imported"] == 1500 and imported["bad"] == 0, \
        imported

    output = run(as_run(retrain, tmp_path, family), timeout_s=1500).stdout
    dag_run = newest_run(f"llm_retrain__{line}")
    assert dag_run.state == "success", (ti_states(dag_run), output[-3000:])
    assert dag_run.conf["lookback_days"] == 1  # LOOKBACK=1: the corpus is one day's
    # the checkpoint's tokenizer and weights, in its architecture
    tokenizer = xcom(dag_run, "tokenizer")
    assert tokenizer["tokenizer_source"] == "base" and tokenizer["base"]["uri"] == str(tmp_path / f"tiny-{family}")
    assert xcom(dag_run, "train")["initialized_from"] == tokenizer["init_model_uri"]
    # judged on the held-out file and on the lm-eval demo suite, then the line's first version promoted
    evaluate = xcom(dag_run, "evaluate")
    assert evaluate["passed"] and evaluate["eval_set_uri"] == str(tmp_path / "heldout.jsonl"), evaluate
    assert set(evaluate["tasks"]) == {"demo_continuation_choice", "demo_next_word"}, evaluate
    version = str(xcom(dag_run, "register")["version"])
    assert xcom(dag_run, "deploy")["verdict"] == "promoted"
    assert re.search(rf"^llm_retrain__{line} \S+: SUCCESS: ", output, re.M), output[-3000:]  # make report's summary

    # the page's chat: the openai SDK through the router, to the line's model
    answered = run([*as_run(chat, tmp_path, family), "--model", model], timeout_s=120).stdout
    printed = re.match(rf"\[{re.escape(model)}, (\d+) prompt tokens\]", answered)
    assert printed, answered
    prompt_tokens = int(printed[1])
    reply, served_by = chat_through_the_router(model)
    assert served_by == version and reply["model"] == model
    # the model's own template rendered the messages, the same way both times (tests/tasks/serving/
    # test_base_chat.py checks the rendering and the engine's answer token for token)
    assert reply["usage"]["prompt_tokens"] == prompt_tokens > 20
