"""The public edge against the real router, OpenAI front and Triton: request bodies read whole
whatever their pieces, client input answered with 4xx in OpenAI's shape (fuzzed from the front's
own OpenAPI document), abandoned requests cancelled, huge prompts refused by size, internal
headers from clients stripped, the capture bounded. One small model, served for the module
(staged and routed directly: the rollout itself is tests/tasks/test_serving.py's)."""

from __future__ import annotations

import hashlib
import http.client
import json
import socket
import statistics
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from helpers import export, params_with_model_name, register_gpt, served_alone, write_eval_text

from tasks.serving.contract import MAX_BODY_BYTES

pytestmark = [pytest.mark.integration, pytest.mark.timed]  # an abandoned request's slot: within 2x idle
# long enough that an abandoned request would still be generating a second later
MODEL = {"seq_len": 256, "d_model": 128, "n_layers": 4, "n_heads": 4}


@pytest.fixture(scope="module")
def served(stack_env: dict[str, str], tokenizer_uri: str, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[dict[str, str]]:
    """A registered, exported version loaded in the stack's Triton and routed to (all traffic)."""
    folder = tmp_path_factory.mktemp("front")
    env = {**stack_env, **params_with_model_name("front-test", folder)}
    version = register_gpt(env["MODEL_NAME"], tokenizer_uri, seed=5, **MODEL)
    export(version, folder / "export", env, write_eval_text(folder, 600, 640))
    with served_alone(env, version, folder / "export", folder / "scratch"):
        yield {**env, "VERSION": version}


def served_name(env: dict[str, str]) -> str:
    with urllib.request.urlopen(f"{env['OPENAI_API_URL']}/v1/models", timeout=10) as resp:
        name: str = json.loads(resp.read())["data"][0]["id"]
        return name


def raw_request(url: str, path: str, body: bytes, pieces: int = 1, chunked: bool = False,
                headers: dict[str, bytes] | None = None, source: str = "127.0.0.1") -> tuple[int, dict[str, Any]]:
    """A POST over a raw socket, its body written in ``pieces`` writes a few ms apart (or as
    chunked transfer encoding, one chunk a piece): ``(status, JSON body)``."""
    target = urllib.parse.urlsplit(url)
    head = [f"POST {path} HTTP/1.1".encode(), f"Host: {target.hostname}".encode(), b"Content-Type: application/json",
            b"Connection: close", *(name.encode() + b": " + value for name, value in (headers or {}).items())]
    head.append(b"Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}".encode())
    size = max(1, -(-len(body) // pieces))
    parts = [body[i:i + size] for i in range(0, len(body), size)] or [b""]
    with socket.create_connection((target.hostname, target.port), timeout=60, source_address=(source, 0)) as sock:
        sock.sendall(b"\r\n".join(head) + b"\r\n\r\n")
        for part in parts:
            time.sleep(0.003)
            sock.sendall(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
        if chunked:
            sock.sendall(b"0\r\n\r\n")
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, json.loads(response.read() or b"{}")


def completion_body(env: dict[str, str], size: int, **fields: Any) -> bytes:
    """A valid completions request of ``size`` bytes (an ignored field pads it)."""
    body = {"prompt": "Return", "max_tokens": 2, **fields, "user": ""}
    padding = size - len(json.dumps(body).encode())
    assert padding >= 0, size
    return json.dumps({**body, "user": "x" * padding}).encode()


def post(url: str, body: dict[str, Any] | bytes, timeout: float = 60,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any], dict[str, str]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}"), dict(exc.headers)


def is_openai_error(body: dict[str, Any]) -> bool:
    error = body.get("error")
    return isinstance(error, dict) and isinstance(error.get("message"), str) and "\n" not in error["message"] \
        and set(error) == {"message", "type", "param", "code"}


def test_a_body_is_read_whole_however_it_arrives(served: dict[str, str]) -> None:
    """Bodies of 60 bytes to the limit, in 1, 2 and 50 writes and chunked, through the router
    and straight to the front: each answered as whole (before, a body in two writes was cut
    and answered 'not valid JSON'); one byte over the limit is a 413 in OpenAI's shape."""
    answers = {}
    for name, url in (("router", served["ROUTER_URL"]), ("front", served["OPENAI_API_URL"])):
        for size in (60, 1024, 65_536, MAX_BODY_BYTES):
            body = completion_body(served, size)
            for pieces, chunked in ((1, False), (2, False), (50, False), (7, True)):
                status, answer = raw_request(url, "/v1/completions", body, pieces, chunked)
                answers[name, size, pieces, chunked] = (status, answer.get("object"))
        status, answer = raw_request(url, "/v1/completions", completion_body(served, MAX_BODY_BYTES + 1), 3)
        assert status == 413 and is_openai_error(answer), (name, status, answer)
        # a prompt that cannot fit the context, sent in pieces: the engine's reason, not a JSON error
        status, answer = raw_request(url, "/v1/completions", completion_body(
            served, 310_000, prompt="word " * 60_000), 40)
        assert status == 400 and "cannot fit the model's context" in answer["error"]["message"], (name, answer)
    assert set(answers.values()) == {(200, "text_completion")}, answers


def test_client_input_gets_a_4xx_in_openais_shape(served: dict[str, str]) -> None:
    """What once got '500 Internal Server Error' in plain text: an infinite max_tokens, a NaN seed,
    stream_options not an object; and values each field refuses."""
    url = f"{served['ROUTER_URL']}/v1/completions"
    name = served_name(served)
    bodies = [b'{"prompt": "Return", "max_tokens": 1e999}', b'{"prompt": "Return", "seed": NaN}',
              b'{"prompt": "Return", "stream": true, "stream_options": 5}',
              b'{"prompt": "Return", "max_tokens": 99999999999999999999999}', b'{"prompt": "Return", "top_p": -0.0}',
              b'{"prompt": "Return", "stop": [1]}', b'{"prompt": [[1, 2]]}', b'{"prompt": "Return", "n": 2}',
              b'{"prompt": "Return", "temperature": "hot"}', b'[' * 50_000, b'{"prompt": "Return", "model": 7}',
              b'{"prompt": "Return", "stream": "yes"}', json.dumps({"prompt": "x", "model": name + "-no"}).encode()]
    for body in bodies:
        status, answer, _ = post(url, body)
        assert status in (400, 404) and is_openai_error(answer), (body[:80], status, answer)
    chat = f"{served['ROUTER_URL']}/v1/chat/completions"
    for messages in ([], [{"role": "robot", "content": "x"}], [{"role": "user", "content": [{"type": "image_url"}]}],
                     "hello", [{"role": "user"}]):
        status, answer, _ = post(chat, {"messages": messages})
        assert status == 400 and is_openai_error(answer), (messages, status, answer)
    status, answer, _ = post(f"{served['OPENAI_API_URL']}/v1/nothing", b"{}")
    assert status == 404 and is_openai_error(answer)
    for url in (served["ROUTER_URL"], served["OPENAI_API_URL"]):  # a body that is not what its encoding says
        for encoding in (b"gzip", b"deflate", b"br"):
            status, answer = raw_request(url, "/v1/completions", b'{"prompt": "Return"}',
                                         headers={"Content-Encoding": encoding})
            assert status == 400 and is_openai_error(answer), (url, encoding, status, answer)


def engine_metric(env: dict[str, str], name: str) -> float:
    with urllib.request.urlopen(env["TRITON_METRICS_URL"], timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(f'{name}{{model="llm_generate",version="{env["VERSION"]}"}}'):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def completion_seconds(env: dict[str, str], max_tokens: int) -> float:
    started = time.perf_counter()
    status, _, _ = post(f"{env['ROUTER_URL']}/v1/completions", {"prompt": "Return the", "max_tokens": max_tokens})
    assert status == 200
    return time.perf_counter() - started


def test_a_request_its_client_abandons_is_cancelled_streamed_or_not(served: dict[str, str]) -> None:
    """40 non-streamed requests generating to the end of the context (``ignore_eos``), their
    clients gone after 150 ms: each is cancelled, or ended before it reached the engine, and the
    engine is idle within 2 s, 0.5 s of which the engine's published figures may lag (before, 6
    of 40 were cancelled and the engine generated the rest, ~4 s holding every slot); a new
    request then takes as long as on an idle engine, within 2x. Streamed requests likewise."""
    idle = statistics.median(completion_seconds(served, 4) for _ in range(5))
    for stream in (False, True):
        time.sleep(0.6)  # the engine's figures of what ran before, published
        cancelled, finished = (engine_metric(served, f"llm_requests_{k}_total") for k in ("cancelled", "finished"))
        body = json.dumps({"prompt": "Return the", "max_tokens": 240, "ignore_eos": True, "stream": stream}).encode()

        def abandon(_: int, body: bytes = body) -> None:
            target = urllib.parse.urlsplit(served["ROUTER_URL"])
            with socket.create_connection((target.hostname, target.port), timeout=10) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                time.sleep(0.15)  # and gone, answer or not

        with ThreadPoolExecutor(max_workers=40) as pool:
            list(pool.map(abandon, range(40)))
        gone = time.monotonic()
        time.sleep(0.6)  # the engine's figures are published every 0.5 s
        while engine_metric(served, "llm_slots_in_use") or engine_metric(served, "llm_queue_length"):
            assert time.monotonic() - gone < 20, "the abandoned requests still hold the engine"
            time.sleep(0.05)
        # generated to their ends, the 40 would hold the 8 slots for five rounds of 240 tokens (~4 s)
        assert time.monotonic() - gone < 2.0, f"the engine was busy {time.monotonic() - gone:.2f}s after the clients left"
        time.sleep(0.6)
        new_cancelled = engine_metric(served, "llm_requests_cancelled_total") - cancelled
        new_finished = engine_metric(served, "llm_requests_finished_total") - finished
        # each one cancelled, or gone before it reached the engine: none generated to its end
        assert new_finished == 0 and 0 < new_cancelled <= 40, (stream, new_cancelled, new_finished)
        assert completion_seconds(served, 4) < 2 * idle + 0.05, idle


def test_each_answered_request_is_one_observation_of_the_engines_latency_histograms(served: dict[str, str]) -> None:
    """Triton's ``llm_ttft_seconds`` and ``llm_request_itl_seconds`` count one observation per
    answered request (a request's mean inter-token gap, not one per token: each observation is a
    call into Triton's server); a one-token answer has no gap to count."""
    names = ("llm_ttft_seconds_count", "llm_request_itl_seconds_count")
    time.sleep(0.6)  # what ran before, published (every 0.5 s)
    before = [engine_metric(served, name) for name in names]
    for max_tokens in (4, 4, 4, 1):
        status, _, _ = post(f"{served['ROUTER_URL']}/v1/completions",
                            {"prompt": "Return the", "max_tokens": max_tokens, "ignore_eos": True})
        assert status == 200
    time.sleep(0.6)
    assert [engine_metric(served, name) - seen for name, seen in zip(names, before, strict=True)] == [4, 3]


def front_get(env: dict[str, str], path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{env['OPENAI_API_URL']}{path}", timeout=30) as resp:
        loaded: dict[str, Any] = json.loads(resp.read())
        return loaded


def flush_capture(env: dict[str, str]) -> dict[str, Any]:
    status, stats, _ = post(f"{env['OPENAI_API_URL']}/capture/flush", b"{}")
    assert status == 200
    return stats


def captured_since(env: dict[str, str], since: str) -> list[dict[str, Any]]:
    """The capture's records written at or after ``since`` (an ISO time), oldest first."""
    import datetime as dt

    from tasks.lib import storage
    from tasks.lib.params import load_settings

    uri = load_settings().serve.capture.uri
    day = storage.join(uri, f"date={dt.datetime.now(dt.UTC).date().isoformat()}")
    records = [json.loads(line) for part in storage.list_files(day) if part.endswith(".jsonl")
               for line in storage.read_bytes(part).decode().splitlines()]
    return sorted((r for r in records if r["time"] >= since), key=lambda r: r["time"])


def now_iso() -> str:
    import datetime as dt

    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


def test_clients_cannot_set_the_routers_headers(served: dict[str, str]) -> None:
    """A client's own X-Shadow-Pair / -Record / -Copy, X-Route-Version, X-Serving-Track and
    X-Client-Address reach nothing: the answer is the split's, no shadow record is kept under
    its id, and the capture's client is the address the router saw. A header byte that is not
    UTF-8, straight to the front, neither fails the request nor the capture's batch."""
    from tasks.serving.router import NginxRouter

    flush_capture(served)
    since = now_iso()
    pair = hashlib.md5(b"mine").hexdigest()
    forged = {"X-Shadow-Pair": pair, "X-Shadow-Record": "1", "X-Route-Version": "999", "X-Serving-Track": "canary",
              "X-Client-Address": "203.0.113.7", "X-Shadow-Copy": "1"}
    router = NginxRouter(Path(served["ROUTER_DIR"]), served["ROUTER_URL"], served["ROUTER_INTERNAL_URL"])
    version = int(served["VERSION"])
    router.apply(version, shadow=version)  # while a shadow runs: the router mirrors and marks deploy's requests
    try:
        for spoofed in ("203.0.113.7", "203.0.113.8"):
            status, answer, headers = post(f"{served['ROUTER_URL']}/v1/completions",
                                           {"prompt": "Return the", "max_tokens": 2},
                                           headers={**forged, "X-Client-Address": spoofed})
            assert status == 200 and answer["object"] == "text_completion", (status, answer)
            assert headers["X-Model-Version"] == served["VERSION"]
        time.sleep(1)  # the mirrored copies generated in the background
    finally:
        router.apply(version)
    status, answer = raw_request(served["ROUTER_URL"], "/v1/completions", completion_body(served, 100),
                                 source="127.0.0.23")
    assert status == 200
    status, records, _ = post(f"{served['OPENAI_API_URL']}/shadow/records", {"ids": [pair]})
    assert status == 200 and records == {"records": []}  # neither the request nor its copy
    # straight to the front (as a cluster's HTTPRoute once passed it): a byte that is not UTF-8 in
    # the version header of a request the engine refuses (its record once took the header's value,
    # could not be encoded and lost the whole batch), between two good ones
    bad_byte = {"X-Route-Version": b"\xff\xfe7"}
    for prompt in ("Return", "word " * 2000, "Return"):
        status, answer = raw_request(served["OPENAI_API_URL"], "/v1/completions",
                                     json.dumps({"prompt": prompt, "max_tokens": 2}).encode(), headers=bad_byte)
        assert status == (400 if len(prompt) > 10 else 200), answer
    stats = flush_capture(served)
    assert stats["dropped_bad"] == 0 and stats["dropped_write"] == 0, stats
    records = captured_since(served, since)
    clients = [r["client"] for r in records]
    assert len(clients) == 6 and clients[0] == clients[1] != clients[2], clients  # 127.0.0.1 twice, then .23
    assert [r["status"] for r in records[3:]] == [200, 400, 200] and all(r["version"].isdigit() or r["version"] == ""
                                                                         for r in records)


def test_huge_prompts_are_refused_by_size_before_they_are_tokenized(served: dict[str, str]) -> None:
    """Triton's own generate path (deploy's listener of the router, and Triton straight): a prompt
    that cannot fit is refused by its byte count (16 MB bodies reached the tokenizer before);
    the public listener has no text path of Triton's (an abandoned non-streamed request there
    would run on: text goes through /v1) and refuses a body over its limit."""
    prompt = "word " * 180_000  # 900 kB: under the router's limit, far over what the context holds
    for url in (served["ROUTER_INTERNAL_URL"], served["TRITON_URL"]):
        status, answer, _ = post(f"{url}/v2/models/llm_generate/generate", {"text_input": prompt, "max_tokens": 2})
        assert status == 400 and "cannot fit the model's context" in str(answer["error"]), answer
    status, answer, _ = post(f"{served['TRITON_URL']}/v2/models/llm_generate/generate",
                             {"text_input": "x" * (16 << 20), "max_tokens": 2})
    assert status == 400 and "cannot fit the model's context" in str(answer["error"]), answer
    for path in ("generate", "generate_stream"):
        status, answer, _ = post(f"{served['ROUTER_URL']}/v2/models/llm_generate/{path}", {"text_input": "Return"})
        assert status == 404 and "not served by this router" in str(answer), (path, status, answer)
    status, answer, _ = post(f"{served['ROUTER_URL']}/v1/completions", {"prompt": "x" * (2 << 20)})
    assert status == 413 and is_openai_error(answer), (status, answer)


def test_a_triton_client_through_the_router_sees_the_routed_version_ready(served: dict[str, str]) -> None:
    """tritonclient against the router's public URL, as a Triton user points it: the server live
    and ready, each served model ready and described, and an inference answered, each by the
    version the split routes to; a version's own readiness path stays closed to clients (it
    said 404 for ``is_model_ready`` before the router passed a model's ``ready``)."""
    import numpy as np
    import tritonclient.http as triton_http

    router = urllib.parse.urlsplit(served["ROUTER_URL"])
    client = triton_http.InferenceServerClient(router.netloc)
    assert client.is_server_live() and client.is_server_ready()
    for model in ("llm", "llm_generate"):
        assert client.is_model_ready(model), model
        assert client.get_model_metadata(model)["name"] == model
        with urllib.request.urlopen(f"{served['ROUTER_URL']}/v2/models/{model}/ready", timeout=10) as resp:
            assert resp.headers["X-Model-Version"] == served["VERSION"], model
    ids = triton_http.InferInput("input_ids", [1, 4], "INT64")
    ids.set_data_from_numpy(np.ones((1, 4), dtype=np.int64))
    answer = client.infer("llm", [ids])
    assert answer.get_response()["model_version"] == served["VERSION"]
    for path, method, status in ((f"/v2/models/llm/versions/{served['VERSION']}/ready", "GET", 404),
                                 ("/v2/models/llm/ready", "POST", 403)):
        request = urllib.request.Request(served["ROUTER_URL"] + path, method=method)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == status, (path, method, refused.value.code)


def test_a_refused_request_is_captured_as_its_refusal_alone(served: dict[str, str]) -> None:
    """Six 150 kB prompts of e-mail-like text (refused: they cannot fit): their records hold the
    refusal, not the prompt (whose scrub once held the front for seconds: benchmarks/capture.py
    measures /health while such prompts are captured)."""
    flush_capture(served)
    since = now_iso()
    prompt = ("jane.doe" * 40 + "@example.org " + "x" * 60 + "@ ") * 1000
    with ThreadPoolExecutor(max_workers=6) as pool:
        answers = list(pool.map(lambda _: post(f"{served['ROUTER_URL']}/v1/completions", {"prompt": prompt[:150_000]}),
                                range(6)))
    assert all(status == 400 for status, _, _ in answers), answers
    stats = flush_capture(served)
    assert stats["dropped_bad"] == 0, stats
    refused = [r for r in captured_since(served, since) if r["status"] == 400]
    assert len(refused) == 6 and all(r["prompt"] == "" and "cannot fit" in r["error"] for r in refused), refused


def test_the_front_serves_its_openapi_document(served: dict[str, str]) -> None:
    document = front_get(served, "/openapi.json")
    assert document["openapi"].startswith("3.1") and {"/v1/completions", "/v1/chat/completions"} <= set(document["paths"])


# -- fuzzing: requests generated from the front's own OpenAPI document --------------------------

FUZZ_EXAMPLES = 60  # per operation and mode (positive: valid by the schema; negative: invalid)
FUZZ_TIMEOUT_S = 30.0  # an answer slower than this is a hang


def test_generated_requests_get_no_5xx_and_no_hang(served: dict[str, str], request: pytest.FixtureRequest) -> None:
    """schemathesis generates requests from the front's OpenAPI document (valid ones and invalid
    ones) for each operation, sent straight to the front (the router would limit one client's
    rate): each answered within FUZZ_TIMEOUT_S, none with a 5xx, each answer as documented
    (status, content type, schema). How many were tried, and their statuses, are printed."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import CHECKS

    schema = schemathesis.openapi.from_url(f"{served['OPENAI_API_URL']}/openapi.json")
    checks = CHECKS.get_by_names(["not_a_server_error", "status_code_conformance", "content_type_conformance",
                                  "response_schema_conformance"])
    statuses: Counter[int] = Counter()
    for operation in (result.ok() for result in schema.get_all_operations()):
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET":
                continue  # no input to get wrong
            @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def send(case: Any) -> None:
                response = case.call(timeout=FUZZ_TIMEOUT_S)
                statuses[response.status_code] += 1
                case.validate_response(response, checks=checks)

            send()
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    summary = f"fuzz: {sum(statuses.values())} generated requests to the front, statuses {dict(sorted(statuses.items()))}"
    if reporter is not None:
        reporter.write_line(summary)
    assert sum(statuses.values()) >= FUZZ_EXAMPLES and not any(status >= 500 for status in statuses), summary
