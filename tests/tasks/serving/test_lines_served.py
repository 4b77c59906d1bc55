"""Two model lines behind one API, against the real router, OpenAI front and Triton: the demo
line (our GPT) and a line of its own file (``lines/support.yaml``) whose model is a base
checkpoint (a tiny Llama, its own tokenizer and chat template), each with its own Triton models,
split, deploy lock and champion. A request's ``model`` picks the line. Both lines' first models
roll out at once, each ending as its canary judged it with its line's route saying so; then a
broken build of the support line is rolled back in its shadow while the demo line's lock is held
and its client streams through the same router, and that client sees no error and no other
version."""

from __future__ import annotations

import fcntl
import json
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from helpers import (
    FIFTH_CHANGED,
    REPO_ROOT,
    RUNTIME_PY,
    clone_export,
    error_lines,
    export,
    imported_base,
    params_with_model_name,
    register_gpt,
    register_model_dir,
    run_module,
    step_result,
    write_eval_text,
)

from tasks.lib import triton
from tasks.serving.router import NginxRouter

pytestmark = [pytest.mark.integration, pytest.mark.timed]  # a rollout's canary judges latencies
LINE = "support"
SUPPORT_MODELS = ("llm__support", "llm_generate__support")  # the line's Triton models (lines.apart_defaults)
CANARY = ["--set", "step_duration_s=3", "--set", "rate_rps=40", "--set", "min_samples=8", "--set", "text_rps=16",
          "--set", "text_min_samples=6"]


@pytest.fixture(scope="module")
def lines_stack(stack_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The stack brought up again with a second line: `stack up` restarts the router and the
    front, which serve the lines their settings name; brought back to the demo line alone after."""
    folder = tmp_path_factory.mktemp("lines")
    demo = params_with_model_name("lines-demo", folder)
    (folder / "lines").mkdir()
    support_name = f"lines-support-{time.time_ns()}"
    (folder / "lines" / f"{LINE}.yaml").write_text(yaml.safe_dump({"pipeline": {"model_name": support_name}}))
    env = {**stack_env, **demo, "PIPELINE_LINES_DIR": str(folder / "lines"), "SUPPORT_NAME": support_name}
    router_pid = (Path(stack_env["STACK_DIR"]) / "router.pid").read_text()
    proc = run_module("stack", "up", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the router takes the new line by a reload (no request refused), not a restart
    assert (Path(stack_env["STACK_DIR"]) / "router.pid").read_text() == router_pid
    try:
        yield env
    finally:  # the line's route emptied (and pushed so: no alert on it), its models unloaded
        from tasks.lib.params import load_settings
        from tasks.serving.platforms import publish_route
        from tasks.serving.router import Route

        NginxRouter(Path(env["ROUTER_DIR"]), env["ROUTER_URL"], env["ROUTER_INTERNAL_URL"], line=LINE).apply(None)
        publish_route(Route(None), load_settings().serve, env, line=LINE)
        client = triton.TritonClient(env["TRITON_URL"])
        for model in reversed(SUPPORT_MODELS):
            client.unload(model)
        proc = run_module("stack", "up", env=stack_env)  # the demo line alone again
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (Path(stack_env["STACK_DIR"]) / "router.pid").read_text() == router_pid


def call(env: dict[str, str], path: str, body: dict[str, Any] | bytes | None = None) -> tuple[int, dict[str, Any], str]:
    """One request through the router's public listener: status, JSON body, the version that answered."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(f"{env['ROUTER_URL']}{path}", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            answer = json.loads(resp.read()) if resp.headers.get_content_type() == "application/json" else {}
            return resp.status, answer, resp.headers.get("X-Model-Version", "")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}"), exc.headers.get("X-Model-Version", "")


class DemoClient:
    """Streamed completions naming no model (the demo line's) through the router for the whole
    test, counted by the version that answered and whether they ended whole."""

    def __init__(self, env: dict[str, str]) -> None:
        self.url = f"{env['ROUTER_URL']}/v1/completions"
        self.answers: Counter[str] = Counter()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def loop(self) -> None:
        from tasks.serving.traffic import Target, one_stream

        body = json.dumps({"prompt": "Return the number of", "max_tokens": 8, "stream": True}).encode()
        while not self.stop.is_set():
            sample = one_stream(Target(self.url), body, "", 30.0)
            self.answers[f"{sample.version}:{'ok' if sample.ok else sample.status}"] += 1
            time.sleep(0.05)

    def __enter__(self) -> DemoClient:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=40)


