"""The OpenAI-compatible API in front of Triton: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``. A thin translator, no second engine: each request becomes one call of Triton's
generate extension on the engine model (``generate_stream`` for ``stream: true``, SSE relayed
chunk by chunk as tokens are produced; ``generate`` otherwise).

    python -m tasks.serving.front --port 8003 --triton-url http://127.0.0.1:8000

Which version answers is decided in front of this server, exactly as for Triton's own paths: the
local nginx router picks the version by its canary split and passes it in ``X-Route-Version``
(this server then calls ``/v2/models/<m>/versions/<v>/...``) and adds ``X-Model-Version`` to the
answer; in a cluster each track's pod runs this server beside a Triton serving one version, and
the HTTPRoute splits between tracks. Without the header the unversioned path is called.

Chat: the model is not chat-tuned, so messages are joined by a plain documented template
(:func:`chat_prompt`): one ``Role: content`` line per message, then ``Assistant:``; the answer
stops at the next ``\\nUser:`` line.

Shadow records: while deploy shadows stable with a new version, the router mirrors each ``/v1``
request (the copy marked ``X-Shadow-Copy``: answered 202 at once, generated in the background),
and marks deploy's own requests and their copies for the record (``X-Shadow-Record``, one
``X-Shadow-Pair`` id for both; in a cluster the HTTPRoute's filters do). This server then keeps
what each marked request answered (version, status, time to first token, inter-token gaps, the text
chunks) in a bounded in-memory table (:class:`ShadowRecords`), which deploy reads by request id
(``POST /shadow/records``, not routed by the router: only deploy reaches it) to pair stable's
answer with the shadow's. Unmarked requests are not recorded.

Capture: a sample (``serve.capture.rate``) of the requests this server answered, with their
answers, the version that answered, latency and token counts, e-mail addresses scrubbed, goes to
``serve.capture.uri`` by date (:mod:`tasks.serving.capture`: a bounded buffer written in the
background, never in a request's way); ``POST /capture/flush`` writes it at once and ``GET
/capture/stats`` counts what was kept, written and dropped (neither is routed by the router).
Shadow copies are not captured (the user's own request is).

Errors follow OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``): a bad
request (malformed JSON, invalid UTF-8, an unknown model, out-of-range values, a prompt that does
not fit the context: the engine's own one-line reason) is a 400 (404 for an unknown model); a
full engine queue is a 429; an unreachable or failing server a 502/503.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any, NoReturn

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web

# the router's split choice and shadow marks (a client's own headers are overwritten there)
from tasks.serving.capture import TrafficCapture, served_record
from tasks.serving.contract import COPY_HEADER, PAIR_HEADER, RECORD_HEADER, ROUTE_HEADER

log = logging.getLogger("openai_api")
MAX_BODY = 1 << 20
CHAT_ROLES = ("system", "user", "assistant")
CHAT_STOP = "\nUser:"
MAX_STOPS = 4  # OpenAI's limit; chat adds CHAT_STOP to them (the engine takes 5)
SAMPLING = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int}
MAX_COPIES = 64  # a shadow's copies generating at once; more are dropped
DROPPED = "dropped"  # a recorded copy's error when it was never generated
UNSUPPORTED = {"n": 1, "best_of": 1, "logprobs": None, "echo": False, "suffix": None, "tools": None,
               "functions": None, "top_logprobs": None}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


def message_text(message: Any) -> str | None:
    """A chat message's text: its content, or its content parts when all are text; else None."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list):  # content parts: text only
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        content = "".join(t for t in texts if isinstance(t, str)) if len(texts) == len(content) else None
    return content if isinstance(content, str) else None


