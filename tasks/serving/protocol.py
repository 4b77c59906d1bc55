"""The OpenAI API's requests and responses as Pydantic models (the shape of vLLM's
``protocol.py`` and the openai package's own types): one validation path for completions, chat
and a shadow's copy, one error shape, and the OpenAPI document the front serves
(``GET /openapi.json``), which the test suite fuzzes.

A request body is read whole and bounded (:data:`MAX_BODY_BYTES`) by the front, then
:func:`parse_request` turns it into a :class:`CompletionRequest` or :class:`ChatRequest`, or an
:class:`ApiError` whose message is one line naming the field. Any JSON a client sends ends in one
of those two: never an exception of another kind (tests/tasks/serving/test_protocol.py fuzzes it).

Fields OpenAI defines that this server cannot honour (``n`` > 1, ``logprobs``, tools, ...) are
refused unless they hold their default; unknown fields are ignored, as vLLM does (clients such
as LangChain send their own). ``ignore_eos`` (vLLM's extension, which benchmark clients send)
is accepted on the public path too: it only keeps a request generating to its ``max_tokens``,
which bounds the work whatever the text, and a request whose client goes away is cancelled.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, ValidationError, field_validator, model_validator
from pydantic.json_schema import models_json_schema

from tasks.serving.contract import (
    CHAT_STOP,
    MAX_BODY_BYTES,
    MAX_STOP_CHARS,
    MAX_STOPS,
    MAX_TOKENS_LIMIT,
    SAMPLING_LIMITS,
)

# OpenAI fields this server answers only with their default (refused otherwise, naming the field)
UNSUPPORTED: dict[str, Any] = {"n": 1, "best_of": 1, "logprobs": None, "echo": False, "suffix": None, "tools": None,
                               "functions": None, "top_logprobs": None, "tool_choice": None, "function_call": None}


class ApiError(Exception):
    """A request refused, as the client sees it: a status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.close_connection = False  # the connection cannot serve another request (a body left unread)

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorDetail(message=self.message, type=self.kind, param=self.param, code=self.code))


# -- requests -----------------------------------------------------------------------------------

_TEMPERATURE, _TOP_P, _TOP_K, _SEED = (SAMPLING_LIMITS[k] for k in ("temperature", "top_p", "top_k", "seed"))


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False


class Sampling(BaseModel):
    """What completions and chat share: the model, the sampling settings, streaming."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    # numbers as JSON numbers only (strict: "5" or true is not a max_tokens, 5.5 not a seed)
    model: str | None = None
    max_tokens: Annotated[int | None, Strict(), Field(ge=1, le=MAX_TOKENS_LIMIT)] = None
    temperature: Annotated[float | None, Strict(), Field(ge=_TEMPERATURE[0], le=_TEMPERATURE[1],
                                                         allow_inf_nan=False)] = None
    top_p: Annotated[float | None, Strict(), Field(gt=_TOP_P[0], le=_TOP_P[1], allow_inf_nan=False)] = None
    top_k: Annotated[int | None, Strict(), Field(ge=_TOP_K[0], le=_TOP_K[1])] = None  # vLLM's extension
    seed: Annotated[int | None, Strict(), Field(ge=_SEED[0], le=_SEED[1])] = None
    stop: str | list[str] | None = None  # at most MAX_STOPS (bounded_stops)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False  # vLLM's extension: generate max_tokens tokens whatever comes

    @model_validator(mode="before")
    @classmethod
    def refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, default in UNSUPPORTED.items():
                value = data.get(name)
                # None, the default, or false where the default is none (chat's logprobs: false)
                if not (value is None or (value == default and type(value) is type(default))
                        or (default is None and value is False)):
                    raise ValueError(f"{name}: not supported by this server (only {name}={default!r})")
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def bounded_stops(cls, stop: Any) -> Any:
        texts = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else None
        if stop is not None and (texts is None or len(texts) > MAX_STOPS or not all(
                isinstance(t, str) and 0 < len(t) <= MAX_STOP_CHARS for t in texts)):
            raise ValueError(f"expected a string or a list of at most {MAX_STOPS} strings, each of 1 to "
                             f"{MAX_STOP_CHARS} characters")
        return stop

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def usage_chunk(self) -> bool:
        """A stream ends with a chunk of token counts (``stream_options.include_usage``)."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def engine_inputs(self, prompt: str, extra_stop: list[str]) -> dict[str, Any]:
        """The body of Triton's generate extension for the engine (``llm_generate``'s input names)."""
        inputs: dict[str, Any] = {"text_input": prompt}
        for name in ("temperature", "top_p", "top_k", "seed"):
            if (value := getattr(self, name)) is not None:
                inputs[name] = value
        if self.max_tokens is not None:
            inputs["max_tokens"] = self.max_tokens
        if self.ignore_eos:
            inputs["ignore_eos"] = True
        if stops := [*self.stops(), *extra_stop]:
            inputs["stop"] = json.dumps(stops)
        return inputs


