"""The OpenAI-compatible API in front of Triton: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models`` (and ``/openapi.json``, their OpenAPI document). A thin translator, no second
engine: each request becomes one call of Triton's generate extension on the engine model
(``generate_stream``: SSE relayed chunk by chunk for ``stream: true``, gathered into one answer
otherwise).

    python -m tasks.serving.front --port 8003 --triton-url http://127.0.0.1:8000

Requests: the body is read whole, bounded by :data:`~tasks.serving.contract.MAX_BODY_BYTES`
(413 beyond), whether it arrives at once, in pieces or chunked; :mod:`tasks.serving.protocol`
validates it (one path for completions, chat and a shadow's copy). A client that goes away
cancels its request, streamed or not: the handler is cancelled (aiohttp's
``handler_cancellation``), which closes the upstream stream, and Triton, failing to write the
next token, cancels the request in the engine, freeing its slot.

One API serves every model line: a request's ``model`` (a line's registered model name; none:
params.yaml's line) picks the line, and with it the engine model in Triton; another name is a 404
in OpenAI's shape, and ``/v1/models`` lists every line with its stable version. Which version of
the line answers is decided in front of this server, exactly as for Triton's own paths: the local
nginx router splits each line by its own canary weights and passes every line's pick in
``X-Route-Version`` (:data:`~tasks.serving.contract.ROUTE_HEADER`); this server calls
``/v2/models/<line's engine>/versions/<v>/...``, answers ``X-Model-Version``, and answers a 503
(``no_version``) for a line the router routes nowhere yet. In a cluster each track's pod runs
this server beside a Triton serving one version, and the HTTPRoute splits between tracks (the
header then names one version). Without the header the unversioned path is called. Every
header of :data:`~tasks.serving.contract.INTERNAL_HEADERS` is set by the router or gateway only
(a client's own is removed at the public entry).

Shadow records: while deploy shadows stable with a new version, the router mirrors each ``/v1``
request (the copy marked ``X-Shadow-Copy``: answered 202 at once, generated in the background).
Deploy's own requests carry an ``X-Shadow-Pair`` id, and the router's internal listener marks them
and their copies for the record (``X-Shadow-Record``; in a cluster the HTTPRoute's filters do).
This server then keeps what each marked request answered (version, status, time to first token,
inter-token gaps, the engine's own per-token times, the text chunks) in a bounded in-memory
table (:class:`ShadowRecords`), which deploy reads by request id (``POST /shadow/records``, not
routed by the router: only deploy reaches it): in the shadow stage to pair stable's answer with
the shadow's, at the traffic steps for each version's engine timings. Unmarked requests (every
public one) are not recorded.

Capture: a sample (``serve.capture.rate``) of the requests this server answered, with their
answers, the version that answered, latency, token counts and the client (its address, hashed),
goes to ``serve.capture.uri`` by date (:mod:`tasks.serving.capture`: a bounded buffer written in
the background, never in a request's way); a refused request is captured as its refusal alone,
never its body. ``POST /capture/flush`` writes it at once and ``GET /capture/stats`` counts what
was kept, written and dropped (neither is routed by the router). Shadow copies are not captured
(the user's own request is).

Errors follow OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``): a bad
request (malformed JSON, invalid UTF-8, an unknown model, out-of-range values, a prompt that does
not fit the context: the engine's own one-line reason) is a 400 (404 for an unknown model or
path, 413 for a body too large); a full engine queue is a 429; an unreachable or failing server
a 502/503. No input a client sends gets a 5xx of this server's own making.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal, NoReturn

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from tasks.lib.errors import first_line
from tasks.serving.capture import CapturedAnswer, CapturedRequest, TrafficCapture, served_record
from tasks.serving.contract import (
    CLIENT_HEADER,
    COPY_HEADER,
    MAX_BODY_BYTES,
    PAIR_HEADER,
    RECORD_HEADER,
    ROUTE_ENTRIES,
    ROUTE_HEADER,
    ROUTE_LINE,
    ROUTE_STABLE,
    VERSION_HEADER,
)
from tasks.serving.protocol import (
    ApiError,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatRequest,
    Completion,
    CompletionChoice,
    Delta,
    ModelCard,
    ModelList,
    Usage,
    openapi,
    parse_request,
)

log = logging.getLogger("front")
MAX_COPIES = 64  # a shadow's copies generating at once; more are dropped
DROPPED = "dropped"  # a recorded copy's error when it was never generated
REDISCOVER_S = 2.0  # the least time between two readings of the model lines (Api.rediscover)
VERSION_KEY = "routed_version"  # request storage: the version answering a request, for its X-Model-Version
CLIENT_KEY_ENV = "CAPTURE_CLIENT_KEY"  # keys the client hash: without it, equal addresses still hash equal


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


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """One model line as the API serves it: the ``model`` clients name (its registered model), its
    route's key in the router's header (``demo``: params.yaml's line) and its engine in Triton."""

    key: str
    name: str
    engine: str

    @classmethod
    def every_line(cls) -> list[ServedModel]:
        """Every model line's, params.yaml's first (the model of a request that names none)."""
        from tasks.config import every_line, line_label

        return [cls(line_label(line), settings.pipeline.model_name, settings.serve.generate_model)
                for line, settings in every_line().items()]


@dataclasses.dataclass(frozen=True)
class RoutedVersions:
    """What the router's :data:`ROUTE_HEADER` says: each line's picked (and stable) version, or one
    version for whichever line a request names (deploy's requests, a cluster track's), or nothing
    (no router in front: Triton's unversioned path)."""

    picked: dict[str, tuple[str, str]]  # line key -> (picked, stable): "" where it serves none
    single: str = ""

    @classmethod
    def of(cls, request: web.Request) -> RoutedVersions:
        value = request.headers.get(ROUTE_HEADER, "")
        if not value.isascii():
            return cls({})
        if ROUTE_LINE not in value:
            return cls({}, value if value.isdigit() else "")
        picked = {}
        for entry in value.split(ROUTE_ENTRIES):
            key, _, versions = entry.partition(ROUTE_LINE)
            version, _, stable = versions.partition(ROUTE_STABLE)
            picked[key] = (version if version.isdigit() else "", stable if stable.isdigit() else "")
        return cls(picked)

    def version(self, model: ServedModel) -> str:
        """The version ``model``'s request goes to; a 503 where the router routes its line nowhere."""
        if not self.picked:
            return self.single
        version = self.picked.get(model.key, ("", ""))[0]
        if not version:
            raise ApiError(503, f"no version of model {model.name!r} is deployed yet", kind="server_error",
                           code="no_version")
        return version

    def stable(self, model: ServedModel) -> str | None:
        return self.picked.get(model.key, ("", ""))[1] or None


def peeked_model(raw: bytes) -> str | None:
    """The ``model`` a body names, where it is a JSON object naming one (validation comes later)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None


def client_id(request: web.Request, key: bytes) -> str:
    """The client, as the capture keeps it: its address, hashed. The local router's
    ``X-Client-Address``; else the last ``X-Forwarded-For`` entry, the one a gateway appends (a
    cluster's: it removes the router's header as a client's, and the front's peer is the gateway);
    else the peer's."""
    forwarded = request.headers.get("X-Forwarded-For", "").rsplit(",", 1)[-1].strip()
    address = request.headers.get(CLIENT_HEADER) or forwarded or request.remote or ""
    if not address:
        return ""
    return hashlib.blake2b(address.encode("utf-8", "replace"), key=key, digest_size=8).hexdigest()


class Api:
    """The aiohttp application's state: one upstream connection pool, the served models (one per
    model line, the first for a request that names none), the shadow records, the capture
    (of the first's traffic: its drift check reads it)."""

    def __init__(self, triton_url: str, models: list[ServedModel], timeout_s: float,
                 capture: TrafficCapture | None = None,
                 discover: Callable[[], list[ServedModel]] | None = None) -> None:
        if not models:
            raise ValueError("an API serving no model")
        self.triton_url = triton_url.rstrip("/")
        self.served_models, self.by_name = models, {model.name: model for model in models}
        # where the served models are found again (the lines' files): a line added to a running
        # stack is served without a restart of this front, its model looked for at most every
        # REDISCOVER_S when a request names an unknown model or the models are listed
        self.discover, self.discovered_at = discover, time.monotonic()
        self.timeout = ClientTimeout(total=timeout_s, sock_connect=10)
        self.session: ClientSession | None = None
        self.records = ShadowRecords()
        self.copies: set[asyncio.Task[None]] = set()
        self.capture = capture
        self.capture_writer: asyncio.Task[None] | None = None
        self.client_key = os.environ.get(CLIENT_KEY_ENV, "").encode()[:64]
        self.openapi = openapi()

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

    def upstream(self, reply: Reply) -> str:
        versioned = f"/versions/{reply.route}" if reply.route else ""
        return f"{self.triton_url}/v2/models/{reply.engine}{versioned}/generate_stream"

    def rediscover(self) -> None:
        """The served models read again (a line file added since), at most every REDISCOVER_S."""
        if self.discover is None or time.monotonic() - self.discovered_at < REDISCOVER_S:
            return
        self.discovered_at = time.monotonic()
        try:
            found = self.discover()
        except Exception as exc:  # a line file being written, or invalid: keep serving what was read
            log.warning("model lines not read again (%s): serving %s", first_line(exc),
                        ", ".join(m.name for m in self.served_models))
            return
        if found and found != self.served_models:
            log.info("serving the models of every line: %s", ", ".join(m.name for m in found))
            self.served_models, self.by_name = found, {model.name: model for model in found}

    def served(self, name: str | None) -> ServedModel:
        """The model line a request's ``model`` names (none: the first); a 404 for any other."""
        if name is None:
            return self.served_models[0]
        if name not in self.by_name:
            self.rediscover()
        if name not in self.by_name:
            raise ApiError(404, f"model {name!r} does not exist (this server serves "
                           f"{', '.join(repr(m.name) for m in self.served_models)})", "model", code="model_not_found")
        return self.by_name[name]

    # -- endpoints ------------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        self.rediscover()
        routed = RoutedVersions.of(request)
        return typed_response(ModelList(data=[ModelCard(id=m.name, version=routed.stable(m)) for m in self.served_models]))

    async def openapi_document(self, request: web.Request) -> web.Response:
        return web.json_response(self.openapi)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.answer(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.answer(request, chat=True)

    async def shadow_records(self, request: web.Request) -> web.Response:
        """``{"ids": [...]}`` -> ``{"records": [...]}``: the recorded answers to those requests."""
        try:
            ids = json.loads(await read_body(request)).get("ids")
        except (ValueError, AttributeError, RecursionError):
            ids = None
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            raise ApiError(400, 'expected a JSON object {"ids": [request ids]}', "ids")
        return web.json_response({"records": self.records.of(ids)})

    async def answer(self, request: web.Request, chat: bool) -> web.StreamResponse:
        pair = request.headers.get(PAIR_HEADER, "")
        request_id = pair if request.headers.get(RECORD_HEADER) and pair else ""
        if request.headers.get(COPY_HEADER):
            return await self.start_copy(request, chat, request_id)
        reply = Reply(chat, self.served_models[0])
        response: web.StreamResponse | None = None
        try:
            response = await self.reply(request, reply)
            return response
        finally:  # whatever the outcome, also a client gone (the handler cancelled)
            if request_id:
                self.records.add(request_id, reply.route, record_of(reply, response))
            if self.capture is not None and reply.line == self.served_models[0] and self.capture.take():
                self.capture_reply(request, reply, response)

    def capture_reply(self, request: web.Request, reply: Reply, response: web.StreamResponse | None) -> None:
        """Hand the request to the capture (the sample took it: :meth:`TrafficCapture.take`); a
        refused one as its refusal alone (no prompt: it may be anything a client sent)."""
        try:
            assert self.capture is not None
            status = response.status if response is not None else 499
            refused = reply.refusal is not None
            arrivals = reply.arrivals
            answered = CapturedAnswer(version=reply.version or reply.route, completion="".join(reply.text),
                                      completion_tokens=reply.completion_tokens, status=status,
                                      latency_ms=(time.perf_counter() - reply.started) * 1000,
                                      ttft_ms=(arrivals[0] - reply.started) * 1000 if arrivals else None,
                                      error=reply.error)
            asked = CapturedRequest(endpoint="chat" if reply.chat else "completions",
                                    prompt="" if refused else reply.prompt, prompt_tokens=reply.prompt_tokens,
                                    stream=reply.stream, client=client_id(request, self.client_key))
            self.capture.offer(served_record(asked, answered))
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
                                  "pending_bytes": self.capture.pending_bytes, **self.capture.stats})

    async def start_copy(self, request: web.Request, chat: bool, request_id: str) -> web.Response:
        """A shadow's copy: answered 202 at once (the router drops the copy's answer anyway, and
        a mirror subrequest held open would hold the user's connection), generated in the
        background to its end, recorded when ``request_id`` names it. At most ``MAX_COPIES`` at
        once: a slow shadow's backlog is dropped (recorded as dropped: the shadow's judge reads
        that as inconclusive, not as the shadow's error), never queued."""
        raw = await read_body(request)  # whole, before the 202: the router has sent all of it by then
        line = self.by_name.get(peeked_model(raw) or "", self.served_models[0])
        try:
            version = RoutedVersions.of(request).version(line)
        except ApiError:
            return web.Response(status=202)  # the request's line has no shadow: nothing to generate
        if len(self.copies) >= MAX_COPIES:
            if request_id:
                self.records.add(request_id, version, record_of(None, None, f"{DROPPED}: {MAX_COPIES} copies in flight"))
            return web.Response(status=503)

        async def run() -> None:
            reply = Reply(chat, line)
            response: web.StreamResponse | None = None
            try:
                response = await self.reply(request, reply, raw, Discard())
            finally:
                if request_id:
                    self.records.add(request_id, version, record_of(reply, response))

        task = asyncio.create_task(run())
        self.copies.add(task)
        task.add_done_callback(self.copies.discard)
        return web.Response(status=202)

    async def reply(self, request: web.Request, reply: Reply, raw: bytes | None = None,
                    sink: Discard | None = None) -> web.StreamResponse:
        """The answer to one request (``raw``: its body, already read; ``sink``: where a stream
        goes instead of the client)."""
        try:
            parsed = parse_request(raw if raw is not None else await read_body(request), reply.chat)
            reply.line = self.served(parsed.model)
            reply.route = RoutedVersions.of(request).version(reply.line)
            if reply.route:
                request[VERSION_KEY] = reply.route
            if isinstance(parsed, ChatRequest):
                inputs = parsed.chat_inputs()
                reply.prompt = parsed.asked()
            else:
                inputs = parsed.engine_inputs(parsed.text, [])
                reply.prompt = parsed.text
            reply.stream = parsed.stream
            if parsed.stream:
                return await self.relay_stream(request, inputs, reply, parsed.usage_chunk, sink)
            return await self.complete(inputs, reply)
        except ApiError as exc:
            reply.refuse(exc)
            return error_response(exc)

    async def complete(self, inputs: dict[str, Any], reply: Reply) -> web.Response:
        """A whole answer, gathered from the engine's stream all the same: Triton notices a
        client gone only when it writes to it, so a request whose engine sends one final event
        (or Triton's non-streaming ``generate``) would generate on to its end, holding its slot,
        after its client left; here the front's handler is cancelled, its upstream stream
        closed, and Triton's next write cancels the request in the engine."""
        assert self.session is not None
        try:
            async with self.session.post(self.upstream(reply), json={**inputs, "stream": True}) as upstream:
                async for event in upstream_events(upstream):
                    if reply.add(event):
                        reply.arrivals.append(time.perf_counter())
        except (TimeoutError, ClientError) as exc:
            raise_unreachable(exc)
        if reply.finish_reason is None:  # the engine ended it without a final event (unloaded, stopping)
            raise ApiError(503, "the engine ended the request before its answer was complete", kind="server_error")
        reply.complete = True
        return typed_response(reply.whole())

    async def relay_stream(self, request: web.Request, inputs: dict[str, Any], reply: Reply,
                           usage_chunk: bool, sink: Discard | None = None) -> web.StreamResponse:
        assert self.session is not None
        response: web.StreamResponse | None = None
        try:
            async with self.session.post(self.upstream(reply), json={**inputs, "stream": True}) as upstream:
                events = upstream_events(upstream)
                first = await anext(events)  # an error before any token is an HTTP status, not a stream
                response = sink or web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                               "Cache-Control": "no-cache"})
                await response.prepare(request)
                event: dict[str, Any] | None = first
                try:
                    while event is not None:
                        await send_event(response, reply.chunk(event).model_dump_json(exclude_none=False))
                        event = await anext(events, None)
                    if reply.finish_reason is None:  # ended without its final event (unloaded, stopping)
                        raise ApiError(503, "the engine ended the request before its answer was complete",
                                       kind="server_error")
                except ApiError as exc:  # the engine failed mid-stream: the client saw tokens already
                    reply.error = exc.message
                    await send_event(response, exc.body().model_dump_json())
                else:
                    if usage_chunk:
                        await send_event(response, reply.usage_chunk().model_dump_json())
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
                reply.complete = not reply.error
                return response
        except StopAsyncIteration:
            raise ApiError(502, "the engine ended the stream with no answer", kind="server_error") from None
        except (ConnectionResetError, asyncio.CancelledError):
            # the client went away (first: aiohttp's ClientConnectionResetError is a ClientError
            # too): closing the upstream call ends the request in Triton, freeing its engine slot
            log.info("client disconnected mid-stream")
            raise
        except (TimeoutError, ClientError) as exc:
            if response is None:
                raise_unreachable(exc)
            log.warning("stream cut: %s", exc)  # the client saw tokens; the cut shows as a missing [DONE]
            reply.error = f"stream cut ({type(exc).__name__})"
            return response