def chat_prompt(messages: Any) -> str:
    """``System: ...\\nUser: ...\\nAssistant: ...\\n`` for each message, then ``Assistant:``."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: expected a non-empty list of {role, content}", "messages")
    lines = []
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        content = message_text(message)
        if role not in CHAT_ROLES or not isinstance(content, str):
            raise ApiError(400, f"messages[{index}]: expected role one of {', '.join(CHAT_ROLES)} and text content",
                           "messages")
        lines.append(f"{role.capitalize()}: {content}\n")
    return "".join(lines) + "Assistant:"


def engine_inputs(body: dict[str, Any], prompt: str, extra_stop: list[str]) -> dict[str, Any]:
    """The generate-extension body for the engine (names of ``llm_generate``'s inputs)."""
    for name, default in UNSUPPORTED.items():
        if body.get(name) not in (None, default):
            raise ApiError(400, f"{name}: not supported by this server (only {name}={default!r})", name)
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "prompt is not valid UTF-8 (a lone surrogate)", "prompt") from None
    inputs: dict[str, Any] = {"text_input": prompt}
    for name, kind in SAMPLING.items():
        value = body.get("max_completion_tokens" if name == "max_tokens" and body.get("max_tokens") is None else name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and int(value) != value):
            raise ApiError(400, f"{name} {value!r}: expected a number{' (integer)' if kind is int else ''}", name)
        inputs[name] = kind(value)
    ignore_eos = body.get("ignore_eos")  # vLLM's extension, sent by benchmark clients (aiperf)
    if ignore_eos is not None:
        if not isinstance(ignore_eos, bool):
            raise ApiError(400, f"ignore_eos {ignore_eos!r}: expected true or false", "ignore_eos")
        inputs["ignore_eos"] = ignore_eos
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop: expected a string or a list of at most {MAX_STOPS} strings", "stop")
    if stops or extra_stop:
        inputs["stop"] = json.dumps([*stops, *extra_stop])
    return inputs


class ShadowRecords:
    """The answers of marked requests, by (request id, version): at most ``capacity``, the
    oldest dropped first (memory stays bounded however long a shadow runs)."""

    def __init__(self, capacity: int = 8192) -> None:
        self.capacity = capacity
        self.table: OrderedDict[tuple[str, str], dict[str, Any]] = OrderedDict()

    def add(self, request_id: str, version: str, record: dict[str, Any]) -> None:
        self.table[request_id, version] = {"request_id": request_id, "version": version, **record}
        while len(self.table) > self.capacity:
            self.table.popitem(last=False)

    def of(self, request_ids: list[str]) -> list[dict[str, Any]]:
        wanted = set(request_ids)
        return [record for (request_id, _), record in self.table.items() if request_id in wanted]