def encodable(text: str, field: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{field} is not valid UTF-8 (a lone surrogate)") from None
    return text


class CompletionRequest(Sampling):
    """``POST /v1/completions``."""

    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]

    @field_validator("prompt", mode="before")
    @classmethod
    def one_text_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and (len(prompt) != 1 or not isinstance(prompt[0], str)):
            raise ValueError("expected a string (token-id prompts and batches are not supported)")
        return prompt

    @field_validator("prompt")
    @classmethod
    def utf8_prompt(cls, prompt: str | list[str]) -> str | list[str]:
        for text in [prompt] if isinstance(prompt, str) else prompt:
            encodable(text, "prompt")
        return prompt

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def text_content(cls, content: Any) -> Any:
        if not isinstance(content, str) and not (isinstance(content, list) and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content)):
            raise ValueError("expected text content: a string, or parts of type text")
        return content

    @field_validator("content")
    @classmethod
    def utf8_content(cls, content: str | list[TextPart]) -> str | list[TextPart]:
        for text in [content] if isinstance(content, str) else [p.text for p in content]:
            encodable(text, "content")
        return content

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(Sampling):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int | None, Field(ge=1, le=MAX_TOKENS_LIMIT)] = None

    @model_validator(mode="after")
    def one_token_limit(self) -> ChatRequest:
        if self.max_tokens is None and self.max_completion_tokens is not None:  # OpenAI's newer name
            object.__setattr__(self, "max_tokens", self.max_completion_tokens)
        return self

    def prompt(self) -> str:
        """The plain documented template: one ``Role: content`` line per message, then ``Assistant:``
        (the demo model is not chat-tuned and has no template of its own); it stops at :data:`CHAT_STOP`."""
        return "".join(f"{m.role.capitalize()}: {m.text}\n" for m in self.messages) + "Assistant:"

    def chat_inputs(self) -> dict[str, Any]:
        """The engine's body for a chat: the plain template's prompt and stop, which a model
        without a template of its own answers, and the messages as a request parameter, which
        one with a template renders instead (dropping that stop; engines before templates ignore it)."""
        messages = [{"role": m.role, "content": m.text} for m in self.messages]
        return {**self.engine_inputs(self.prompt(), [CHAT_STOP]), "parameters": {"messages": json.dumps(messages)}}

    def asked(self) -> str:
        """What the user asked, without the template's framing (the drift check reads it)."""
        return "\n".join(m.text for m in self.messages if m.role == "user")


def parse_request(raw: bytes, chat: bool) -> CompletionRequest | ChatRequest:
    """A whole request body as its model, or :class:`ApiError` (400, one line naming the field)."""
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body of {len(raw)} bytes is larger than {MAX_BODY_BYTES} bytes",
                       code="request_too_large")
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=refuse_constant)
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not valid UTF-8 (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") \
            from None
    except NotJson as exc:
        raise ApiError(400, f"request body is not valid JSON ({exc})") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise ApiError(400, f"request body holds a number out of range ({str(exc).splitlines()[0][:80]})") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body: expected a JSON object")
    try:
        return (ChatRequest if chat else CompletionRequest).model_validate(body)
    except ValidationError as exc:
        raise refusal(exc) from None


class NotJson(ValueError):
    """What Python's JSON parser takes but JSON is not."""


def refuse_constant(name: str) -> float:
    """JSON has no NaN or Infinity (Python's parser would take them): a number a client cannot mean."""
    raise NotJson(f"{name} is not a number in JSON")


TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}  # the branches of a union, in an error's path