class Reply:
    """One answer as it is built: engine events turned into the OpenAI objects (completion or
    chat, whole or chunks), with what the shadow's records and the capture keep of it."""

    def __init__(self, chat: bool, line: ServedModel) -> None:
        self.chat, self.line = chat, line  # the line: the first model until the request names its own
        self.route = ""  # the version the router picked for it (none: Triton's unversioned path)
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.text: list[str] = []
        self.finish_reason: Any = None
        self.prompt_tokens = self.completion_tokens = 0
        self.sent_role = False
        # for the shadow records: when it started, when each chunk of text left, the engine's own
        # per-token times (ms; NaN where the engine does not report them), what went wrong
        self.started = time.perf_counter()
        self.arrivals: list[float] = []
        self.engine_ttft_ms = self.engine_itl_ms = math.nan
        self.error = ""
        self.refusal: ApiError | None = None
        self.complete = False
        # for the capture: what was asked, how, and which version answered (the engine says)
        self.prompt, self.stream, self.version = "", False, ""

    @property
    def model(self) -> str:
        return self.line.name

    @property
    def engine(self) -> str:
        return self.line.engine

    def refuse(self, exc: ApiError) -> None:
        self.refusal, self.error = exc, exc.message

    def add(self, event: dict[str, Any]) -> str:
        delta = str(event.get("text_output", ""))
        self.text.append(delta)
        reason = str(event.get("finish_reason") or "") or None
        if reason not in (None, "stop", "length"):  # the engine ended it otherwise (stopping: "abort")
            raise ApiError(503, f"the engine ended the request early ({reason})", kind="server_error")
        self.finish_reason = reason
        self.prompt_tokens = int(event.get("prompt_tokens", self.prompt_tokens))
        self.completion_tokens = int(event.get("completion_tokens", self.completion_tokens))
        self.version = str(event.get("model_version") or self.version)
        if "engine_ttft_ms" in event:  # the final event of an engine that times itself (-1: not measured)
            self.engine_ttft_ms, self.engine_itl_ms = (
                value if (value := float(event[name])) >= 0 else math.nan for name in ("engine_ttft_ms", "engine_itl_ms"))
        return delta

    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                     total_tokens=self.prompt_tokens + self.completion_tokens)

    def whole(self) -> Completion | ChatCompletion:
        text = "".join(self.text)
        if self.chat:
            return ChatCompletion(id=self.id, created=self.created, model=self.model, usage=self.usage(), choices=[
                ChatChoice(message=AssistantMessage(content=text), finish_reason=self.finish_reason)])
        return Completion(id=self.id, created=self.created, model=self.model, usage=self.usage(), choices=[
            CompletionChoice(text=text, finish_reason=self.finish_reason)])

    def chunk(self, event: dict[str, Any]) -> Completion | ChatCompletionChunk:
        delta = self.add(event)
        if delta:
            self.arrivals.append(time.perf_counter())
        if self.chat:
            role: Literal["assistant"] | None = None if self.sent_role else "assistant"
            self.sent_role = True
            return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[
                ChatChunkChoice(delta=Delta(role=role, content=delta), finish_reason=self.finish_reason)])
        return Completion(id=self.id, created=self.created, model=self.model, choices=[CompletionChoice(text=delta, finish_reason=self.finish_reason)])

    def usage_chunk(self) -> Completion | ChatCompletionChunk:
        if self.chat:
            return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=self.usage())
        return Completion(id=self.id, created=self.created, model=self.model, choices=[], usage=self.usage())


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
    request: the same hop for both answers of a pair), the engine's own figures for both (NaN
    where its engine does not report them), the chunks themselves."""
    status = response.status if response is not None else 0
    if reply is None:
        return {"ok": False, "status": status, "ttft_ms": math.nan, "itl_ms": math.nan, "engine_ttft_ms": math.nan,
                "engine_itl_ms": math.nan, "chunks": [], "error": error or "refused before generation"}
    arrivals = reply.arrivals
    ttft = (arrivals[0] - reply.started) * 1000 if arrivals else math.nan
    itl = (arrivals[-1] - arrivals[0]) * 1000 / (len(arrivals) - 1) if len(arrivals) > 1 else math.nan
    return {"ok": status == 200 and reply.complete, "status": status, "ttft_ms": ttft, "itl_ms": itl,
            "engine_ttft_ms": reply.engine_ttft_ms, "engine_itl_ms": reply.engine_itl_ms,
            "chunks": [chunk for chunk in reply.text if chunk],
            "error": reply.error or ("" if reply.complete else "not completed")}


async def read_body(request: web.Request) -> bytes:
    """The whole body, however it arrives (in pieces, chunked), at most ``MAX_BODY_BYTES`` (413);
    one the client encoded wrongly (``Content-Encoding: gzip`` over bytes that are not) is a 400."""
    try:
        return await request.read()
    except (HttpProcessingError, RequestPayloadError) as exc:  # aiohttp's decoding and framing errors
        reason = " ".join(str(exc).split()).removeprefix("400, message: ") or type(exc).__name__
        refused = ApiError(400, f"request body could not be read ({reason})"[:200])
        # aiohttp closes a connection whose body it could not read: say so, or the router reuses
        # it for the next request and meets a reset (502)
        refused.close_connection = True
        raise refused from None


async def upstream_events(upstream: Any) -> AsyncIterator[dict[str, Any]]:
    """The engine's events of a ``generate_stream`` answer; an error raises :class:`ApiError`:
    Triton's status with the first event's error (a request the engine refused: 400, its queue
    full: 503) or an error event mid-stream (200: the engine failed)."""
    if not upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
        try:
            data = await upstream.json(content_type=None)
        except ValueError:
            data = {}
        raise upstream_error(upstream.status, data if isinstance(data, dict) else {})
    async for line in upstream.content:
        if line.startswith(b"data:"):
            event = json.loads(line[5:])
            if upstream.status != 200 or "error" in event:
                raise upstream_error(upstream.status, event)
            yield event
    if upstream.status != 200:
        raise upstream_error(upstream.status, {})


async def send_event(response: web.StreamResponse, payload: str) -> None:
    await response.write(b"data: " + payload.encode() + b"\n\n")


def typed_response(answer: Any, status: int = 200) -> web.Response:
    """A response model, serialized by Pydantic."""
    return web.Response(body=answer.model_dump_json(), status=status, content_type="application/json")


def error_response(exc: ApiError) -> web.Response:
    response = typed_response(exc.body(), exc.status)
    if exc.close_connection:
        response.force_close()
    return response


def upstream_error(status: int, data: dict[str, Any]) -> ApiError:
    """Triton's error as the client's: its 400s are the engine's one-line reasons; an overloaded
    engine (UNAVAILABLE, HTTP 503) is a 429; an error mid-stream is the engine's failure."""
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
    """Every refusal in OpenAI's shape: ours, aiohttp's own (unknown path, method, a body over
    the limit) and, for a bug, a 500 that says so in one line (logged with its traceback)."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except ApiError as exc:
        return error_response(exc)
    except web.HTTPRequestEntityTooLarge:
        too_large = ApiError(413, f"request body larger than {MAX_BODY_BYTES} bytes", code="request_too_large")
        too_large.close_connection = True  # the rest of the body is never read
        return error_response(too_large)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(ApiError(exc.status, f"{request.method} {request.path}: {exc.reason}".lower()))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return error_response(ApiError(500, "internal error: the server failed this request (logged)",
                                       kind="server_error"))


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def name_the_version(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer says which version answered (the router cannot: it does not read the body
    that names the model, and so the line)."""
    if VERSION_KEY in request:
        response.headers[VERSION_HEADER] = request[VERSION_KEY]