class Api:
    """The aiohttp application's state: one upstream connection pool, the served names, the
    shadow records."""

    def __init__(self, triton_url: str, model: str, served_name: str, timeout_s: float,
                 capture: TrafficCapture | None = None) -> None:
        self.triton_url, self.model, self.served_name = triton_url.rstrip("/"), model, served_name
        self.timeout = ClientTimeout(total=timeout_s, sock_connect=10)
        self.session: ClientSession | None = None
        self.records = ShadowRecords()
        self.copies: set[asyncio.Task[None]] = set()
        self.capture = capture
        self.capture_writer: asyncio.Task[None] | None = None

    async def start(self, app: web.Application) -> None:
        self.session = ClientSession(connector=TCPConnector(limit=512), timeout=self.timeout)
        if self.capture is not None and self.capture.enabled:
            self.capture_writer = asyncio.create_task(self.capture.run())

    async def close(self, app: web.Application) -> None:
        for copy in self.copies:
            copy.cancel()
        if self.capture_writer is not None:  # its last flush writes what is pending
            self.capture_writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.capture_writer
        if self.session is not None:
            await self.session.close()

    def upstream(self, request: web.Request, stream: bool) -> str:
        version = request.headers.get(ROUTE_HEADER, "")
        versioned = f"/versions/{version}" if version.isdigit() else ""
        return f"{self.triton_url}/v2/models/{self.model}{versioned}/{'generate_stream' if stream else 'generate'}"

    async def body(self, request: web.Request, raw: bytes | None = None) -> dict[str, Any]:
        raw = raw if raw is not None else await request.content.read(MAX_BODY + 1)
        if len(raw) > MAX_BODY:
            raise ApiError(413, f"request body larger than {MAX_BODY} bytes")
        try:
            body = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ApiError(400, f"request body is not valid UTF-8 (byte {exc.start})") from None
        except json.JSONDecodeError as exc:
            raise ApiError(400, f"request body is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body: expected a JSON object")
        model = body.get("model")
        if model not in (None, self.served_name):
            raise ApiError(404, f"model {model!r} does not exist (this server serves {self.served_name!r})", "model",
                           code="model_not_found")
        return body

    # -- endpoints ------------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.served_name, "object": "model", "created": 0, "owned_by": "llm-pipeline"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.answer(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.answer(request, chat=True)

    async def shadow_records(self, request: web.Request) -> web.Response:
        """``{"ids": [...]}`` -> ``{"records": [...]}``: the recorded answers to those requests."""
        try:
            ids = (await request.json()).get("ids")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            ids = None
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise ApiError(400, 'expected a JSON object {"ids": [request ids]}', "ids")
        return web.json_response({"records": self.records.of(ids)})

    async def answer(self, request: web.Request, chat: bool) -> web.StreamResponse:
        pair = request.headers.get(PAIR_HEADER, "")
        request_id = pair if request.headers.get(RECORD_HEADER) and pair else ""
        if request.headers.get(COPY_HEADER):
            return await self.start_copy(request, chat, request_id)
        holder: list[Reply] = []
        response: web.StreamResponse | None = None
        try:
            response = await self.reply(request, chat, holder)
            return response
        finally:  # whatever the outcome, also a client gone
            reply = holder[0] if holder else None
            if request_id:
                self.records.add(request_id, request.headers.get(ROUTE_HEADER, ""), record_of(reply, response))
            if reply is not None and self.capture is not None and self.capture.take():
                self.capture_reply(request, reply, response)

    def capture_reply(self, request: web.Request, reply: Reply, response: web.StreamResponse | None) -> None:
        """Hand the answered request to the capture (the sample took it: :meth:`TrafficCapture.take`)."""
        try:
            assert self.capture is not None
            arrivals = reply.arrivals
            self.capture.offer(served_record(
                endpoint="chat" if reply.chat else "completions",
                version=reply.version or request.headers.get(ROUTE_HEADER, ""),
                prompt=reply.prompt, completion="".join(reply.text), prompt_tokens=reply.prompt_tokens,
                completion_tokens=reply.completion_tokens, status=response.status if response is not None else 499,
                latency_ms=(time.perf_counter() - reply.started) * 1000,
                ttft_ms=(arrivals[0] - reply.started) * 1000 if arrivals else None,
                stream=reply.stream, error=reply.error))
        except Exception:  # a capture that breaks must never break the answer
            log.exception("capture: a record could not be made")

    async def capture_flush(self, request: web.Request) -> web.Response:
        """Write what the capture holds now (deploy, tests, a drift check that wants the latest); its counts."""
        if self.capture is None:
            return web.json_response({"enabled": False})
        return web.json_response({"enabled": self.capture.enabled, **await self.capture.flush()})

    async def capture_stats(self, request: web.Request) -> web.Response:
        if self.capture is None:
            return web.json_response({"enabled": False})
        return web.json_response({"enabled": self.capture.enabled, "pending": len(self.capture.pending),
                                  **self.capture.stats})

    async def start_copy(self, request: web.Request, chat: bool, request_id: str) -> web.Response:
        """A shadow's copy: answered 202 at once (the router drops the copy's answer anyway, and
        a mirror subrequest held open would hold the user's connection), generated in the
        background to its end, recorded when ``request_id`` names it. At most ``MAX_COPIES`` at
        once: a slow shadow's backlog is dropped (recorded as dropped: the shadow's judge reads
        that as inconclusive, not as the shadow's error), never queued."""
        version = request.headers.get(ROUTE_HEADER, "")
        raw = await request.content.read(MAX_BODY + 1)
        if len(self.copies) >= MAX_COPIES:
            if request_id:
                self.records.add(request_id, version, record_of(None, None, f"{DROPPED}: {MAX_COPIES} copies in flight"))
            return web.Response(status=503)

        async def run() -> None:
            holder: list[Reply] = []
            response: web.StreamResponse | None = None
            try:
                response = await self.reply(request, chat, holder, raw, Discard())
            finally:
                if request_id:
                    self.records.add(request_id, version, record_of(holder[0] if holder else None, response))

        task = asyncio.create_task(run())
        self.copies.add(task)
        task.add_done_callback(self.copies.discard)
        return web.Response(status=202)

    async def reply(self, request: web.Request, chat: bool, holder: list[Reply] | None = None,
                    raw: bytes | None = None, sink: Discard | None = None) -> web.StreamResponse:
        """The answer to one request (``holder``: gets its :class:`Reply`; ``raw``: its body,
        already read; ``sink``: where a stream goes instead of the client)."""
        try:
            body = await self.body(request, raw)
            if chat:
                inputs = engine_inputs(body, chat_prompt(body.get("messages")), [CHAT_STOP])
                # what the user asked, without the chat template's framing (the drift check reads it)
                asked = "\n".join(message_text(m) or "" for m in body["messages"] if m.get("role") == "user")
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, list) and len(prompt) == 1:
                    prompt = prompt[0]
                if not isinstance(prompt, str):
                    raise ApiError(400, "prompt: expected a string (token-id prompts and batches are not supported)",
                                   "prompt")
                inputs = engine_inputs(body, prompt, [])
                asked = prompt
            stream = bool(body.get("stream"))
            reply = Reply(chat, self.served_name)
            reply.prompt, reply.stream = asked, stream
            usage_chunk = stream and bool((body.get("stream_options") or {}).get("include_usage"))
            if holder is not None:
                holder.append(reply)
            if stream:
                return await self.relay_stream(request, inputs, reply, usage_chunk, sink)
            return await self.complete(request, inputs, reply)
        except ApiError as exc:
            if holder is not None and holder:
                holder[0].error = exc.message
            return exc.response()

    async def complete(self, request: web.Request, inputs: dict[str, Any], reply: Reply) -> web.Response:
        assert self.session is not None
        try:
            async with self.session.post(self.upstream(request, False), json=inputs) as upstream:
                data = await upstream.json(content_type=None)
                if upstream.status != 200 or "error" in data:
                    raise upstream_error(upstream.status, data)
        except (TimeoutError, ClientError) as exc:
            raise_unreachable(exc)
        reply.add(data)
        reply.arrivals.append(time.perf_counter())
        reply.complete = True
        return web.json_response(reply.whole())

    async def relay_stream(self, request: web.Request, inputs: dict[str, Any], reply: Reply,
                           usage_chunk: bool, sink: Discard | None = None) -> web.StreamResponse:
        assert self.session is not None
        inputs = {**inputs, "stream": True}
        response: web.StreamResponse | None = None
        try:
            async with self.session.post(self.upstream(request, True), json=inputs) as upstream:
                events = sse_events(upstream)
                first = await anext(events, None)  # an error before any token is an HTTP status, not a stream
                if first is None or upstream.status != 200 or "error" in first:
                    raise upstream_error(upstream.status, first or {"error": "the engine ended the stream with no answer"})
                response = sink or web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                               "Cache-Control": "no-cache"})
                await response.prepare(request)
                event: dict[str, Any] | None = first
                while event is not None:
                    if "error" in event:
                        reply.error = str(event["error"])
                        await send_event(response, ApiError(500, reply.error, kind="server_error").body())
                        break
                    await send_event(response, reply.chunk(event))
                    event = await anext(events, None)
                else:
                    if usage_chunk:
                        await send_event(response, reply.usage_chunk())
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
                reply.complete = not reply.error
                return response
        except (TimeoutError, ClientError) as exc:
            if response is None:
                raise_unreachable(exc)
            log.warning("stream cut: %s", exc)  # the client saw tokens; the cut shows as a missing [DONE]
            reply.error = f"stream cut ({type(exc).__name__})"
            return response
        except (ConnectionResetError, asyncio.CancelledError):
            # the client went away: closing the upstream call ends the request in Triton, which
            # frees its slot in the engine
            log.info("client disconnected mid-stream")
            raise


