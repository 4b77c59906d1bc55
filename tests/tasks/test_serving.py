"""Export, Triton and the canary on the real servers: Triton (python backend + ONNX Runtime)
behind a real nginx router, MLflow registry, S3; traffic only on 127.0.0.1.

Versions are registered straight into the registry (small GPTs, no training: serving does not
care how good a model is, only how it behaves); everything after that is the real steps.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import http.client
import importlib.util
import json
import math
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import helpers
import numpy as np
import pytest
import yaml
from helpers import (
    FIFTH_CHANGED,
    REPO_ROOT,
    RUNTIME_PY,
    SMALL,
    clone_export,
    error_lines,
    export,
    params_with_model_name,
    prometheus_query,
    register_gpt,
    run_module,
    step_result,
    write_eval_text,
)
from kube_api import FakeKubeApi, apply_json_patch, kubectl_apply, merge_patch, role_allows

from tasks.config import ServeSettings, load
from tasks.lib import triton
from tasks.lib.errors import StepError
from tasks.serving import platforms
from tasks.serving.contract import INTERNAL_HEADERS
from tasks.serving.router import Route, split_conf

# short canary steps: the analysis needs samples, not minutes
CANARY = ["--set", "step_duration_s=3", "--set", "rate_rps=40", "--set", "min_samples=8", "--set", "text_rps=16",
          "--set", "text_min_samples=6"]


# -- unit: configurations and the router's split --------------------------------------------


def serve_settings() -> ServeSettings:
    return load().serve


def test_one_config_source_for_every_backend() -> None:
    serve = serve_settings()
    python = triton.logits_model_config("llm", "python", serve)
    onnx_gpu = triton.logits_model_config("llm", "onnxruntime_onnx", serve, gpu=True)
    plan = triton.logits_model_config("llm", "tensorrt_plan", serve, gpu=True)
    assert python["backend"] == "python" and "platform" not in python
    assert onnx_gpu["platform"] == "onnxruntime_onnx" and onnx_gpu["instance_group"][0]["kind"] == "KIND_GPU"
    assert plan["default_model_filename"] == "model.plan"
    for config in (python, onnx_gpu, plan):
        assert {k: config[k] for k in ("input", "output", "dynamic_batching", "max_batch_size")} == \
               {k: python[k] for k in ("input", "output", "dynamic_batching", "max_batch_size")}
    text = triton.to_pbtxt(triton.with_versions(onnx_gpu, [3, 2]))
    assert 'platform: "onnxruntime_onnx"' in text and "kind: KIND_GPU" in text and "data_type: TYPE_INT64" in text
    # protobuf's text format, read back into Triton's ModelConfig as the server reads it
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    parsed = text_format.Parse(text, model_config_pb2.ModelConfig())
    assert list(parsed.dynamic_batching.preferred_batch_size) == [4, 8, 16]
    assert list(parsed.version_policy.specific.versions) == [2, 3]
    with pytest.raises(ValueError, match=r"model config 'llm'.*max_batchsize"):  # a field Triton does not have
        triton.to_pbtxt({**onnx_gpu, "max_batchsize": 8})
    with pytest.raises(Exception, match="needs the gpu kind"):
        triton.logits_model_config("llm", "tensorrt_plan", serve)


def test_split_routes_by_weight() -> None:
    def split(route: Route) -> str:  # the split_clients block: what picks each request's version
        return split_conf(route).split("\n}\n")[0]

    assert '10% "3";' in split(Route(2, 3, 10.0, 1)) and '* "2";' in split(Route(2, 3, 10.0, 1))
    assert split(Route(2, 3, 100.0, 2)).count('"3"') == 1 and '"2"' not in split(Route(2, 3, 100.0, 2))
    assert '* "";' in split(Route(None))
    assert 'map "" $stable_demo { default "2"; }' in split_conf(Route(2, 3, 100.0, 2))
    with pytest.raises(ValueError):
        Route(2, None, 5.0)


def test_each_line_has_its_own_split_in_one_router(tmp_path: Path) -> None:
    """Two model lines in one nginx config, checked by the real nginx (``-t``): each line's split
    in a file of its own, Triton's paths routed by their model's line, the front told every
    line's pick; a saved route read back per line, and one line's shadow mirrors /v1."""
    from tasks.serving.router import Listeners, RoutedLine, Upstreams, nginx_binary, saved_route, served_routes
    from tasks.serving.router import write_router_config as write_config

    demo, support = RoutedLine("demo"), RoutedLine("my-support", ("llm__s", "llm_generate__s"))
    assert support.split_file == "split.my-support.conf" and support.var == "my_dsupport"
    (tmp_path / support.split_file).write_text(split_conf(Route(4, shadow=5), support))
    conf = write_config(tmp_path, Listeners(1, 4), Upstreams(2, 3), lines=[demo, support]).read_text()
    checked = subprocess.run([nginx_binary(), "-t", "-q", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")],
                             capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    assert "llm__s $version_my_dsupport;" in conf and "llm_generate $version_demo;" in conf
    assert 'X-Route-Version "demo=$version_demo:$stable_demo,my-support=$version_my_dsupport:$stable_my_dsupport"' in conf
    assert "(?<model>llm|llm__s)/(?<action>infer)$" in conf  # the public listener: each line's logits model
    assert served_routes(tmp_path) == {"demo": Route(None), "my-support": Route(4, shadow=5)}
    assert saved_route(tmp_path, support) == Route(4, shadow=5) and saved_route(tmp_path) == Route(None)
    assert "mirror /_shadow;" in (tmp_path / "mirror.conf").read_text()


def test_the_front_picks_its_lines_version_from_the_routers_header() -> None:
    from aiohttp.test_utils import make_mocked_request

    from tasks.serving.front import RoutedVersions, ServedModel
    from tasks.serving.protocol import ApiError

    demo, support = ServedModel("demo", "llm-retrain", "llm_generate"), ServedModel("support", "s", "g__s")

    def routed(value: str) -> RoutedVersions:
        return RoutedVersions.of(make_mocked_request("POST", "/v1/completions", headers={"X-Route-Version": value}))

    every = routed("demo=3:2,support=:")
    assert every.version(demo) == "3" and every.stable(demo) == "2" and every.stable(support) is None
    with pytest.raises(ApiError, match="no version of model 's' is deployed yet") as refused:
        every.version(support)
    assert refused.value.status == 503
    assert routed("7").version(support) == routed("7").version(demo) == "7"  # deploy's own: the named line's
    assert routed("").version(demo) == "" and routed("x;y").version(demo) == ""  # no router: unversioned


@contextlib.contextmanager
def answering(path: str, body: Any) -> Iterator[str]:
    """A local HTTP server answering ``path`` with ``body`` as JSON (a process of older code)."""
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            data = json.dumps(body).encode()
            self.send_response(200 if self.path == path else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_servers_of_older_code_are_read_or_replaced() -> None:
    """A router of older code answers one line's state: deploy reads it as the demo line's (until
    `up` reloads the router). A front of older code lists its model without a version: `up`
    restarts it (it would read the router's per-line header as no version at all)."""
    from stack.serving import front_current
    from tasks.serving.router import NginxRouter

    old_state = {"stable": 3, "canary": None, "canary_weight": 0.0, "generation": 7}
    with answering("/router/state", old_state) as url:
        assert NginxRouter(Path("."), url, url).live() == Route(3, generation=7)
    name = load().pipeline.model_name
    with answering("/v1/models", {"object": "list", "data": [{"id": name, "object": "model"}]}) as url:
        assert not front_current(url)
    with answering("/v1/models", {"object": "list", "data": [{"id": name, "object": "model", "version": "3"}]}) as url:
        assert front_current(url)


def test_the_front_finds_a_line_added_since_it_started() -> None:
    """A request naming a model the front does not know reads the lines again (at most every
    REDISCOVER_S), so a line added to a running stack is served without restarting the front; a
    lines folder that cannot be read keeps what was served."""
    from tasks.serving.front import Api, ServedModel
    from tasks.serving.protocol import ApiError

    demo, support = ServedModel("demo", "llm-retrain", "llm_generate"), ServedModel("support", "s", "g__s")
    found: list[Any] = [[demo]]

    def discover() -> list[ServedModel]:
        if isinstance(found[0], Exception):
            raise found[0]
        return list(found[0])

    api = Api("http://triton", [demo], 5.0, discover=discover)
    api.discovered_at = 0.0
    with pytest.raises(ApiError, match="model 's' does not exist"):
        api.served("s")
    found[0] = [demo, support]
    with pytest.raises(ApiError):  # read again within REDISCOVER_S: not yet
        api.served("s")
    api.discovered_at = 0.0
    assert api.served("s") == support and api.served(None) == demo
    found[0], api.discovered_at = ValueError("lines/x.yaml: invalid YAML"), 0.0
    with pytest.raises(ApiError, match="model 'x' does not exist"):
        api.served("x")
    assert api.served("s") == support  # kept


def test_a_lines_cluster_deploy_drives_its_own_tracks_and_names_its_model(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """In a cluster a model line's deploy patches its own Deployments and HTTPRoute, holds its own
    Lease, and its requests to the internal route name its model (plugins/serving.py's rules)."""
    from tasks.config import load
    from tasks.lib.kube import KubeApi
    from tasks.serving.contract import MODEL_HEADER

    (tmp_path / "support.yaml").write_text("pipeline: {model_name: support-bot}\n")
    monkeypatch.setenv("PIPELINE_LINES_DIR", str(tmp_path))
    monkeypatch.setenv("ROUTER_URL", "http://gateway.example")
    monkeypatch.setenv("ROUTER_INTERNAL_URL", "http://gateway-internal.example")
    monkeypatch.setattr(KubeApi, "in_cluster", classmethod(lambda cls: KubeApi("http://api.example", "t", None)))
    monkeypatch.setenv("SERVING_PLATFORM", "kubernetes")
    monkeypatch.setenv("PIPELINE_LINE", "support")
    support = platforms.serving_platform(load())
    assert isinstance(support, platforms.KubernetesServing)
    assert support.names["stable"] == "triton-support-stable" and support.lease.name == "llm-serving-support-deploy"
    assert support.shadow_target()[1] == {"X-Serving-Track": "shadow", MODEL_HEADER: "support-bot"}
    assert support.model_headers == {MODEL_HEADER: "support-bot"}
    monkeypatch.setenv("PIPELINE_LINE", "")
    demo = platforms.serving_platform(load())
    assert isinstance(demo, platforms.KubernetesServing) and demo.model_headers == {}
    assert demo.names["stable"] == "triton-stable" and demo.shadow_target()[1] == {"X-Serving-Track": "shadow"}


RISING = r"canary\.steps .*: expected rising percentages ending at 100"


@pytest.mark.parametrize(("steps", "refusal"), [
    ([10, 50], RISING), ([50, 10, 100], RISING), ([0, 100], RISING), ([10, 150], RISING), ([], RISING),
    ("10,100", r"canary\.steps '10,100': expected list of integer \| number"),
    ([10, "x", 100], r"canary\.steps\[1\] 'x': expected integer \| number")])
def test_canary_steps_must_rise_to_100(steps: Any, refusal: str) -> None:
    """The trigger form bounds each share; deploy checks the list as a whole (its ``--set``, as the
    DAG passes it, read into the settings) before any traffic."""
    from tasks.lib.params import load_settings

    assert load_settings("canary", ["steps=[10, 50, 100]"]).canary.steps == (10, 50, 100)
    assert load_settings("canary", ["steps=[100]"]).canary.steps == (100,)
    with pytest.raises(StepError, match=refusal):
        load_settings("canary", [f"steps={json.dumps(steps)}"])


def test_tensorrt_is_skipped_visibly_without_a_gpu(tmp_path: Path) -> None:
    from tasks.export import build_tensorrt, tensorrt_profile

    trt = load().export.tensorrt
    assert tensorrt_profile(128, trt) == {"input_ids_min": (1, 1), "input_ids_opt": (8, 128), "input_ids_max": (16, 128)}
    assert build_tensorrt(tmp_path / "m.onnx", tmp_path / "m.plan", 128, trt) == "skipped: no GPU"
    assert not (tmp_path / "m.plan").exists()


def test_stable_gets_the_canarys_load_where_the_split_leaves_it_too_few_samples() -> None:
    """Both versions answer the same load and the step's load stays the same: where stable's
    routed share falls short, the rate is split between the router (all to the canary at 100%)
    and a stream straight to stable (logits requests and streams alike)."""
    from tasks.serving.traffic import split_rates

    assert split_rates(25, 10, 100.0, 3, 8) == (12.5, 12.5)
    routed, direct = split_rates(25, 10, 96.0, 3, 8)  # 8 routed to stable: short of 10
    assert routed + direct == 25 and direct == routed * 0.96
    assert split_rates(25, 10, 10.0, 3, 8) == split_rates(25, 10, 50.0, 3, 8) == (25, 0)
    assert split_rates(25, 10, 100.0, None, 8) == (25, 0)  # the first model has no stable
    assert split_rates(6, 8, 100.0, 3, 8) == (3, 3)
    # a fresh baseline beside the canary (a cluster): at every weight it gets the canary's load
    assert split_rates(22, 10, 10.0, 3, 8, fresh_baseline=True) == (20, 2)
    assert split_rates(25, 10, 100.0, 3, 8, fresh_baseline=True) == (12.5, 12.5)


def test_with_a_fresh_baseline_the_canary_is_judged_against_it_alone() -> None:
    """Kayenta's rule: the long-running stable pods, warm and differently loaded, are not the
    baseline; the pod of the stable version started beside the canary is. Routed stable
    requests 5x faster than both new pods do not make a canary as fast as its baseline slower."""
    from tasks.serving.analysis import StepScope, judge_step
    from tasks.serving.traffic import Sample, StepTraffic

    rng = np.random.default_rng(1)

    def samples(version: int, scale: float, n: int) -> list[Sample]:
        return [Sample(version, True, 200, scale * float(x), True, True, 0.0) for x in rng.lognormal(3, 0.1, n)]

    params = canary_settings()
    routed, baseline = samples(4, 1 / 5, 200) + samples(5, 1.0, 30), samples(4, 1.0, 30)
    traffic = StepTraffic(samples=routed, direct=baseline)
    against_all = judge_step(traffic, StepScope(4, 5, 10.0), params)
    against_fresh = judge_step(traffic, StepScope(4, 5, 10.0, baseline_only=True), params)
    assert against_all.verdict == "fail" and against_all.failed[0].startswith("latency"), against_all.checks
    assert against_fresh.verdict == "pass" and against_fresh.baseline == "fresh", against_fresh.checks
    assert against_fresh.stable.requests == 30  # the baseline's alone


def test_a_router_reload_outwaits_the_longest_stream() -> None:
    """Old nginx workers finish the streams they carry (a request may hold its slot for the
    engine's timeout); a route change waits for them, and nginx ends them past that."""
    from tasks.serving.router import OLD_WORKERS_TIMEOUT_S, Listeners, NginxRouter, Upstreams, nginx_conf

    assert serve_settings().generate.request_timeout_s < OLD_WORKERS_TIMEOUT_S
    assert NginxRouter(Path("."), "http://x", "http://y").timeout_s > OLD_WORKERS_TIMEOUT_S
    assert f"worker_shutdown_timeout {OLD_WORKERS_TIMEOUT_S}s;" in nginx_conf(Path("."), Listeners(1, 4), Upstreams(2, 3))


def test_mann_whitney_flags_a_slower_canary_only() -> None:
    from tasks.serving.analysis import latency_test

    rng = np.random.default_rng(0)
    base = list(rng.lognormal(0, 0.2, 200))
    assert latency_test(list(rng.lognormal(0, 0.2, 40)), base).p_value > 0.01
    slow = latency_test(list(5 * rng.lognormal(0, 0.2, 40)), base)
    assert slow.p_value < 1e-6 and slow.median_ratio > 4
    assert 3.5 < slow.median_difference_ms < 4.5  # Hodges-Lehmann: median 5x of ~1 ms against ~1 ms


def canary_settings(**overrides: Any) -> Any:
    from tasks.lib.params import load_settings

    return load_settings("canary", [f"{k}={json.dumps(v)}" for k, v in overrides.items()]).canary


def test_each_check_passes_fails_or_is_inconclusive() -> None:
    """Slower than "clearly fine" but not "clearly bad" (between max_latency_ratio and it times
    clearly_slower_factor), or too few samples: inconclusive, measured again; the step's verdict
    is its worst check's, failures named first."""
    from tasks.serving.analysis import FAIL, INCONCLUSIVE, PASS, Checks, enough, latency_verdict, verdict_of
    from tasks.serving.canary import LatencyTest

    params = canary_settings(max_latency_ratio=1.5, clearly_slower_factor=2.0, latency_alpha=0.01)
    assert latency_verdict(LatencyTest(p_value=0.2, median_ratio=5.0), 1.5, params) == PASS  # not significant
    assert latency_verdict(LatencyTest(p_value=1e-6, median_ratio=1.4), 1.5, params) == PASS  # clearly fine
    assert latency_verdict(LatencyTest(p_value=1e-6, median_ratio=2.0), 1.5, params) == INCONCLUSIVE
    assert latency_verdict(LatencyTest(p_value=1e-6, median_ratio=3.1), 1.5, params) == FAIL  # clearly bad
    # past the ratio by fewer milliseconds than a check's floor (ttft_min_slowdown_ms): not slower
    few_ms = LatencyTest(p_value=1e-6, median_ratio=3.1, median_difference_ms=4.0)
    assert latency_verdict(few_ms, 1.5, params, min_slowdown_ms=5.0) == PASS
    assert latency_verdict(few_ms, 1.5, params) == FAIL
    assert latency_verdict(LatencyTest(p_value=1e-6, median_ratio=3.1, median_difference_ms=6.0), 1.5, params,
                           min_slowdown_ms=5.0) == FAIL
    assert enough(7, 8) == INCONCLUSIVE and enough(8, 8) == PASS
    checks = Checks()
    checks.add("samples", INCONCLUSIVE, 3, 8, "3 canary streams")
    checks.add("latency", True, 1.0, 1.5, "fine")
    assert verdict_of(checks).verdict == INCONCLUSIVE and not verdict_of(checks).passed
    checks.add("error_rate", False, 0.2, 0.01, "2 of 10 failed")
    judged = verdict_of(checks)
    assert judged.verdict == FAIL and list(judged.failed) == [
        "error_rate: 2 of 10 failed (limit 0.01)", "samples: 3 canary streams (limit 8): inconclusive"]
    with pytest.raises(StepError, match=r"clearly_slower_factor 0\.5: expected at least 1"):
        canary_settings(clearly_slower_factor=0.5)


def shadow_pairs(count: int, changed_every: int = 0, slower_ms: float = 0.0, failing_every: int = 0,
                 seed: int = 0) -> list[dict[str, Any]]:
    """What the front records of ``count`` requests answered by stable and copied to a shadow of
    equal weights, but for the given faults (every ``changed_every``-th answer changed, each
    copy ``slower_ms`` later to its first token, every ``failing_every``-th copy failed)."""
    from tasks.serving.traffic import TextSample

    rng = np.random.default_rng(seed)
    pairs = []
    for i in range(count):
        chunks = [" the", " number", " of", " tokens"]
        ttft, itl = float(rng.lognormal(2, 0.3)), float(rng.lognormal(0.7, 0.2))
        stable = {"ok": True, "status": 200, "ttft_ms": ttft, "itl_ms": itl, "chunks": chunks, "error": ""}
        copy = {**stable, "ttft_ms": float(ttft * rng.lognormal(0, 0.1)) + slower_ms,
                "itl_ms": float(itl * rng.lognormal(0, 0.1))}
        if changed_every and i % changed_every == 0:
            copy["chunks"] = [" the", " other", " answer", "."]
        if failing_every and i % failing_every == 0:
            copy = {**copy, "ok": False, "status": 200, "error": "injected fault"}
        user = TextSample(3, True, 200, ttft + 1, itl, 4, False, 0.0, request_id=f"{i:032x}", expected="".join(chunks))
        pairs.append({"request_id": user.request_id, "expected": user.expected, "user": user, "stable": stable,
                      "shadow": copy})
    return pairs


def test_the_shadow_is_judged_request_by_request() -> None:
    """An identical shadow passes; a fifth of its answers changed, 300 ms more to the first
    token, or failing copies fail; too few pairs, or copies never recorded, do not pass."""
    from tasks.serving.analysis import judge_shadow
    from tasks.serving.canary import to_json

    params = canary_settings(text_min_samples=6)
    same = judge_shadow(shadow_pairs(40), 3, 4, params)
    assert same.verdict == "pass", same.failed
    assert to_json(same.agreement) == {"reference": 1.0, "stable_exact": 1.0, "stable_tokens": 1.0,
                                       "first_divergence_median": 4.0}
    assert same.paired_tests["ttft_ms"].p_value > 0.01
    changed = judge_shadow(shadow_pairs(40, changed_every=5), 3, 4, params)
    assert changed.verdict == "fail" and changed.failed[0].startswith("shadow_text_agreement: 80%")
    assert changed.agreement.stable_exact == 0.8 and changed.agreement.stable_tokens == 0.85
    strict = judge_shadow(shadow_pairs(40, changed_every=5), 3, 4, canary_settings(shadow_min_stable_agreement=0.95))
    assert any(f.startswith("shadow_stable_agreement: 80%") for f in strict.failed)
    slower = judge_shadow(shadow_pairs(40, slower_ms=300.0), 3, 4, params)
    assert slower.verdict == "fail" and slower.failed[0].startswith("shadow_ttft: median time to first token")
    assert slower.paired_tests["ttft_ms"].p_value < 1e-6 and slower.paired_tests["itl_ms"].p_value > 0.01
    failing = judge_shadow(shadow_pairs(40, failing_every=5), 3, 4, params)
    assert failing.failed[0] == "shadow_error_rate: 8 of 40 shadow copies failed (first: injected fault) (limit 0.01)"
    assert failing.users.errors == 0  # the copies' errors are not what users saw
    few = judge_shadow(shadow_pairs(4), 3, 4, params)
    assert few.verdict == "inconclusive" and few.failed[0].startswith("shadow_samples: 4 requests")
    unrecorded = shadow_pairs(40)
    for pair in unrecorded:  # records lost (a restarted front): nothing known, nothing failed
        pair["stable"] = pair["shadow"] = None
    nothing = judge_shadow(unrecorded, 3, 4, params)
    assert nothing.verdict == "inconclusive", nothing.failed
    assert nothing.failed[0] == ("shadow_samples: 0 requests answered by stable and copied to the shadow (40 of 40 "
                                    "sent have no record of stable's answer) (limit 6): inconclusive")
    busy = shadow_pairs(40)
    for pair in busy[::4]:  # copies the front dropped (too many in flight): not the shadow's errors
        pair["shadow"] = {**pair["shadow"], "ok": False, "error": "dropped: 64 copies in flight"}
    assert judge_shadow(busy, 3, 4, params).verdict == "pass"
    lost = shadow_pairs(40)
    for pair in lost[::2]:
        pair["shadow"] = None  # never recorded: a copy that did not come back counts as failed
    assert judge_shadow(lost, 3, 4, params).failed[0].startswith("shadow_error_rate: 20 of 40 shadow copies failed "
                                                                    "(first: no answer recorded)")


def test_the_shadows_latency_is_judged_on_the_engines_own_timings() -> None:
    """An identical copy whose stable answers reached a busy front in bursts (chunks 0.09 ms
    apart, the copy's 3 ms: seen once in an A/A rollout, 34x 'slower') passes on the engines' own
    per-token times, which both answers carry; a copy its engine timed 5x slower fails on them.
    Answers of engines that do not time themselves are judged on arrival times as before."""
    from tasks.serving.analysis import ENGINE_TIMED, FRONT_TIMED, judge_shadow

    params = canary_settings(text_min_samples=6)
    bunched = shadow_pairs(40)
    for pair in bunched:
        for side in ("stable", "shadow"):
            pair[side] = {**pair[side], "engine_ttft_ms": pair[side]["ttft_ms"], "engine_itl_ms": pair[side]["itl_ms"]}
        pair["stable"]["itl_ms"] = 0.09
        pair["shadow"]["itl_ms"] = 3.16
    judged = judge_shadow(bunched, 3, 4, params)
    assert judged.verdict == "pass" and judged.paired_tests["itl_ms"].measured == ENGINE_TIMED, judged.failed
    for pair in bunched:
        pair["shadow"]["engine_itl_ms"] *= 5
    slower = judge_shadow(bunched, 3, 4, params)
    assert slower.verdict == "fail" and slower.failed[0].startswith("shadow_itl: median inter-token latency")
    untimed = shadow_pairs(40)  # no engine figures: the arrivals at the front
    assert judge_shadow(untimed, 3, 4, params).paired_tests["itl_ms"].measured == FRONT_TIMED


def test_a_steps_text_latency_is_judged_on_the_engines_own_timings() -> None:
    """At 100% the canary's engine holds every routed stream (users' too) and stable's only
    deploy's baseline: an identical copy's streams reached deploy 10x later than stable's (the
    wait for a slot) but its engine timed them as stable's did: it passes, judged on the records'
    engine figures. Engine figures 5x stable's fail; streams without records (an engine that does
    not time itself) are judged as deploy received them."""
    from tasks.serving.analysis import CLIENT_TIMED, ENGINE_TIMED, StepScope, judge_text
    from tasks.serving.traffic import StepTraffic, TextSample, with_engine_timings

    params = canary_settings(text_min_samples=8)
    rng = np.random.default_rng(7)

    def streams(version: int, n: int, client_ms: float, engine_ms: float, start: int) -> tuple[list[TextSample], list[dict[str, Any]]]:
        sent = [TextSample(version, True, 200, client_ms * rng.uniform(0.8, 1.2), 4.0 * rng.uniform(0.8, 1.2), 8, True,
                           0.0, request_id=f"{start + i:032x}") for i in range(n)]
        records = [{"request_id": s.request_id, "version": version, "engine_ttft_ms": engine_ms * rng.uniform(0.8, 1.2),
                    "engine_itl_ms": 4.0 * rng.uniform(0.8, 1.2)} for s in sent]
        return sent, records

    routed, routed_records = streams(5, 20, client_ms=300.0, engine_ms=3.0, start=0)
    direct, direct_records = streams(4, 20, client_ms=30.0, engine_ms=3.0, start=100)
    stray = [{**routed_records[0], "version": 4}]  # another version's record of the same id: not this stream's
    unrecorded = [dataclasses.replace(s) for s in routed]
    at_100 = StepScope(4, 5, 100.0)
    as_received, checks = judge_text(StepTraffic(text=unrecorded, text_direct=[dataclasses.replace(s) for s in direct]),
                                     at_100, params)
    assert as_received.tests["ttft_ms"].measured == CLIENT_TIMED
    assert any(c.check == "ttft" and c.verdict == "fail" for c in checks)
    with_engine_timings(routed + direct, routed_records[1:] + direct_records + stray)
    assert math.isnan(routed[0].engine_ttft_ms) and routed[1].engine_ttft_ms == routed_records[1]["engine_ttft_ms"]
    report, checks = judge_text(StepTraffic(text=routed, text_direct=direct), at_100, params)
    assert report.tests["ttft_ms"].measured == ENGINE_TIMED and all(c.passed for c in checks), checks
    assert 0.5 < report.tests["ttft_ms"].median_ratio < 2 and report.canary.engine_ttft_p50_ms < 4
    for sample in routed:
        sample.engine_ttft_ms *= 5
    _, checks = judge_text(StepTraffic(text=routed, text_direct=direct), at_100, params)
    slower = next(c for c in checks if c.check == "ttft")
    assert slower.verdict == "fail" and "as the engines timed them" in slower.detail, slower
    # an identical copy at 10% read up to 2.2x stable's ~1.6 ms engine TTFT on 2 busy cores: past
    # the ratio (2.0) by fewer ms than canary.ttft_min_slowdown_ms (3), it is not slower; the same
    # ratio between tokens has no floor (inconclusive: between 2.0 and 2.0 x clearly_slower_factor)
    for sample in direct:
        sample.engine_ttft_ms = rng.uniform(0.9, 1.1)
    for sample in routed:
        sample.engine_ttft_ms = 2.5 * rng.uniform(0.9, 1.1)
    _, checks = judge_text(StepTraffic(text=routed, text_direct=direct), at_100, params)
    few_ms = next(c for c in checks if c.check == "ttft")
    assert few_ms.passed and "x stable's (+1." in few_ms.detail and "slower only past +3 ms" in few_ms.detail, few_ms
    for sample in routed:
        sample.engine_itl_ms *= 2.5
    _, checks = judge_text(StepTraffic(text=routed, text_direct=direct), at_100, params)
    assert next(c for c in checks if c.check == "itl").verdict == "inconclusive", checks


def test_a_steps_logits_latency_is_judged_on_tritons_compute_time() -> None:
    """On 2 busy cores a version's logits latency is mostly its wait in its own queue: an
    identical copy read 3.2x stable's latency with equal compute times. Given Triton's compute
    time per request per interval for both versions, the step judges those (equal: pass; the
    canary's 4x: fail); with too few intervals of either, the latencies deploy's client received."""
    from tasks.serving.analysis import CLIENT_TIMED, TRITON_TIMED, StepScope, judge_step
    from tasks.serving.traffic import Sample, StepTraffic

    params = canary_settings(min_samples=10)
    rng = np.random.default_rng(3)

    def sample(version: int, ms: float) -> Sample:
        return Sample(version, True, 200, ms * rng.uniform(0.8, 1.2), True, True, 0.0)

    routed = [sample(5, 300.0) for _ in range(30)]  # the canary's queue: 10x slower as received
    direct = [sample(4, 30.0) for _ in range(30)]
    same = {5: list(rng.uniform(30, 40, 16)), 4: list(rng.uniform(30, 40, 16))}
    at_100 = StepScope(4, 5, 100.0)
    judged = judge_step(StepTraffic(samples=routed, direct=direct, compute=same), at_100, params)
    assert judged.passed and judged.latency_test and judged.latency_test.measured == TRITON_TIMED, judged.failed
    slower = judge_step(StepTraffic(samples=routed, direct=direct, compute={**same, 5: [4 * v for v in same[5]]}),
                        at_100, params)
    assert slower.verdict == "fail" and "compute time per request" in slower.failed[0], slower.failed
    for sparse in ({5: same[5][:9], 4: same[4]}, None):
        received = judge_step(StepTraffic(samples=routed, direct=direct, compute=sparse), at_100, params)
        assert received.latency_test and received.latency_test.measured == CLIENT_TIMED and received.verdict == "fail"


def test_the_compute_sampler_gives_each_version_its_compute_time_per_request_per_interval() -> None:
    """Triton's counters read every interval: per version, (input + execution + output time) /
    requests of each interval that had requests; a failed read merges its interval into the next,
    the first good read is the baseline (never Triton's lifetime average), and the thread lives on."""
    from tasks.deploy import ComputeSampler

    class Counters:
        def __init__(self) -> None:
            self.reads = 0

        def metrics(self) -> dict[int, dict[str, float]]:
            self.reads += 1
            if self.reads in (1, 4):
                raise http.client.IncompleteRead(b"")  # not an OSError: it must not stop the sampler
            n = self.reads
            return {4: {"success": 1000.0 + 2 * n, "compute_input_us": 100.0 * n, "compute_us": 8000.0 * n,
                        "compute_output_us": 100.0 * n},
                    5: {"success": 5.0 * (n > 5) + n // 7, "compute_us": 30000.0 * n}}

    counters = Counters()
    sampler = ComputeSampler(counters, interval_s=0.01)  # type: ignore[arg-type]
    with sampler:
        wait = time.monotonic() + 5
        while counters.reads < 12 and time.monotonic() < wait:
            time.sleep(0.01)
    assert sampler.thread.is_alive() is False and counters.reads >= 12
    assert sampler.series[4] and all(v == pytest.approx(4.1) for v in sampler.series[4])  # 8.2 ms per 2 requests
    assert 5 in sampler.series and all(v > 0 for v in sampler.series[5])


def test_records_that_cannot_be_read_leave_the_streams_as_received() -> None:
    """A front that does not answer its records: the step goes on, judged as deploy received it."""
    from tasks.deploy import read_engine_timings
    from tasks.serving.traffic import TextSample

    class NoRecords:
        def shadow_records(self, ids: list[str], stable: int, shadow: int) -> list[dict[str, Any]]:
            raise RuntimeError("http://front/shadow/records: the shadow's records could not be read (refused)")

    samples = [TextSample(5, True, 200, 10.0, 2.0, 4, True, 0.0, request_id=f"{i:032x}") for i in range(3)]
    read_engine_timings(NoRecords(), samples, 4, 5)  # type: ignore[arg-type]
    assert all(math.isnan(s.engine_ttft_ms) for s in samples)


def test_a_shadow_route_mirrors_v1_only_and_marks_both_requests(tmp_path: Path) -> None:
    from tasks.serving.router import Listeners, Upstreams, mirror_conf, nginx_conf

    assert mirror_conf({"demo": Route(2)}).startswith("#")
    # one line's shadow mirrors every /v1 request: the front drops the copies of other lines' requests
    assert "mirror /_shadow;" in mirror_conf({"demo": Route(2), "support": Route(1, shadow=3)})
    shadowing = split_conf(Route(2, shadow=3))
    assert '$shadow_demo { default "3"; }' in shadowing and '$shadow_demo { default ""; }' in split_conf(Route(2))
    assert '* "2";' in shadowing and Route(2, shadow=3).versions() == [2, 3]
    conf = nginx_conf(tmp_path, Listeners(1, 4), Upstreams(2, 3))
    public, internal = (part.split("location")[0] for part in conf.split("location /v1/ {")[1:])
    for v1 in (public, internal):
        assert f"include {tmp_path / 'mirror.conf'};" in v1 and 'proxy_set_header X-Shadow-Copy "";' in v1
    # deploy's requests (internal, with a pair id) are recorded at every stage; public clients'
    # are mirrored, never recorded
    assert 'proxy_set_header X-Shadow-Record "";' in public and 'proxy_set_header X-Shadow-Pair "";' in public
    assert 'proxy_set_header X-Shadow-Record "1";' in internal
    assert "proxy_set_header X-Shadow-Pair $shadow_pair_id;" in internal
    assert conf.count("include") == 3  # split.conf, and mirror.conf in both listeners' /v1/ (not Triton's paths)


# -- unit: the cluster path's patches on the objects plugins/serving.py renders ----------------


def rendered_serving_objects(install: bool = True) -> list[dict[str, Any]]:
    """``python plugins/serving.py [--install]``: the objects as first created, or as re-applied."""
    proc = subprocess.run([str(RUNTIME_PY), "plugins/serving.py", *(["--install"] if install else [])], cwd=REPO_ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT / "plugins")})
    assert proc.returncode == 0, proc.stderr
    return list(yaml.safe_load_all(proc.stdout))


def test_deploy_patches_keep_the_cluster_objects_valid(tmp_path: Path) -> None:
    objects = {o["metadata"]["name"]: o for o in rendered_serving_objects() if o["kind"] != "Service"}
    names = {track: f"triton-{track}" for track in platforms.TRACKS}
    route = apply_json_patch(objects["llm-serving"], platforms.route_patch(names, Route(4, 5, 12.5, 7), 8003))
    ports = {"/v2": 8000, "/v1": 8003}  # Triton's paths and the OpenAI front's: split alike
    for rule in platforms.WEIGHTED_RULES:
        backends = route["spec"]["rules"][rule]["backendRefs"]
        prefix = route["spec"]["rules"][rule]["matches"][0]["path"]["value"][:3]
        assert [(b["name"], b["port"], b["weight"]) for b in backends] == \
            [("triton-stable", ports[prefix], 875), ("triton-canary", ports[prefix], 125)]
        assert [b["filters"][0]["responseHeaderModifier"]["set"][0]["value"] for b in backends] == ["4", "5"]
    assert {route["spec"]["rules"][r]["matches"][0]["path"]["value"][:3] for r in platforms.WEIGHTED_RULES} == set(ports)
    assert json.loads(route["metadata"]["annotations"]["llm-pipeline/route"])["generation"] == 7
    first = apply_json_patch(objects["llm-serving"], platforms.route_patch(names, Route(4), 8003))
    for rule in platforms.WEIGHTED_RULES:
        assert [b["weight"] for b in first["spec"]["rules"][rule]["backendRefs"]] == [1000, 0]
    # a shadow: the /v1 rule mirrors to the canary track's front; every rule removes a client's
    # internal headers (INTERNAL_HEADERS) in every state, shadowing or not
    strip = {"type": "RequestHeaderModifier", "requestHeaderModifier": {"remove": list(INTERNAL_HEADERS)}}
    shadowing = apply_json_patch(first, platforms.route_patch(names, Route(4, None, 0.0, 8, shadow=5), 8003))
    mirror = shadowing["spec"]["rules"][platforms.MIRRORED_RULE]["filters"]
    assert mirror == [strip, {"type": "RequestMirror",
                              "requestMirror": {"backendRef": {"name": "triton-canary", "port": 8003}}}]
    assert [b["weight"] for b in shadowing["spec"]["rules"][1]["backendRefs"]] == [1000, 0]
    unshadowed = apply_json_patch(shadowing, platforms.route_patch(names, Route(4, 5, 10.0, 9), 8003))
    for state in (route, first, shadowing, unshadowed):
        assert [state["spec"]["rules"][r]["filters"][0] for r in platforms.WEIGHTED_RULES] == [strip, strip]
    assert unshadowed["spec"]["rules"][platforms.MIRRORED_RULE]["filters"] == [strip]
    canary = merge_patch(objects["triton-canary"], platforms.deployment_patch(5, "s3://pipeline/runs/x/export", 1))
    assert canary["spec"]["replicas"] == 1
    assert canary["spec"]["template"]["metadata"]["annotations"]["llm-pipeline/model-version"] == "5"
    assert canary["spec"]["template"]["spec"] == objects["triton-canary"]["spec"]["template"]["spec"]
    proc = helpers.validate_objects([route, first, shadowing, unshadowed, canary], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # a hand-edited route (backends swapped) is refused, not mis-weighted
    swapped = json.loads(json.dumps(objects["llm-serving"]))
    swapped["spec"]["rules"][platforms.WEIGHTED_RULES[-1]]["backendRefs"].reverse()
    with pytest.raises(AssertionError, match="test failed"):
        apply_json_patch(swapped, platforms.route_patch(names, Route(4, 5, 50.0, 1), 8003))


def test_reapplying_the_serving_objects_keeps_what_deploy_set() -> None:
    """docs/serving.md's order: ``--install`` created once, deploy patches the tracks and the route, then
    ``kubectl apply`` of the plain render after a change (a new image), twice: stable keeps its
    pods and version, the canary its share, the route its split and state; the change lands."""
    def key(obj: dict[str, Any]) -> tuple[str, str]:
        return obj["kind"], obj["metadata"]["name"]

    live = {key(o): o for o in rendered_serving_objects()}  # kubectl create: no last-applied annotation
    stable, canary, route = ("Deployment", "triton-stable"), ("Deployment", "triton-canary"), ("HTTPRoute", "llm-serving")
    live[stable] = merge_patch(live[stable], platforms.deployment_patch(4, "s3://pipeline/runs/a/export", 2))
    live[canary] = merge_patch(live[canary], platforms.deployment_patch(5, "s3://pipeline/runs/b/export", 1))
    live[route] = apply_json_patch(live[route], platforms.route_patch({t: f"triton-{t}" for t in platforms.TRACKS},
                                                                    Route(4, 5, 10.0, 3), 8003))
    deployed = copy.deepcopy(live)
    plain = {key(o): o for o in rendered_serving_objects(install=False)}
    assert route not in plain  # the public route is deploy's once created
    for deployment in (stable, canary):  # nor do the tracks carry deploy's fields
        assert "replicas" not in plain[deployment]["spec"]
        assert "annotations" not in plain[deployment]["spec"]["template"]["metadata"]
    for deployment in (stable, canary):  # the change the apply is for
        plain[deployment]["spec"]["template"]["spec"]["containers"][0]["image"] = "registry.example.com/serving:0.2.0"
    last_applied: dict[tuple[str, str], Any] = {}
    for _ in range(2):
        for name, manifest in plain.items():
            live[name] = kubectl_apply(live[name], last_applied.get(name), manifest)
            last_applied[name] = manifest
    for deployment in (stable, canary):
        assert live[deployment]["spec"]["replicas"] == deployed[deployment]["spec"]["replicas"]
        assert live[deployment]["spec"]["template"]["metadata"]["annotations"] == \
            deployed[deployment]["spec"]["template"]["metadata"]["annotations"]
        assert live[deployment]["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":0.2.0")
    assert live[route] == deployed[route]
    # what the docs' apply of the whole render did before: stable at 0 pods, no version
    installed = {key(o): o for o in rendered_serving_objects()}[stable]
    assert kubectl_apply(deployed[stable], None, installed)["spec"]["replicas"] == 0
    # a cluster installed that way (`kubectl apply`: the whole render is its last-applied): the
    # plain render would remove replicas and versions; docs/serving.md's migration drops the annotation first
    assert "replicas" not in kubectl_apply(deployed[stable], installed, plain[stable])["spec"]
    assert kubectl_apply(deployed[stable], None, plain[stable])["spec"]["replicas"] == 2


def test_rollout_and_route_readiness_read_the_status_fields() -> None:
    deployment = {"metadata": {"generation": 3}, "spec": {"replicas": 2},
                  "status": {"observedGeneration": 3, "replicas": 3, "updatedReplicas": 2, "availableReplicas": 2}}
    assert not platforms.deployment_rolled_out(deployment)  # an old pod still runs
    deployment["status"]["replicas"] = 2
    assert platforms.deployment_rolled_out(deployment)
    deployment["metadata"]["generation"] = 4  # patched, not yet seen by the controller
    assert not platforms.deployment_rolled_out(deployment)
    accepted = {"type": "Accepted", "status": "True", "observedGeneration": 6}
    route = {"metadata": {"generation": 6}, "status": {"parents": [{"conditions": [accepted]}]}}
    assert platforms.route_accepted(route)
    route["metadata"]["generation"] = 7
    assert not platforms.route_accepted(route)
    assert not platforms.route_accepted({"metadata": {"generation": 1}, "status": {"parents": []}})


# -- cluster: KubernetesServing against an in-process API server (tests/kube_api.py) ---------


NAMESPACE = "llm-pipeline"


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[FakeKubeApi, platforms.KubernetesServing]]:
    """The serving objects as ``--install`` creates them, behind a fake API server, and the deploy
    step's view of them (short timeouts: a rollout that is not done in a second never will be)."""
    from tasks.lib.kube import KubeApi

    monkeypatch.setenv("ROUTER_URL", "http://gateway.example")
    monkeypatch.setenv("ROUTER_INTERNAL_URL", "http://gateway-internal.example")
    serve = serve_settings()
    serve = dataclasses.replace(serve, kubernetes=dataclasses.replace(
        serve.kubernetes, rollout_timeout_s=1.0, route_timeout_s=5.0, lease_duration_s=30.0))
    rendered = rendered_serving_objects()
    objects = [o for o in rendered if o["kind"] in ("Deployment", "HTTPRoute")]
    with FakeKubeApi(NAMESPACE, objects) as fake:
        yield fake, platforms.KubernetesServing(serve, NAMESPACE, KubeApi(fake.url, "token", None, timeout_s=5))
    # every call made (deploy's, and the test's own as deploy would make them) is one the deploy
    # account's Role grants: a call it lacks would fail with 403 in a cluster
    role = next(o for o in rendered if o["kind"] == "Role")
    refused = [(method, path) for method, path, _ in fake.requests if not role_allows(role, method, path)]
    assert not refused and fake.requests, refused


def stub_export(folder: Path, version: int) -> str:
    """What deploy reads of an export in a cluster (the pods stage the rest): its parity reference."""
    export = folder / f"export{version}"
    export.mkdir()
    (export / "parity.json").write_text(json.dumps({"reference": {"inputs": [], "next_tokens": []}}))
    return str(export)


def track(fake: FakeKubeApi, name: str) -> platforms.TrackState:
    return platforms.TrackState.of(fake.get(f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/triton-{name}"))


def weights(fake: FakeKubeApi) -> list[tuple[int, str]]:
    """The public route's (weight, version header) per backend, the same in both weighted rules."""
    route = fake.get(f"/apis/gateway.networking.k8s.io/v1/namespaces/{NAMESPACE}/httproutes/llm-serving")
    rules = [[(b["weight"], b["filters"][0]["responseHeaderModifier"]["set"][0]["value"]) for b in
              route["spec"]["rules"][r]["backendRefs"]] for r in platforms.WEIGHTED_RULES]
    assert all(rule == rules[0] for rule in rules), rules
    return rules[0]


def first_version(kube: platforms.KubernetesServing, export: str) -> None:
    """Version 4 serving, as a first deploy leaves it."""
    with kube.lock():
        kube.stage(export, 4, Path())
        kube.prepare(None, 4)
        kube.route(None, 4, 100.0)
        kube.promote(4)


def test_a_step_judged_against_a_fresh_baseline_waits_for_its_samples_too() -> None:
    from types import SimpleNamespace

    from tasks.serving.traffic import StepTraffic

    params = canary_settings()
    of = lambda version, n: [SimpleNamespace(version=version)] * n  # noqa: E731
    lucky = StepTraffic(samples=of(5, params.min_samples), text=of(5, params.text_min_samples),
                        direct=of(4, params.min_samples), text_direct=of(4, params.text_min_samples - 4))
    assert lucky.enough(5, params) and not lucky.enough(5, params, baseline=4)
    lucky.text_direct += of(4, 4)
    assert lucky.enough(5, params, baseline=4)


def test_a_fresh_baseline_of_stable_starts_with_the_canary_and_goes_with_it(
        cluster: tuple[FakeKubeApi, platforms.KubernetesServing], tmp_path: Path) -> None:
    """prepare starts the baseline track on stable's version and export at the canary's size
    (1 pod), beside the canary; the analysis's stable side goes to its own Service (no route
    weight: users never reach it); a rollback and a promotion both empty it."""
    fake, kube = cluster
    exports = {v: stub_export(tmp_path, v) for v in (4, 5, 6)}
    first_version(kube, exports[4])
    assert track(fake, "baseline").replicas == 0  # the first model had nothing to compare with
    for version, end in ((5, "roll_back"), (6, "promote")):
        with kube.lock():
            kube.stage(exports[version], version, tmp_path)
            kube.prepare(4, version)
            assert track(fake, "baseline") == platforms.TrackState(4, exports[4], 1)
            assert track(fake, "canary") == platforms.TrackState(version, exports[version], 1)
            # through the internal route's track-header rule: the same gateway hop as the canary's requests
            assert kube.baseline_target(4) == ("http://gateway-internal.example/v2/models/llm/versions/4/infer",
                                               {"X-Serving-Track": "baseline"})
            assert kube.text_target(4) == ("http://gateway-internal.example/v1/completions",
                                           {"X-Serving-Track": "baseline", "X-Shadow-Record": "1"})
            kube.route(4, version, 10.0)
            assert weights(fake) == [(900, "4"), (100, str(version))]  # the baseline takes no route weight
            if end == "roll_back":
                kube.roll_back(4)
            else:
                kube.route(4, version, 100.0)
                kube.promote(version)
        assert track(fake, "baseline").replicas == 0 and track(fake, "canary").replicas == 0, end
    assert track(fake, "stable").version == 6
    with kube.lock():  # a manual rollback is not analysed: no baseline started for it
        kube.prepare(6, 4, analysed=False)
        assert track(fake, "baseline").replicas == 0 and track(fake, "canary") == platforms.TrackState(4, exports[4], 1)
        # a stable track that does not name stable's version (hand-edited): no baseline from it, one line
        with pytest.raises(StepError, match=r"names version 6 .*not stable version 5: no baseline can be started"):
            kube.prepare(5, 4)


def torch_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None and torch_cuda(), reason="a plan can be built here")
def test_a_tensorrt_plan_backend_is_refused_at_once_where_no_plan_can_be_built(tmp_path: Path) -> None:
    """serve.backend tensorrt_plan serves a plan the export builds: an export that cannot build one
    (no GPU, or no tensorrt package) fails first, in one line, with nothing written; it used to
    fail after its parity checks, or export a config whose plan was not in the version's folder."""
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    params["serve"]["backend"] = "tensorrt_plan"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    proc = run_module("tasks.export", "--model-version", "1", "--output", str(tmp_path / "export"),
                      "--eval-set", str(tmp_path / "eval.jsonl"),
                      env={"PIPELINE_PARAMS": str(tmp_path / "params.yaml"), "MLFLOW_TRACKING_URI": ""})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(error_lines(proc)) == 1 and re.match(
        r"ERROR python -m tasks.export: serve.backend tensorrt_plan: no (GPU|tensorrt package) where this export "
        r"runs, so it cannot build the plan Triton would serve", error_lines(proc)[0]), error_lines(proc)
    assert not (tmp_path / "export").exists()


def test_a_promotion_the_stable_track_cannot_take_is_undone(
        cluster: tuple[FakeKubeApi, platforms.KubernetesServing], tmp_path: Path) -> None:
    """The stable Deployment never rolls out to the promoted version (its pods never get ready):
    it is put back on the version it served (whose pods surge-first rolling never removed), the
    failure says so, and traffic can go back to it; route, tracks and registry then agree."""
    fake, kube = cluster
    exports = {v: stub_export(tmp_path, v) for v in (4, 5)}
    first_version(kube, exports[4])
    assert track(fake, "stable") == platforms.TrackState(4, exports[4], 2) and weights(fake) == [(1000, "4"), (0, "none")]
    fake.stuck = lambda d: d["metadata"]["name"] == "triton-stable" and platforms.TrackState.of(d).version == 5
    with kube.lock():
        kube.stage(exports[5], 5, tmp_path)
        kube.prepare(4, 5)
        kube.route(4, 5, 100.0)
        with pytest.raises(platforms.PromotionFailed, match=r"triton-stable \(version 5\) not ready after 1s.*"
                                                          r"the stable track is back on version 4") as failed:
            kube.promote(5)
        assert failed.value.restored
        assert track(fake, "stable") == platforms.TrackState(4, exports[4], 2)
        kube.roll_back(4)
    assert weights(fake) == [(1000, "4"), (0, "none")] and track(fake, "canary").replicas == 0
    assert (kube.live().stable, kube.live().canary) == (4, None)


def test_a_promotion_killed_midway_is_undone_by_the_next_deploy(
        cluster: tuple[FakeKubeApi, platforms.KubernetesServing], tmp_path: Path) -> None:
    """A deploy killed while the stable track rolled to the new version (SIGKILL: nothing ran
    after) left the route on the canary at 100% and the stable Deployment naming the new version:
    the retry puts the stable track back on what it recorded before moving traffic to it."""
    fake, kube = cluster
    exports = {v: stub_export(tmp_path, v) for v in (4, 5)}
    first_version(kube, exports[4])
    with kube.lock():
        kube.stage(exports[5], 5, tmp_path)
        kube.prepare(4, 5)
        kube.route(4, 5, 100.0)
        kube.api.call("PATCH", f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/triton-stable",  # promote's first write
                      platforms.deployment_patch(5, exports[5], 2, previous=track(fake, "stable")),
                      "application/merge-patch+json")
    retry = platforms.KubernetesServing(kube.serve, NAMESPACE, kube.api)  # a new process: nothing in memory
    live = retry.live()
    assert (live.stable, live.canary, live.canary_weight) == (4, 5, 100.0)
    with retry.lock():
        retry.roll_back(live.stable)  # as a retried deploy does with a leftover canary
    assert track(fake, "stable") == platforms.TrackState(4, exports[4], 2)
    assert weights(fake) == [(1000, "4"), (0, "none")] and track(fake, "canary").replicas == 0
    # a stable track naming another version with no record of what it served: refused, one line
    kube.api.call("PATCH", f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/triton-stable",
                  {"metadata": {"annotations": {platforms.PREVIOUS_VERSION_KEY: ""}},
                   **platforms.deployment_patch(5, exports[5], 2)}, "application/merge-patch+json")
    with retry.lock(), pytest.raises(StepError, match="names version 5, not stable version 4, and does not record"):
        retry.roll_back(4)
    assert weights(fake) == [(1000, "4"), (0, "none")]  # no traffic moved to it


def test_a_deploy_terminated_mid_canary_moves_traffic_back_to_stable(
        cluster: tuple[FakeKubeApi, platforms.KubernetesServing], tmp_path: Path) -> None:
    """SIGTERM (an evicted deploy pod) while a canary takes 10%: the handler raises in the main
    thread, traffic goes back to stable and the canary track empties before the lock is released."""
    from tasks import deploy
    from tasks.lib import step
    from tasks.lib.errors import Terminated

    fake, kube = cluster
    exports = {v: stub_export(tmp_path, v) for v in (4, 5)}
    first_version(kube, exports[4])
    previous = signal.getsignal(signal.SIGTERM)
    try:
        step.raise_on_sigterm()
        with pytest.raises(Terminated, match="during the canary of version 5: traffic is back on stable version 4"), \
                kube.lock():
            kube.stage(exports[5], 5, tmp_path)
            kube.prepare(4, 5)
            kube.route(4, 5, 10.0)
            assert weights(fake) == [(900, "4"), (100, "5")]
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(30)  # the analysis, interrupted
            except BaseException as exc:
                deploy.back_to_stable(kube, 4, 5, exc)
                raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        step.stopping.clear()
    assert weights(fake) == [(1000, "4"), (0, "none")] and track(fake, "canary").replicas == 0
    assert not fake.get(f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/llm-serving-deploy")["spec"].get(
        "holderIdentity")


@pytest.fixture(scope="module")
def serving_env(stack_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A model name of this module's own; the stack's Triton and router are shared."""
    return params_with_model_name("serve-test", tmp_path_factory.mktemp("params"))


@pytest.mark.integration
@pytest.mark.timed
def test_a_route_change_returns_once_the_old_router_workers_are_gone(stack_env: dict[str, str]) -> None:
    """Until its old worker exits, nginx can still answer a request by the old split: a 100%
    canary step once counted a request answered by stable; an unloaded version would fail one."""
    from tasks.serving.router import NginxRouter

    router = NginxRouter(Path(stack_env["ROUTER_DIR"]), stack_env["ROUTER_URL"], stack_env["ROUTER_INTERNAL_URL"])
    for _ in range(3):
        live, old_workers = router.live(), router.worker_pids()
        assert old_workers, "the local router's nginx workers are not visible"
        router.apply(live.stable, live.canary, live.canary_weight)  # the same split, a new generation
        assert router.worker_pids() and not old_workers & router.worker_pids()


@pytest.fixture(scope="module")
def eval_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_eval_text(tmp_path_factory.mktemp("eval"), 600, 700)


def register_legacy_gpt(name: str, tokenizer_uri: str, seed: int) -> str:
    """A model of the old layout (format 1: GELU MLP, interleaved rotary pairs), registered the
    way code before the Llama layout did: a pickled module (MLflow's pytorch flavor) with the
    description of that code (no format_version, mlp_ratio) in its tag."""
    import mlflow
    import torch

    from tasks.lib.model import GPT, GPTConfig

    torch.manual_seed(seed)
    saved = {**SMALL, "mlp_ratio": 4, "rope_theta": 10000.0}
    model = GPT(GPTConfig.from_saved(saved, 1)).eval()
    with mlflow.start_run(run_name=f"serving test {name} legacy seed {seed}"):
        info = mlflow.pytorch.log_model(model, name="model", serialization_format="pickle",
                                        code_paths=[str(REPO_ROOT / "tasks")], pip_requirements=["torch==2.13.0"])
    token_hash = tokenizer_uri.rsplit("sha256-", 1)[1].split("/")[0]
    description = {"config": saved, "tokenizer_uri": tokenizer_uri, "tokenizer_hash": token_hash}
    return str(mlflow.register_model(info.model_uri, name, tags={"model_description": json.dumps(description)}).version)


# Faults of the text endpoint only, appended to an exported version's engine.py: the logits
# model of the same version stays healthy, so only the text endpoint's shadow (or canary) catches them
# (FIFTH_CHANGED: tests/helpers.py).
# each of the decoder's prefill runs 300 ms slower (a slower build; one prompt or several
# prompts' in one run), after the request took its slot: what the engine's own time to first
# token measures (the wait for a slot is not the version's)
LATE_FIRST_TOKEN = """
def _late(run_on_time):
    def late_run(self, *args, **kwargs):
        time.sleep(0.3)
        return run_on_time(self, *args, **kwargs)
    return late_run
for _decoder in (KVDecoder, FusedKVDecoder, DeviceKVDecoder):
    _decoder.prefill = _late(_decoder.__dict__["prefill"])
FusedKVDecoder.first_prompts = _late(FusedKVDecoder.__dict__["first_prompts"])
"""
FAILING_STREAMS = """
import itertools
_admit, _count = Engine.admit, itertools.count()
def _flaky_admit(self, sequence):
    if next(_count) % 5 == 4:
        return self.fail([sequence], RuntimeError("injected fault"))
    return _admit(self, sequence)
Engine.admit = _flaky_admit
"""


def openai_client(env: dict[str, str]) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{env['ROUTER_URL']}/v1", api_key="unused", max_retries=0, timeout=60)


def deploy(version: str, export_uri: str, out: Path, env: dict[str, str],
           *settings: str) -> subprocess.CompletedProcess[str]:
    """``settings``: more ``--set`` overrides of params.yaml's canary section."""
    overrides = [arg for setting in settings for arg in ("--set", setting)]
    return run_module("tasks.deploy", *CANARY, *overrides, "canary", "--model-version", version, "--export",
                      export_uri, "--output", str(out), env=env)


def finish(version: str, export_uri: Path, held: Path, out: Path, env: dict[str, str], decision: str,
           by: str | None) -> subprocess.CompletedProcess[str]:
    """``deploy finish`` with an answer as the DAG's human-in-the-loop task gives it (``by``
    None: nobody answered in time, the default was taken)."""
    answer = {"chosen_options": [decision], "responded_by": by, "responded_at": "2026-11-26 04:00:00+00:00"}
    return run_module("tasks.deploy", *CANARY, "finish", "--model-version", version, "--export", str(export_uri),
                      "--held", str(held), "--answer", json.dumps(answer), "--output", str(out), env=env)


def rolling_out(route: dict[str, Any]) -> int | None:
    """The version a deploy is rolling out: the canary, or the shadow before it."""
    return route["canary"] if route["canary"] is not None else route.get("shadow")


class StableWatcher:
    """Our own client: requests through the router for the whole test, counted by the version
    that answered; the stable share must never fail."""

    def __init__(self, router_url: str, ids: list[list[int]]) -> None:
        self.url, self.ids = router_url, np.asarray(ids, dtype=np.int64)
        self.answers: Counter[str] = Counter()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def loop(self) -> None:
        from tasks.serving.traffic import Target, one_request

        while not self.stop.is_set():
            sample = one_request(Target(f"{self.url}/v2/models/llm/infer"), self.ids, [-1], 10.0)
            self.answers[f"{sample.version}:{'ok' if sample.ok else sample.status}"] += 1
            time.sleep(0.02)

    def __enter__(self) -> StableWatcher:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=15)

    def failures(self, stable: str) -> int:
        return sum(n for key, n in self.answers.items() if key.startswith(f"{stable}:") and not key.endswith(":ok")) + \
            sum(n for key, n in self.answers.items() if key.startswith("None:"))


class Flood:
    """A client flooding the router's public listener from a loopback address of its own
    (``source``: the router limits each client address), over ``connections`` kept-alive
    connections until stopped, answers counted by status; and one slow client that opens a
    connection and never finishes its request head. Bounded (``pause_s`` after each answer: up to
    ~300 requests a second, three times a client's rate) so that on two cores it floods the
    router, not the CPU the canary is measured on."""

    def __init__(self, router_url: str, ids: list[int], connections: int = 3, pause_s: float = 0.01,
                 source: str = "127.0.0.9") -> None:
        target = urllib.parse.urlsplit(router_url)
        self.address, self.source = (target.hostname or "127.0.0.1", target.port or 80), source
        self.body = triton.infer_request(np.asarray([ids], dtype=np.int64))
        self.statuses: Counter[int] = Counter()
        self.limited_reason = ""
        self.slow_client_closed_after_s: float | None = None
        self.started = self.seconds = 0.0
        self.lock, self.stop, self.pause_s = threading.Lock(), threading.Event(), pause_s
        self.threads = [threading.Thread(target=self.flood, daemon=True) for _ in range(connections)]
        self.threads.append(threading.Thread(target=self.slow_client, daemon=True))

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(*self.address, timeout=10, source_address=(self.source, 0))

    def flood(self) -> None:
        conn = self.connect()
        while not self.stop.is_set():
            try:
                conn.request("POST", "/v2/models/llm/infer", self.body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                body, status = resp.read(), resp.status
            except (OSError, http.client.HTTPException):  # nginx closes a kept-alive connection
                conn.close()  # after keepalive_requests (1000): a client connects again
                conn = self.connect()
                continue
            with self.lock:
                self.statuses[status] += 1
                if status == 429:
                    self.limited_reason = body.decode(errors="replace")
            self.stop.wait(self.pause_s)

    def slow_client(self) -> None:
        with socket.create_connection(self.address, source_address=(self.source, 0)) as sock:
            sock.sendall(b"POST /v2/models/llm/infer HTTP/1.1\r\nHost: x\r\n")  # and nothing more
            started = time.monotonic()
            sock.settimeout(60)
            with contextlib.suppress(OSError):
                while sock.recv(4096):
                    pass
            self.slow_client_closed_after_s = time.monotonic() - started

    def __enter__(self) -> Flood:
        self.started = time.monotonic()
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.seconds = time.monotonic() - self.started
        for thread in self.threads:
            thread.join(timeout=70)


def aliases(name: str) -> dict[str, str | None]:
    from tasks.lib.registry import alias_version

    return {a: alias_version(name, a) for a in ("champion", "previous", "challenger")}


def live_route(env: dict[str, str], line: str = "demo") -> dict[str, Any]:
    """A model line's route as the live router applies it."""
    with urllib.request.urlopen(f"{env['ROUTER_URL']}/router/state", timeout=5) as resp:
        loaded: dict[str, Any] = json.loads(resp.read())[line]
        return loaded


def generate_text(env: dict[str, str], prompt: str) -> tuple[str, str]:
    """A streamed completion through the router with the official client: text and version."""
    client = openai_client(env)
    served = client.models.list().data[0].id  # the front's one model (the stack's, not this module's name)
    with client.completions.with_streaming_response.create(model=served, prompt=prompt, max_tokens=16,
                                                           stream=True) as resp:
        text = "".join(chunk.choices[0].text for chunk in resp.parse() if chunk.choices)
        return text, resp.headers["X-Model-Version"]


@pytest.mark.integration
@pytest.mark.timed
def test_rollout_promotion_rollbacks_and_restart(
    serving_env: dict[str, str], stack_env: dict[str, str], tokenizer_uri: str, eval_text: Path, tmp_path: Path
) -> None:
    """One scenario on one Triton, in the order a real registry lives through:
    first model -> good canary promoted -> NaN canary rolled back -> 5x slower canary rolled
    back -> a deploy terminated mid-canary puts stable back -> a deploy killed mid-canary, then
    retried, converges -> manual rollback -> Triton killed and brought back up serving the champion."""
    env = {**stack_env, **serving_env}
    name = serving_env["MODEL_NAME"]

    # export of a champion of the old layout (format 1): parity against PyTorch (logits and the
    # KV-cache decoder), configs, registry tags; it has no Hugging Face form (one line)
    v1 = register_legacy_gpt(name, tokenizer_uri, seed=1)
    exported = export(v1, tmp_path / "export1", env, eval_text)
    assert exported["parity"]["max_abs_logit_diff"] < 1e-3 and exported["tensorrt"] == "skipped: no GPU"
    assert exported["parity"]["decoder"]["max_abs_logit_diff"] < 1e-3
    assert "gpt-v1 model has no Hugging Face Llama form" in exported["parity"]["hf_checkpoint"]["skipped"]
    assert (tmp_path / "export1" / "triton" / "llm" / v1 / "model.onnx").exists()
    assert (tmp_path / "export1" / "triton" / "llm_generate" / v1 / "decoder.onnx").exists()
    from mlflow import MlflowClient

    tags = MlflowClient().get_model_version(name, v1).tags
    assert tags["export.uri"] == str(tmp_path / "export1") and tags["export.opset"] == "18"
    assert tags["export.hf_checkpoint"] == "skipped"
    # exported again (a retried or cleared task): kept as it is (Triton pods may be staging from
    # it), its recorded result returned; another version is refused there with one line
    committed = (tmp_path / "export1" / "_SUCCESS").stat().st_mtime_ns
    assert export(v1, tmp_path / "export1", env, eval_text) == exported
    assert (tmp_path / "export1" / "_SUCCESS").stat().st_mtime_ns == committed
    other = run_module("tasks.export", "--model-version", "999", "--output", str(tmp_path / "export1"),
                       "--eval-set", str(eval_text), env=env)
    assert other.returncode == 2 and error_lines(other) == [
        f"ERROR python -m tasks.export: --output {tmp_path / 'export1'}: already holds the export of {name} version "
        f"{v1}, which an export never replaces (it may be serving): export version 999 to another folder"]

    # a cluster track's init container: one version and the chosen backend's config
    proc = run_module("tasks.deploy", "stage", "--model-version", v1, "--export", str(tmp_path / "export1"),
                      "--repository", str(tmp_path / "models"), "--config-variant", "onnxruntime_onnx.cpu", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "models" / "llm" / v1 / "model.onnx").exists()
    assert 'platform: "onnxruntime_onnx"' in (tmp_path / "models" / "llm" / "config.pbtxt").read_text()
    assert (tmp_path / "models" / "llm_generate" / v1 / "tokenizer.json").exists()
    proc = run_module("tasks.deploy", "stage", "--model-version", "", "--export", str(tmp_path / "export1"),
                      "--repository", str(tmp_path / "models"), env=env)
    assert proc.returncode == 2 and "was never given a version" in error_lines(proc)[0], proc.stderr[-2000:]

    # the first model: checked alone at 100%, promoted, serving text through the router
    proc = deploy(v1, str(tmp_path / "export1"), tmp_path / "deploy1", env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert step_result(proc)["verdict"] == "promoted" and aliases(name)["champion"] == v1
    assert live_route(env)["stable"] == int(v1)
    text, answered_by = generate_text(env, "Return the number of")  # the old layout serves text
    assert text and answered_by == v1

    reference = json.loads((tmp_path / "export1" / "parity.json").read_text())["reference"]["inputs"][0]
    with StableWatcher(env["ROUTER_URL"], reference) as watch:
        # a good canary walks 10 -> 50 -> 100 and is promoted; v1 becomes previous. Meanwhile
        # another client floods the router and one holds a connection without finishing its
        # request: the canary's verdict and what stable answers our client do not change
        v2 = register_gpt(name, tokenizer_uri, seed=2)
        exported = export(v2, tmp_path / "export2", env, eval_text)
        check_hf_checkpoint(tmp_path / "export2", exported)
        with Flood(env["ROUTER_URL"], reference[0]) as flood:
            proc = deploy(v2, str(tmp_path / "export2"), tmp_path / "deploy2", env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        check_flood_was_refused(flood)
        report = json.loads((tmp_path / "deploy2" / "report.json").read_text())
        # first in shadow: the router mirrored the streams to v2, users got v1's answers, each copy
        # recorded and paired with them
        shadow = report["shadow"][-1]
        assert shadow["verdict"] == "pass" and shadow["served"] >= 6 and shadow["copies_ok"] == shadow["served"], shadow
        assert shadow["agreement"]["reference"] >= 0.9 and set(shadow["paired_tests"]) == {"ttft_ms", "itl_ms"}
        assert walked(report["steps"]) == [10.0, 50.0, 100.0] and report["steps"][-1]["passed"]
        for step in report["steps"]:  # the text endpoint was judged at every step, on TTFT/ITL and outputs
            text_checks = {c["check"] for c in step["checks"]}
            assert {"text_samples", "stream_error_rate", "text_agreement", "ttft", "itl"} <= text_checks, step["checks"]
            assert step["text"]["canary"]["text_agreement"] >= 0.9 and step["text"]["canary"]["streams"] >= 6
        assert report["steps"][0]["canary"]["requests"] > 0 and report["steps"][0]["stable"]["requests"] > 0
        # at 100% the router gives stable nothing: its latency baseline went straight to it in the
        # same window as the canary's traffic (not pooled from earlier steps, under another load)
        assert report["steps"][0]["direct_to_stable"] == 0
        last = report["steps"][-1]
        assert last["direct_to_stable"] == last["stable"]["requests"] >= 8 and last["latency_test"], last
        (routed_from, routed_to), (direct_from, direct_to) = last["sent_s"]["routed"], last["sent_s"]["direct"]
        assert routed_from - 0.5 < direct_from and direct_to < routed_to + 0.5, last["sent_s"]
        assert (tmp_path / "deploy2" / "canary.png").exists()
        assert aliases(name)["champion"] == v2 and aliases(name)["previous"] == v1
    assert watch.failures(v1) == 0 and watch.failures(v2) == 0, watch.answers
    check_openai_api(env, v2, json.loads((tmp_path / "export2" / "parity.json").read_text())["reference"])
    check_bad_input_while_streaming(env)
    check_poisoned_batch(env, reference[0])
    check_router_allowlist(env, v2)
    check_disconnect_frees_the_slot(env, v2)
    check_a_deploy_over_the_memory_budget_is_refused(env, tokenizer_uri, tmp_path, v2)

    with StableWatcher(env["ROUTER_URL"], reference) as watch:
        # text endpoints broken while their logits model is healthy: a fifth of the answers
        # changed, 300 ms more to the first token, a fifth of the streams failing. Each fails in
        # shadow, rolled back before any user reached it: the split never moved, the copies'
        # errors are not what users saw, stable untouched
        for fault, why, seed, settings in (
                (FIFTH_CHANGED, "shadow_text_agreement", 21, ()),
                (LATE_FIRST_TOKEN, "shadow_ttft", 22, ("step_duration_s=6", "text_rps=2")),  # (its engine serializes)
                (FAILING_STREAMS, "shadow_error_rate", 23, ())):
            broken = register_gpt(name, tokenizer_uri, seed=seed)
            clone = clone_export(tmp_path / "export2", v2, tmp_path / f"clone{broken}", broken, fault)
            proc = deploy(broken, str(clone), tmp_path / f"deploy{broken}", env, *settings)
            assert proc.returncode == 2, proc.stderr[-3000:]
            assert error_lines(proc)[0].startswith(f"ERROR python -m tasks.deploy: canary of version {broken} rolled "
                                                   f"back before any user reached it: shadow: {why}"), error_lines(proc)
            report = json.loads((tmp_path / f"deploy{broken}" / "report.json").read_text())
            assert report["steps"] == [] and report["shadow"][-1]["users"]["errors"] == 0, report["shadow"][-1]
            assert aliases(name)["champion"] == v2 and live_route(env) | {"generation": 0} == \
                {"stable": int(v2), "canary": None, "canary_weight": 0.0, "generation": 0, "shadow": None}
            assert generate_text(env, "Return the number of")[1] == v2
    assert watch.failures(v2) == 0, watch.answers

    with StableWatcher(env["ROUTER_URL"], reference) as watch:
        # a model whose logits are NaN (its ONNX file replaced after export) is rolled back
        v3 = register_gpt(name, tokenizer_uri, seed=3)
        clone_export(tmp_path / "export2", v2, tmp_path / "export3", v3)  # v2's files as v3's: the export step is v2's
        nan_model(tmp_path / "export3" / "triton" / "llm" / v3 / "model.onnx", tmp_path / "export3")
        proc = deploy(v3, str(tmp_path / "export3"), tmp_path / "deploy3", env)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "non-finite" in error_lines(proc)[0] or "finite_logits" in error_lines(proc)[0], error_lines(proc)
        assert aliases(name)["champion"] == v2 and live_route(env) | {"generation": 0} == \
            {"stable": int(v2), "canary": None, "canary_weight": 0.0, "generation": 0, "shadow": None}

        # a model ~5x slower (a bigger network, same outputs checks) is rolled back on latency:
        # its logits requests', or its streams' time to first token or inter-token latency (the
        # shadow off: the canary steps' own latency checks judge it)
        v4 = register_gpt(name, tokenizer_uri, seed=4, d_model=256, n_layers=8)
        export(v4, tmp_path / "export4", env, eval_text)
        proc = deploy(v4, str(tmp_path / "export4"), tmp_path / "deploy4", env, "shadow=false")
        assert proc.returncode == 2, proc.stderr[-3000:]
        report = json.loads((tmp_path / "deploy4" / "report.json").read_text())
        step = report["steps"][-1]
        assert report["verdict"] == "rolled back" and report["shadow"] == [], report["verdict"]
        # what the analysis allows: clearly slower at once (fail), or slower by less than
        # clearly_slower_factor on each of the step's max_analyses analyses (inconclusive: rolled
        # back all the same); a step analysed again was inconclusive the time before
        max_analyses = yaml.safe_load(Path(env["PIPELINE_PARAMS"]).read_text())["canary"]["max_analyses"]
        assert step["verdict"] == "fail" or (step["verdict"] == "inconclusive" and step["analysis"] == max_analyses), \
            (step["verdict"], step["analysis"], step["checks"])
        assert step["analysis"] == 1 or report["steps"][-2]["verdict"] == "inconclusive", report["steps"][-2]["checks"]
        # and latency is what it was judged slower on: a latency check that did not pass, which
        # it only does when the canary is slower (p < latency_alpha), named in the one error line
        tests = {"latency": step["latency_test"], **{k.removesuffix("_ms"): v for k, v in step["text"]["tests"].items()}}
        slower = [c for c in step["checks"] if c["check"] in tests and c["verdict"] != "pass"]
        alpha = yaml.safe_load(Path(env["PIPELINE_PARAMS"]).read_text())["canary"]["latency_alpha"]
        assert slower and all(tests[c["check"]]["p_value"] < alpha for c in slower), step["checks"]
        assert any(error_lines(proc)[0].startswith(f"{c['check']}: ") or c["check"] in error_lines(proc)[0]
                   for c in step["checks"] if c["verdict"] != "pass"), error_lines(proc)
        assert aliases(name)["champion"] == v2 and live_route(env)["stable"] == int(v2)
    assert watch.failures(v2) == 0, watch.answers

    # a deploy terminated mid-rollout (SIGTERM: a task killed from the UI, an evicted pod; here in
    # its shadow stage) turns the mirror off, keeps traffic on stable and unloads the new version
    # before it exits (143, one line)
    v5 = register_gpt(name, tokenizer_uri, seed=5)
    clone_export(tmp_path / "export2", v2, tmp_path / "export5", v5)  # what deploy does is tested here, not export
    terminated = subprocess.Popen([str(RUNTIME_PY), "-m", "tasks.deploy", *CANARY, "--set", "step_duration_s=30",
                                   "canary", "--model-version", v5, "--export", str(tmp_path / "export5"),
                                   "--output", str(tmp_path / "deploy5")],
                                  cwd=REPO_ROOT, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while rolling_out(live_route(env)) != int(v5):  # in shadow: traffic copied, none moved
        assert time.monotonic() < deadline and terminated.poll() is None
        time.sleep(0.2)
    terminated.send_signal(signal.SIGTERM)
    started = time.monotonic()
    _, stderr = terminated.communicate(timeout=60)
    assert time.monotonic() - started < 30, "not back within Kubernetes' default grace period"
    assert terminated.returncode == 143, stderr[-3000:]
    assert [line for line in stderr.splitlines() if line.startswith("ERROR")] == [
        f"ERROR python -m tasks.deploy: terminated by SIGTERM during the canary of version {v5}: traffic is back "
        f"on stable version {v2}"], stderr[-3000:]
    assert live_route(env) | {"generation": 0} == {"stable": int(v2), "canary": None, "canary_weight": 0.0,
                                                   "generation": 0, "shadow": None}
    with pytest.raises(urllib.error.HTTPError):  # the canary is unloaded, not left running
        urllib.request.urlopen(f"{env['TRITON_URL']}/v2/models/llm/versions/{v5}/ready", timeout=5)
    assert aliases(name)["champion"] == v2

    # a deploy killed mid-canary (SIGKILL: nothing runs after) leaves a canary behind; the retry
    # rolls it back and converges
    killed = subprocess.Popen([str(RUNTIME_PY), "-m", "tasks.deploy", *CANARY, "--set", "step_duration_s=30",
                               "--set", "shadow=false", "canary", "--model-version", v5, "--export", str(tmp_path / "export5"),
                               "--output", str(tmp_path / "deploy5")],
                              cwd=REPO_ROOT, env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while live_route(env)["canary"] != int(v5):  # at its first step (no shadow: the SIGTERM above met that)
        assert time.monotonic() < deadline and killed.poll() is None
        time.sleep(0.2)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    reads = []
    for _ in range(50):  # the route the killed deploy left, once three reads in a row agree
        reads.append(live_route(env))
        if len(reads) >= 3 and reads[-1] == reads[-2] == reads[-3]:
            break
        time.sleep(0.1)
    assert reads[-1]["canary"] == int(v5), reads  # left behind
    # the retry, with a person in the loop: it rolls the leftover back, walks shadow, 10% and
    # 50%, and holds there (exit 0), its traffic left as it is for the person's answer
    proc = deploy(v5, str(tmp_path / "export5"), tmp_path / "deploy5", env, "approval.enabled=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rolling it back first" in proc.stderr
    held = step_result(proc)
    assert held["verdict"] == "held" and held["held_at"] == 50.0, held
    assert "holds at **50%**" in held["approval_text"], held["approval_text"]
    assert re.search(r"- 50% \(analysis \d\): \*\*pass\*\*", held["approval_text"]), held["approval_text"]
    assert live_route(env) | {"generation": 0} == {"stable": int(v2), "canary": int(v5), "canary_weight": 50.0,
                                                   "generation": 0, "shadow": None}
    # Extend: the 50% step analysed once more on fresh traffic; it passes: 100%, promoted; who,
    # when and what in the report and the version's tags
    proc = finish(v5, tmp_path / "export5", tmp_path / "deploy5", tmp_path / "finish5", env, "Extend", "admin")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "finish5" / "report.json").read_text())
    assert walked(report["steps"]) == [10.0, 50.0, 100.0] and report["verdict"] == "promoted"
    assert sum(s["weight"] == 50.0 for s in report["steps"]) >= 2  # the held step, and Extend's analysis
    assert report["approval"] | {"at": None} == {"enabled": True, "hold_before": 100, "decision": "Extend",
                                                 "by": "admin", "at": None}
    from mlflow import MlflowClient

    tags = MlflowClient().get_model_version(name, v5).tags
    assert (tags["approval.decision"], tags["approval.by"]) == ("Extend", "admin") and tags["approval.at"]
    assert aliases(name)["champion"] == v5 and live_route(env)["stable"] == int(v5)
    again = deploy(v5, str(tmp_path / "export5"), tmp_path / "deploy5", env)  # nothing left to do
    assert again.returncode == 0 and step_result(again).get("verdict") == "promoted"

    # held before its first step (no shadow: at 0%, the new version loaded, no user's traffic):
    # a person's "Roll back" ends it as a gate does (exit 99); a deploy run again supersedes a
    # held rollout (rolled back first) and holds anew; no answer in time rolls back (exit 2)
    v6 = register_gpt(name, tokenizer_uri, seed=6)
    clone = clone_export(tmp_path / "export2", v2, tmp_path / f"clone{v6}", v6)
    for run, (answer, by, code, why) in enumerate((("Roll back", "admin", 99, "rolled back by admin"),
                                                  ("Roll back", None, 2, "no decision within 7200s"))):
        held_out = tmp_path / f"deploy{v6}-{run}"
        for attempt in range(1 + run):
            proc = deploy(v6, str(clone), held_out, env, "approval.enabled=true", "approval.hold_before=10",
                          "shadow=false", "warmup_streams=0")  # (nothing judged before the answer)
            assert proc.returncode == 0 and step_result(proc)["held_at"] == 0.0, proc.stderr[-3000:]
            assert ("rolling it back first" in proc.stderr) == (attempt == 1), proc.stderr[-3000:]
        assert live_route(env)["canary"] == int(v6) and live_route(env)["canary_weight"] == 0.0
        for _ in range(2 - run):  # the person's answer carried out twice (a retried task): the same outcome
            proc = finish(v6, clone, held_out, tmp_path / f"finish{v6}-{run}", env, answer, by)
            assert proc.returncode == code, proc.stderr[-3000:]
            line = next(x for x in proc.stderr.splitlines() if x.startswith(("ERROR", "REJECTED")))
            assert line.split(": ", 1)[1].startswith(f"canary of version {v6} rolled back before any user reached "
                                                     f"it: {why}"), line
            assert live_route(env) | {"generation": 0} == {"stable": int(v5), "canary": None, "canary_weight": 0.0,
                                                           "generation": 0, "shadow": None}
    assert aliases(name)["champion"] == v5
    # a run that ends with its rollout still held (its approval task failed, the run was stopped):
    # its release_hold task rolls it back; a decision arriving after that changes nothing, with one line
    proc = deploy(v6, str(clone), tmp_path / f"deploy{v6}-2", env, "approval.enabled=true", "approval.hold_before=10",
                  "shadow=false", "warmup_streams=0")
    assert proc.returncode == 0 and live_route(env)["canary"] == int(v6), proc.stderr[-3000:]
    for released in (int(v6), None):  # the second time: nothing held, nothing done
        proc = run_module("tasks.deploy", "release", "--held", str(tmp_path / f"deploy{v6}-2"), env=env)
        assert proc.returncode == 0 and step_result(proc)["released"] == released, proc.stderr[-3000:]
        assert live_route(env)["stable"] == int(v5) and live_route(env)["canary"] is None
    stale = finish(v6, clone, tmp_path / f"deploy{v6}-2", tmp_path / f"finish{v6}-late", env, "Promote", "admin")
    assert stale.returncode == 2 and "no longer holds at 0%" in error_lines(stale)[0], stale.stderr[-3000:]

    # the manual rollback restores the previous champion and all its traffic
    proc = run_module("tasks.deploy", "rollback", "--target", "previous", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert aliases(name)["champion"] == v2 and live_route(env)["stable"] == int(v2)
    _, answered_by = generate_text(env, "This module provides")
    assert answered_by == v2
    bad = run_module("tasks.deploy", "rollback", "--target", "no-such-alias", env=env)
    assert bad.returncode == 2 and "does not exist" in error_lines(bad)[0]

    # Triton killed (its whole process group, as a crashed container), then `stack up`: it comes
    # back with the route's versions loaded from the model repository before the router is
    # checked, and the champion answers with no deploy; `stack status` says serving is whole
    # Meanwhile Prometheus's alert rule sees the route name a version Triton does not serve
    assert eventually(lambda: route_versions_not_served(env), []) == []
    os.killpg(int((Path(env["STACK_DIR"]) / "triton.pid").read_text()), signal.SIGKILL)
    not_served = [("llm", v2), ("llm_generate", v2)]  # both of the champion's models, each paged
    assert eventually(lambda: route_versions_not_served(env), not_served) == not_served
    proc = run_module("stack", "up", env=env)
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr[-3000:]
    text, answered_by = generate_text(env, "This module provides")
    assert text and answered_by == v2
    assert eventually(lambda: route_versions_not_served(env), []) == []
    # docker-compose.yaml's serving-reconcile: the same, from the container's environment (a
    # Triton restarted by Compose comes back empty: here its models unloaded)
    for model in ("llm_generate", "llm"):
        urllib.request.urlopen(urllib.request.Request(f"{env['TRITON_URL']}/v2/repository/models/{model}/unload",
                                                      data=b"{}", method="POST"), timeout=30).close()
    compose_env = {k: env[k] for k in ("TRITON_URL", "TRITON_REPOSITORY", "ROUTER_DIR")}
    proc = subprocess.run([str(RUNTIME_PY), "-m", "stack", "reconcile-serving"], cwd=REPO_ROOT, capture_output=True,
                          text=True, env={"PATH": os.environ["PATH"], "STACK_DIR": str(tmp_path / "no-stack-here"),
                                          **compose_env}, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == f"serving: loaded the routes' versions {{'demo': [{int(v2)}]}}", \
        proc.stdout + proc.stderr[-3000:]
    assert generate_text(env, "This module provides")[1] == v2
    proc = run_module("stack", "status", env=env)
    assert proc.returncode == 0 and f"serving (routes: demo versions {v2}): healthy" in proc.stdout, proc.stdout


def walked(steps: list[dict[str, Any]]) -> list[float]:
    """The weights a rollout's steps walked, each once, after checking what the analysis allows:
    a step is analysed again (on fresh traffic) only after an inconclusive analysis of it, and
    only a step's last analysis may pass."""
    weights: list[float] = []
    for before, step in zip([None, *steps], steps, strict=False):
        if weights and weights[-1] == step["weight"] and before is not None:
            assert before["verdict"] != "pass" or step["analysis"] == 1, (before["verdict"], step)
        else:
            weights.append(step["weight"])
    return weights


def route_versions_not_served(env: dict[str, str]) -> list[tuple[str, str]]:
    """The (model, version) pairs for which the alert rule LLMServingRouteVersionNotServed holds
    now, asked of the stack's Prometheus with the rule's own expression."""
    rules = yaml.safe_load((REPO_ROOT / "observability" / "alerts.yml").read_text())["groups"]
    expr = next(r["expr"] for g in rules for r in g["rules"] if r.get("alert") == "LLMServingRouteVersionNotServed")
    return sorted((r["metric"]["model"], r["metric"]["version"]) for r in prometheus_query(expr, env)["data"]["result"])


def eventually(read: Any, wanted: Any, timeout_s: float = 60.0) -> Any:
    """``read()`` until it returns ``wanted`` (Prometheus scrapes every 5 s) or time is up; the last value."""
    deadline = time.monotonic() + timeout_s
    while (value := read()) != wanted and time.monotonic() < deadline:
        time.sleep(1)
    return value


def check_flood_was_refused(flood: Flood) -> None:
    """The flood got the router's 429s with one line, and no more answers than its client's rate
    and burst allow over the time it flooded; the slow client was cut off."""
    from tasks.serving.router import ClientLimits

    limits = ClientLimits.from_params()
    allowed = limits.rate_per_client * flood.seconds * 1.1 + limits.burst
    assert set(flood.statuses) <= {200, 429}, flood.statuses  # the flood itself failed nothing else
    # what the limit guarantees is the bound on what gets through, the rest refused with 429: how
    # many are refused depends on how fast this client sends on a busy machine (7% of 3,437 in a
    # run beside other work), so only that some were
    assert flood.statuses[429] > 0 and 0 < flood.statuses[200] <= allowed, (flood.statuses, flood.seconds)
    assert json.loads(flood.limited_reason)["error"].startswith("too many requests from this client: at most "
                                                                f"{limits.rate_per_client} a second")
    assert flood.slow_client_closed_after_s is not None
    assert flood.slow_client_closed_after_s < limits.client_timeout_s + 5, flood.slow_client_closed_after_s


def check_hf_checkpoint(export_dir: Path, exported: dict[str, Any]) -> None:
    """transformers loads the export's Hugging Face folder and its logits match ours on the
    held-out prompts and windows (the export checked it; this reads the folder again)."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    assert exported["parity"]["hf_checkpoint"]["max_abs_logit_diff"] < 1e-4
    folder = export_dir / "hf"
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    model = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    reference = json.loads((export_dir / "parity.json").read_text())["reference"]
    for generation in reference["generations"]:  # greedy with transformers' own generate() = ours
        ids = tokenizer(generation["prompt"], return_tensors="pt").input_ids
        assert ids[0].tolist() == generation["prompt_ids"]
        out = model.generate(ids, max_new_tokens=len(generation["tokens"]), do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        new = out[0, ids.shape[1]:].tolist()
        assert new[:len(generation["tokens"])] == generation["tokens"], generation["prompt"]


def check_openai_api(env: dict[str, str], version: str, reference: dict[str, Any]) -> None:
    """The official client through the router: models, completions and chat, streamed and not;
    greedy text equals the export's PyTorch reference; every answer names its version."""
    client = openai_client(env)
    served = client.models.list().data[0].id
    generation = reference["generations"][0]
    whole = client.completions.with_raw_response.create(model=served, prompt=generation["prompt"],
                                                        max_tokens=len(generation["tokens"]), temperature=0)
    assert whole.headers["X-Model-Version"] == version
    completion = whole.parse()
    assert completion.choices[0].text == generation["text"]
    assert completion.usage.prompt_tokens == len(generation["prompt_ids"])
    chunks = list(client.completions.create(model=served, prompt=generation["prompt"], temperature=0,
                                            max_tokens=len(generation["tokens"]), stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == generation["text"]
    assert len(chunks) > 3 and chunks[-1].usage.completion_tokens == completion.usage.completion_tokens
    chat = client.chat.completions.create(model=served, messages=[{"role": "user", "content": "Return the number of"}],
                                          max_tokens=8)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    deltas = list(client.chat.completions.create(model=served, stream=True, max_tokens=8,
                                                 messages=[{"role": "user", "content": "This module provides"}]))
    assert deltas[0].choices[0].delta.role == "assistant" and deltas[-1].choices[0].finish_reason in ("stop", "length")
    seeded = [client.completions.create(model=served, prompt="Raise", max_tokens=12, temperature=1.0, top_p=0.9,
                                        seed=11).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]


def check_bad_input_while_streaming(env: dict[str, str]) -> None:
    """Each bad request gets a 400 and a one-line reason, while streams in flight complete
    unharmed (the same greedy text as a stream alone)."""
    import openai

    client = openai_client(env)
    served = client.models.list().data[0].id
    alone = client.completions.create(model=served, prompt="This module provides", max_tokens=40, temperature=0)
    texts: list[str] = []

    def stream() -> None:
        texts.append("".join(c.choices[0].text for c in client.completions.create(
            model=served, prompt="This module provides", max_tokens=40, temperature=0, stream=True) if c.choices))

    streams = [threading.Thread(target=stream) for _ in range(6)]
    for thread in streams:
        thread.start()
    bad_settings = [{"prompt": "word " * 400, "max_tokens": 4}, {"prompt": "Return", "max_tokens": 100_000},
                    {"prompt": "Return", "temperature": 9}, {"prompt": "Return", "top_p": 0},
                    {"prompt": "Return", "extra_body": {"top_k": -3}}, {"prompt": "", "max_tokens": 4}]
    for settings in bad_settings:
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=served, **settings)
        assert refused.value.message and "\n" not in refused.value.message, settings
    for raw in (b"{not json", b'{"prompt": "caf\xc3", "max_tokens": 3}', b'{"prompt": "\\ud800", "max_tokens": 3}'):
        request = urllib.request.Request(f"{env['ROUTER_URL']}/v1/completions", data=raw, method="POST",
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as failed:
            urllib.request.urlopen(request, timeout=30)
        assert failed.value.code == 400 and "\n" not in json.loads(failed.value.read())["error"]["message"]
    for thread in streams:
        thread.join(60)
    assert texts == [alone.choices[0].text] * 6


def http_call(url: str, method: str = "GET", body: bytes | None = None,
              headers: dict[str, str] | None = None) -> tuple[int, str]:
    """One request: ``(status, the version that answered)``, or ``(status, its body)`` when refused."""
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, resp.headers.get("X-Model-Version", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def check_poisoned_batch(env: dict[str, str], ids: list[int], rounds: int = 3) -> None:
    """6 malformed logits requests (a token id of 10^6 at the valid requests' length, so they share
    their batches; 5,000 tokens) mixed into 60 valid ones, all at once through the router: every
    valid one answered, every malformed one a 400 naming input_ids, in each round."""
    def send(window: np.ndarray[Any, Any]) -> tuple[int, str]:
        status, text = http_call(f"{env['ROUTER_URL']}/v2/models/llm/infer", "POST", triton.infer_request(window),
                                 {"Content-Type": "application/json"})
        return (status, "") if status == 200 else (status, json.loads(text).get("error", ""))

    valid = np.asarray([ids], dtype=np.int64)
    poisoned = valid.copy()
    poisoned[0, len(ids) // 2] = 10**6
    too_long = np.ones((1, 5000), dtype=np.int64)
    mix = [valid] * 60
    for at, bad in zip((5, 15, 25, 35, 45, 55), [poisoned, too_long] * 3, strict=True):
        mix.insert(at, bad)
    for _ in range(rounds):
        with ThreadPoolExecutor(max_workers=len(mix)) as pool:
            answers = list(pool.map(send, mix))
        good = [a for window, a in zip(mix, answers, strict=True) if window is valid]
        bad = [a for window, a in zip(mix, answers, strict=True) if window is not valid]
        assert good == [(200, "")] * 60, Counter(good)
        assert all(status == 400 and reason.startswith("input_ids: ") and "\n" not in reason
                   for status, reason in bad), bad


def check_router_allowlist(env: dict[str, str], stable: str) -> None:
    """Clients reach inference, /v1, health and metadata through the router, nothing else:
    Triton's repository control and a version's own paths are 404 (the champion keeps serving); a
    client's own X-Route-Version picks nothing; deploy's internal listener reaches a version."""
    router, infer = env["ROUTER_URL"], triton.infer_request(np.ones((1, 4), dtype=np.int64))
    for path in ("/v2/repository/index", "/v2/repository/models/llm/unload", "/v2/repository/models/llm_generate/unload",
                 "/v2/repository/models/llm/load", f"/v2/models/llm/versions/{stable}/infer"):
        status, body = http_call(router + path, "POST", b"{}" if "infer" not in path else infer,
                            {"Content-Type": "application/json"})
        assert status == 404 and "not served by this router" in body, (path, status, body)
    assert http_call(f"{router}/v2/models/llm/versions/{stable}")[0] == 404
    assert http_call(f"{router}/v2/health/ready")[0] == 200 and http_call(f"{router}/v2/models/llm")[0] == 200
    assert http_call(f"{router}/v2/health/ready", "POST", b"")[0] == 403
    assert generate_text(env, "Return the number of")[1] == stable  # still loaded, still served
    completion = json.dumps({"prompt": "Return", "max_tokens": 2}).encode()
    status, answered_by = http_call(f"{router}/v1/completions", "POST", completion,
                               {"Content-Type": "application/json", "X-Route-Version": "999"})
    assert (status, answered_by) == (200, stable)
    status, answered_by = http_call(f"{env['ROUTER_INTERNAL_URL']}/v2/models/llm/versions/{stable}/infer", "POST", infer,
                               {"Content-Type": "application/json"})
    assert (status, answered_by) == (200, stable)


def check_disconnect_frees_the_slot(env: dict[str, str], version: str) -> None:
    """Clients that go away mid-stream free their engine slots (their requests end: cancelled, or finished)."""
    import urllib.parse

    def metric(name: str) -> float:
        with urllib.request.urlopen(env["TRITON_METRICS_URL"], timeout=10) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(f'{name}{{model="llm_generate",version="{version}"}}'):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0

    router = urllib.parse.urlsplit(env["ROUTER_URL"])
    prompt = "Return"
    request = urllib.request.Request(f"{env['ROUTER_URL']}/v1/completions", method="POST",
                                     data=json.dumps({"prompt": prompt, "max_tokens": 1}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        probe = json.loads(resp.read())
    # the longest generation the context allows, no early EOS (a 120-token request is refused at a
    # context of 64; 60 tokens with EOS allowed finished before its cancellation on a loaded machine)
    longest = helpers.SMALL["seq_len"] - probe["usage"]["prompt_tokens"]
    body = json.dumps({"prompt": prompt, "max_tokens": longest, "ignore_eos": True, "stream": True})
    ended = metric("llm_requests_cancelled_total") + metric("llm_requests_finished_total")
    # several at once share the engine's steps, so each generates slower than alone; still, a
    # generation this short (the context is 64) may end before its client's disconnect reaches the
    # engine (it asks Triton every 10 ms): each stream ends, cancelled or finished, and frees its
    # slot (tests/tasks/serving/test_front.py cancels long generations mid-stream)
    streams = [http.client.HTTPConnection(router.hostname, router.port, timeout=30) for _ in range(4)]
    for conn in streams:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    for conn in streams:
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()[:500]
        assert resp.readline().startswith(b"data:")
    for conn in streams:
        conn.sock.close()  # gone mid-stream
        conn.close()
    deadline = time.monotonic() + 20
    while metric("llm_requests_cancelled_total") + metric("llm_requests_finished_total") < ended + len(streams) \
            or metric("llm_slots_in_use") > 0:
        assert time.monotonic() < deadline, "the engine never freed the disconnected clients' slots"
        time.sleep(0.2)


def check_a_deploy_over_the_memory_budget_is_refused(env: dict[str, str], tokenizer_uri: str, tmp_path: Path,
                                                     stable: str) -> None:
    """A version that would not fit Triton's memory beside stable (serve.memory_budget_mb): refused
    with one line before anything is staged or loaded; stable keeps serving alone."""
    params = yaml.safe_load(Path(env["PIPELINE_PARAMS"]).read_text())
    params["serve"]["memory_budget_mb"] = 0.5
    tight = tmp_path / "tight-memory.yaml"
    tight.write_text(yaml.safe_dump(params))
    version = register_gpt(env["MODEL_NAME"], tokenizer_uri, seed=30)
    clone = clone_export(tmp_path / "export2", stable, tmp_path / f"clone{version}", version)
    proc = deploy(version, str(clone), tmp_path / f"deploy{version}", {**env, "PIPELINE_PARAMS": str(tight)})
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = error_lines(proc)[0]
    assert line.startswith(f"ERROR python -m tasks.deploy: version {version} ") and f" beside version {stable} " in line \
        and line.endswith("over serve.memory_budget_mb 0.5 (lower serve.kv_cache_mb or serve.max_slots, or raise the "
                          "budget)"), line
    assert live_route(env) | {"generation": 0} == \
        {"stable": int(stable), "canary": None, "canary_weight": 0.0, "generation": 0, "shadow": None}
    assert not (Path(env["TRITON_REPOSITORY"]) / "llm_generate" / version).exists()
    assert not (tmp_path / f"deploy{version}").exists()


def nan_model(path: Path, export: Path) -> None:
    """Rewrite an ONNX file so every logit is NaN (its graph kept, one weight poisoned), and
    commit the export again: as if the export step had produced that model (readers check
    files against the manifest)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    for init in model.graph.initializer:
        array = numpy_helper.to_array(init)
        if array.dtype == np.float32 and array.ndim == 1 and "norm" in init.name:
            init.CopyFrom(numpy_helper.from_array(np.full_like(array, np.nan), init.name))
            break
    else:
        raise AssertionError("no norm weight to poison")
    onnx.save(model, str(path))
    from tasks.lib import storage

    (export / storage.SUCCESS_MARKER).unlink()
    (export / storage.SUCCESS_MARKER).write_text(json.dumps(storage.manifest_of(export)))