def refusal(exc: ValidationError) -> ApiError:
    """The first error of a validation, as one line: ``field.path: what was expected``."""
    error = exc.errors(include_url=False, include_input=False)[0]
    loc = ".".join(str(part) for part in error["loc"]
                   if isinstance(part, int) or (part.isidentifier() and part.islower() and part not in TYPE_TAGS))
    message = error["msg"].removeprefix("Value error, ")
    if not loc and ":" in message:  # a model-level check names its field itself
        loc = message.split(":", 1)[0]
        return ApiError(400, message, loc)
    return ApiError(400, f"{loc}: {message}" if loc else message, loc.split(".", 1)[0] or None)


# -- responses ----------------------------------------------------------------------------------

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length"]


class Choice(BaseModel):
    """What every choice holds: its index (one choice: 0), why it ended (None: not yet), no logprobs."""

    index: int = 0
    finish_reason: FinishReason | None
    logprobs: None = None


class Answer(BaseModel):
    """What every answer and chunk holds: its id, when it was made, the model that made it."""

    id: str
    created: int
    model: str


class CompletionChoice(Choice):
    text: str


class Completion(Answer):
    """A completion, whole (``object: text_completion``), or one chunk of a stream (no usage but
    in the last chunk, and then no choices)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(Choice):
    message: AssistantMessage


class ChatCompletion(Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str


class ChatChunkChoice(Choice):
    delta: Delta


class ChatCompletionChunk(Answer):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "llm-pipeline"
    version: str | None = None  # the line's stable version (its champion) where the router says it


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# -- the OpenAPI document -------------------------------------------------------------------------

ERROR_STATUSES = {"400": "a bad request: one line naming the field", "404": "an unknown model",
                  "413": f"a body over {MAX_BODY_BYTES} bytes", "429": "the engine's queue is full",
                  "502": "the inference server failed", "503": "no version serves this request"}


def openapi() -> dict[str, Any]:
    """The OpenAPI 3.1 document of the public endpoints (``GET /openapi.json``)."""
    requests: list[type[BaseModel]] = [CompletionRequest, ChatRequest]
    answers: list[type[BaseModel]] = [Completion, ChatCompletion, ChatCompletionChunk, ModelList, ErrorResponse]
    modes: list[tuple[type[BaseModel], Literal["validation", "serialization"]]] = \
        [(m, "validation") for m in requests] + [(m, "serialization") for m in answers]
    _, defs = models_json_schema(modes, ref_template="#/components/schemas/{model}")
    ref = "#/components/schemas/{}".format

    def json_body(name: str) -> dict[str, Any]:
        return {"application/json": {"schema": {"$ref": ref(name)}}}

    errors = {status: {"description": text, "content": json_body("ErrorResponse")} for status, text in ERROR_STATUSES.items()}

    # one server-sent event (OpenAPI 3.1: a stream's schema is its events'): a chunk as JSON, an
    # error object, or the last, [DONE]
    event = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}

    def generate(request: str, whole: str, chunk: str, summary: str) -> dict[str, Any]:
        return {"post": {
            "summary": summary,
            "requestBody": {"required": True, "content": json_body(request)},
            "responses": {"200": {"description": "the answer, whole (JSON) or streamed (server-sent events of "
                                                 f"{chunk} objects, then [DONE])",
                                  "content": {**json_body(whole), "text/event-stream": {"schema": event}}},
                          **errors}}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "llm-pipeline OpenAI-compatible API", "version": "1"},
        "paths": {
            "/v1/completions": generate("CompletionRequest", "Completion", "Completion", "A completion of a prompt"),
            "/v1/chat/completions": generate("ChatRequest", "ChatCompletion", "ChatCompletionChunk",
                                             "The assistant's answer to a conversation"),
            "/v1/models": {"get": {"summary": "The served model", "responses": {
                "200": {"description": "the models", "content": json_body("ModelList")}}}},
        },
        "components": {"schemas": defs["$defs"]},
    }