class Reply:
    """Engine responses turned into OpenAI objects (completion or chat, whole or chunks)."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat, self.model = chat, model
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.prompt_tokens = self.completion_tokens = 0
        self.sent_role = False
        # for the shadow records: when it started, when each chunk of text left, what went wrong
        self.started = time.perf_counter()
        self.arrivals: list[float] = []
        self.error = ""
        self.complete = False
        # for the capture: what was asked, how, and which version answered (the engine says)
        self.prompt, self.stream, self.version = "", False, ""

    def add(self, event: dict[str, Any]) -> str:
        delta = str(event.get("text_output", ""))
        self.text.append(delta)
        self.finish_reason = str(event.get("finish_reason") or "") or None
        self.prompt_tokens = int(event.get("prompt_tokens", self.prompt_tokens))
        self.completion_tokens = int(event.get("completion_tokens", self.completion_tokens))
        self.version = str(event.get("model_version") or self.version)
        return delta

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self) -> dict[str, Any]:
        text = "".join(self.text)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": self.finish_reason,
                      "logprobs": None}
            return {**self.head("chat.completion"), "choices": [choice], "usage": self.usage()}
        choice = {"index": 0, "text": text, "finish_reason": self.finish_reason, "logprobs": None}
        return {**self.head("text_completion"), "choices": [choice], "usage": self.usage()}

    def chunk(self, event: dict[str, Any]) -> dict[str, Any]:
        delta = self.add(event)
        if delta:
            self.arrivals.append(time.perf_counter())
        if self.chat:
            content: dict[str, Any] = {"content": delta}
            if not self.sent_role:
                content["role"], self.sent_role = "assistant", True
            choice = {"index": 0, "delta": content, "finish_reason": self.finish_reason, "logprobs": None}
            return {**self.head("chat.completion.chunk"), "choices": [choice]}
        return {**self.head("text_completion"),
                "choices": [{"index": 0, "text": delta, "finish_reason": self.finish_reason, "logprobs": None}]}

    def usage_chunk(self) -> dict[str, Any]:
        return {**self.head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": self.usage()}


class Discard(web.StreamResponse):
    """Where a shadow's copy streams to: nowhere (its timings and text are recorded)."""

    async def prepare(self, request: web.BaseRequest) -> None:  # type: ignore[override]
        return None

    async def write(self, data: Any) -> None:
        return None

    async def write_eof(self, data: bytes = b"") -> None:
        return None