def app(triton_url: str, models: list[ServedModel], timeout_s: float, capture: TrafficCapture | None = None,
        discover: Callable[[], list[ServedModel]] | None = None) -> web.Application:
    api = Api(triton_url, models, timeout_s, capture, discover)
    application = web.Application(middlewares=[errors], client_max_size=MAX_BODY_BYTES)
    application.on_response_prepare.append(name_the_version)
    application.on_startup.append(api.start)
    application.on_cleanup.append(api.close)
    application.router.add_get("/v1/models", api.models)
    application.router.add_post("/v1/completions", api.completions)
    application.router.add_post("/v1/chat/completions", api.chat_completions)
    application.router.add_get("/openapi.json", api.openapi_document)
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
    parser.add_argument("--line", help="serve this model line's model alone ('demo': params.yaml's; a cluster "
                                       "track's pod, whose Triton holds that line alone); default: every line")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    timeout = serve.generate.request_timeout_s + 30
    if not 0 <= args.capture_rate <= 1:
        parser.error(f"--capture-rate {args.capture_rate}: expected a share in [0, 1]")
    capture = TrafficCapture(dataclasses.replace(serve.capture, rate=args.capture_rate, uri=args.capture_uri))
    if capture.enabled:
        log.info("capturing %.0f%% of answered requests to %s", 100 * args.capture_rate, args.capture_uri)
    # handler_cancellation: a client that goes away cancels its handler, and with it the
    # engine's work on its request (aiohttp lets handlers run on by default)
    models = ServedModel.every_line()
    if args.line is not None:
        models = [model for model in models if model.key == args.line]
        if not models:
            parser.error(f"--line {args.line!r}: no such model line")
    discover = ServedModel.every_line if args.line is None else None
    web.run_app(app(args.triton_url, models, timeout, capture, discover),
                host=args.host, port=args.port, access_log=None, print=None, handler_cancellation=True)


if __name__ == "__main__":
    main()