def live_states(env: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Every line's route as the live router applies it."""
    with urllib.request.urlopen(f"{env['ROUTER_URL']}/router/state", timeout=5) as resp:
        states: dict[str, dict[str, Any]] = json.loads(resp.read())
        return states


def deploy(env: dict[str, str], version: str, export_uri: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """``tasks.deploy canary`` of a version, as the line of ``env`` (``PIPELINE_LINE``) runs it."""
    command = [str(RUNTIME_PY), "-m", "tasks.deploy", *CANARY, "canary", "--model-version", version,
               "--export", str(export_uri), "--output", str(out)]
    return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)


def deploy_both_at_once(first: tuple[dict[str, str], str, Path, Path],
                        second: tuple[dict[str, str], str, Path, Path]) -> list[subprocess.CompletedProcess[str]]:
    """Two deploys started together, each to its end."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda args: deploy(*args), (first, second)))


def test_one_api_serves_two_lines_and_one_lines_rollout_leaves_the_other_alone(
        lines_stack: dict[str, str], tokenizer_uri: str, snapshot: Path, tmp_path: Path) -> None:
    env = lines_stack
    support_env = {**env, "PIPELINE_LINE": LINE}
    support_name = env["SUPPORT_NAME"]
    eval_text = write_eval_text(tmp_path, 600, 640)
    assert set(live_states(env)) == {"demo", LINE}  # every line's split, each its own
    router = NginxRouter(Path(env["ROUTER_DIR"]), env["ROUTER_URL"], env["ROUTER_INTERNAL_URL"])
    router.apply(None)  # the demo line's route as a fresh stack has it (an earlier module may have used it)

    # neither line serves yet: 503 in OpenAI's shape for each; another model is a 404 naming both
    asked = {"prompt": "Return the number of", "max_tokens": 4}
    for model in (support_name, env["MODEL_NAME"]):
        status, answer, _ = call(env, "/v1/completions", {**asked, "model": model})
        assert status == 503 and answer["error"]["code"] == "no_version" and model in answer["error"]["message"]
    status, answer, _ = call(env, "/v1/completions", {**asked, "model": "no-such-model"})
    assert status == 404 and answer["error"]["code"] == "model_not_found", answer
    assert support_name in answer["error"]["message"] and env["MODEL_NAME"] in answer["error"]["message"]

    # the demo line's model (our GPT) and the support line's (a base checkpoint), each exported
    # into its own Triton models
    demo_version = register_gpt(env["MODEL_NAME"], tokenizer_uri, seed=5)
    export(demo_version, tmp_path / "demo-export", env, eval_text)
    base = imported_base("llama", snapshot, tmp_path / "base", support_env)
    support_v1 = register_model_dir(support_name, str(base["init_model_uri"]))
    export(support_v1, tmp_path / "support-export", support_env, eval_text)
    for model in SUPPORT_MODELS:
        assert (tmp_path / "support-export" / "triton" / model / support_v1).is_dir()
    assert (tmp_path / "support-export" / "triton" / SUPPORT_MODELS[1] / support_v1 / "chat.py").exists()
    broken = register_model_dir(support_name, str(base["init_model_uri"]))
    clone_export(tmp_path / "support-export", support_v1, tmp_path / "broken-export", broken, FIFTH_CHANGED,
                 SUPPORT_MODELS)

    try:
        # both lines' first models rolled out at once (each line its own lock and split). Each
        # ends as its own canary judged it, and its line's route says so: promoted and served, or
        # rolled back and nothing served (on 2 cores two canaries' traffic together has timed
        # streams out: a rollback the analysis is right to make). One rolled back is then rolled
        # out again alone, and promoted
        rollouts = {"demo": (env, demo_version, tmp_path / "demo-export"),
                    LINE: (support_env, support_v1, tmp_path / "support-export")}
        together = dict(zip(rollouts, deploy_both_at_once(
            *((line_env, version, export_dir, tmp_path / f"deploy-{key}")
              for key, (line_env, version, export_dir) in rollouts.items())), strict=True))
        for key, proc in together.items():
            promoted = proc.returncode == 0 and step_result(proc)["verdict"] == "promoted"
            assert promoted or (proc.returncode == 2 and " rolled back at " in error_lines(proc)[0]), proc.stderr[-3000:]
            assert live_states(env)[key]["stable"] == (int(rollouts[key][1]) if promoted else None)
            assert live_states(env)[key]["canary"] is None
            if not promoted:
                line_env, version, export_dir = rollouts[key]
                again = deploy(line_env, version, export_dir, tmp_path / f"deploy-{key}-again")
                assert again.returncode == 0 and step_result(again)["verdict"] == "promoted", again.stderr[-3000:]
        status, answer, version = call(env, "/v1/completions", asked)
        assert status == 200 and version == demo_version and answer["model"] == env["MODEL_NAME"]

        # the support line's broken build rolls out while the demo line's deploy lock is held (as a
        # demo rollout would hold it) and the demo line's client streams through the same router;
        # it waits first for its own line's lock, held as another rollout of the line would hold it
        demo_route, locks = live_states(env)["demo"], Path(env["ROUTER_DIR"])
        with DemoClient(env) as demo_client, (locks / "deploy.lock").open("w") as demo_lock:
            fcntl.flock(demo_lock, fcntl.LOCK_EX)
            with ThreadPoolExecutor(1) as pool, (locks / f"deploy.{LINE}.lock").open("w") as support_lock:
                fcntl.flock(support_lock, fcntl.LOCK_EX)
                waiting = pool.submit(deploy, support_env, broken, tmp_path / "broken-export", tmp_path / "deploy-broken")
                time.sleep(10)
                assert not waiting.done() and live_states(env)[LINE]["shadow"] is None  # serialized: nothing moved
                fcntl.flock(support_lock, fcntl.LOCK_UN)
                rolled_back = waiting.result()
            assert rolled_back.returncode == 2, rolled_back.stderr[-3000:]
            assert error_lines(rolled_back)[0].startswith(
                f"ERROR python -m tasks.deploy: canary of version {broken} rolled back before any user reached it: "
                "shadow: shadow_text_agreement"), error_lines(rolled_back)
        # the demo line's client: every answer whole, every one from the demo line's version
        assert set(demo_client.answers) == {f"{demo_version}:ok"}, demo_client.answers
        assert demo_client.answers[f"{demo_version}:ok"] >= 10, demo_client.answers

        # each line answers with its own champion, on the OpenAI API and on Triton's paths
        states = live_states(env)
        assert states[LINE]["stable"] == int(support_v1) and states[LINE]["canary"] is None
        assert states[LINE]["shadow"] is None
        assert states["demo"] == demo_route  # the demo line's split was never rewritten
        status, answer, version = call(env, "/v1/completions", {**asked, "model": support_name})
        assert status == 200 and version == support_v1 and answer["model"] == support_name
        status, answer, version = call(env, "/v1/chat/completions", {
            "model": support_name, "max_tokens": 4, "messages": [{"role": "user", "content": "Return"}]})
        assert status == 200 and version == support_v1 and answer["model"] == support_name
        status, listed, _ = call(env, "/v1/models")
        assert [(card["id"], card["version"]) for card in listed["data"]] == [
            (env["MODEL_NAME"], demo_version), (support_name, support_v1)]
        for model, expected, exported in (("llm", demo_version, "demo-export"),
                                          (SUPPORT_MODELS[0], support_v1, "support-export")):
            ids = json.loads((tmp_path / exported / "parity.json").read_text())["reference"]["inputs"][0]
            body = triton.infer_request(np.asarray(ids, dtype=np.int64))  # a batch of one already
            status, answer, version = call(env, f"/v2/models/{model}/infer", body)
            assert status == 200 and version == expected, (model, status, version, answer)
    finally:  # the demo line's route and Triton as this module found them
        from tasks.lib.params import load_settings
        from tasks.serving.platforms import serve_versions

        router.apply(None)
        serve_versions(triton.TritonClient(env["TRITON_URL"]), Path(env["TRITON_REPOSITORY"]), load_settings().serve, [])