def record_of(reply: Reply | None, response: web.StreamResponse | None, error: str = "") -> dict[str, Any]:
    """One answer as the shadow comparison reads it: ok (a 200 that ended whole), the time to
    its first text chunk and the mean gap between chunks (ms, from this server's receipt of the
    request: the same hop for both answers of a pair), the chunks themselves."""
    status = response.status if response is not None else 0
    if reply is None:
        return {"ok": False, "status": status, "ttft_ms": math.nan, "itl_ms": math.nan, "chunks": [],
                "error": error or "refused before generation"}
    arrivals = reply.arrivals
    ttft = (arrivals[0] - reply.started) * 1000 if arrivals else math.nan
    itl = (arrivals[-1] - arrivals[0]) * 1000 / (len(arrivals) - 1) if len(arrivals) > 1 else math.nan
    return {"ok": status == 200 and reply.complete, "status": status, "ttft_ms": ttft, "itl_ms": itl,
            "chunks": [chunk for chunk in reply.text if chunk],
            "error": reply.error or ("" if reply.complete else "not completed")}


async def sse_events(upstream: Any) -> AsyncIterator[dict[str, Any]]:
    """The ``data:`` events of an SSE (or one JSON body, when Triton answered with an error)."""
    if not upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
        yield await upstream.json(content_type=None)
        return
    async for line in upstream.content:
        if line.startswith(b"data:"):
            yield json.loads(line[5:])


async def send_event(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")


def upstream_error(status: int, data: dict[str, Any]) -> ApiError:
    """Triton's error as the client's: its 400s are the engine's one-line reasons; an overloaded
    engine (UNAVAILABLE, HTTP 503) is a 429."""
    message = str(data.get("error", f"upstream status {status}"))
    if "overloaded" in message:
        return ApiError(429, message, kind="rate_limit_error", code="overloaded")
    if status == 400:
        return ApiError(400, message)
    if status == 404:
        return ApiError(503, f"no model version serves this request ({message})", kind="server_error")
    return ApiError(502 if status < 500 else status, message, kind="server_error")


def raise_unreachable(exc: BaseException) -> NoReturn:
    raise ApiError(502, f"the inference server did not answer ({type(exc).__name__}: {exc})", kind="server_error")


@web.middleware
async def errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except ApiError as exc:
        return exc.response()


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def app(triton_url: str, model: str, served_name: str, timeout_s: float,
        capture: TrafficCapture | None = None) -> web.Application:
    api = Api(triton_url, model, served_name, timeout_s, capture)
    application = web.Application(middlewares=[errors], client_max_size=MAX_BODY)
    application.on_startup.append(api.start)
    application.on_cleanup.append(api.close)
    application.router.add_get("/v1/models", api.models)
    application.router.add_post("/v1/completions", api.completions)
    application.router.add_post("/v1/chat/completions", api.chat_completions)
    application.router.add_get("/health", health)
    application.router.add_post("/shadow/records", api.shadow_records)
    application.router.add_post("/capture/flush", api.capture_flush)
    application.router.add_get("/capture/stats", api.capture_stats)
    return application


def main() -> None:
    from tasks.lib.params import load_settings

    settings = load_settings()
    serve = settings.serve
    parser = argparse.ArgumentParser(prog="python -m tasks.serving.front", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--triton-url", required=True, help="Triton's HTTP endpoint (its generate extension)")
    parser.add_argument("--capture-rate", type=float, default=serve.capture.rate,
                        help="share of answered requests captured (default: serve.capture.rate)")
    parser.add_argument("--capture-uri", default=serve.capture.uri, help="where (default: serve.capture.uri)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    timeout = serve.generate.request_timeout_s + 30
    if not 0 <= args.capture_rate <= 1:
        parser.error(f"--capture-rate {args.capture_rate}: expected a share in [0, 1]")
    capture = TrafficCapture(dataclasses.replace(serve.capture, rate=args.capture_rate, uri=args.capture_uri))
    if capture.enabled:
        log.info("capturing %.0f%% of answered requests to %s", 100 * args.capture_rate, args.capture_uri)
    web.run_app(app(args.triton_url, serve.generate_model, settings.pipeline.model_name, timeout, capture),
                host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
