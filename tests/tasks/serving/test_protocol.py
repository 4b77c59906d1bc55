"""The OpenAI API's request models (tasks/serving/protocol.py) in this process: any body a client
can send ends as a request model or a 4xx with one line naming the field, never another
exception (hypothesis generates them); the OpenAPI document describes what is validated."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tasks.serving.contract import MAX_BODY_BYTES
from tasks.serving.protocol import ApiError, ChatRequest, CompletionRequest, openapi, parse_request

# JSON values, and the fields the models read given values of any JSON type
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                           max_leaves=6)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
          "stop", "stream", "stream_options", "ignore_eos", "n", "logprobs", "echo", "tools"]
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", ""]),
                                           "content": st.text() | st.lists(st.fixed_dictionaries(
                                               {"type": st.sampled_from(["text", "image_url"]), "text": st.text()}))}),
                    max_size=3)


def parsed(raw: bytes, chat: bool) -> CompletionRequest | ChatRequest | ApiError:
    try:
        return parse_request(raw, chat)
    except ApiError as exc:
        return exc


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(body=bodies, chat=st.booleans())
def test_any_json_body_is_a_request_or_a_4xx_naming_its_field(body: dict[str, Any], chat: bool) -> None:
    outcome = parsed(json.dumps(body, allow_nan=True).encode(), chat)
    if isinstance(outcome, ApiError):
        assert 400 <= outcome.status < 500 and outcome.message and "\n" not in outcome.message
    else:
        inputs = outcome.engine_inputs(outcome.prompt() if isinstance(outcome, ChatRequest) else outcome.text, [])
        json.dumps(inputs, allow_nan=False)  # what goes to the engine is plain JSON


@settings(max_examples=150, deadline=None)
@given(raw=st.binary(max_size=64) | st.text(max_size=64).map(str.encode), chat=st.booleans())
def test_any_bytes_are_a_request_or_a_4xx(raw: bytes, chat: bool) -> None:
    outcome = parsed(raw, chat)
    assert not isinstance(outcome, ApiError) or 400 <= outcome.status < 500


@settings(max_examples=100, deadline=None)
@given(conversation=messages)
def test_any_conversation_is_a_prompt_or_a_4xx(conversation: list[dict[str, Any]]) -> None:
    outcome = parsed(json.dumps({"messages": conversation}).encode(), chat=True)
    if not isinstance(outcome, ApiError):
        assert outcome.prompt().endswith("Assistant:") and len(outcome.messages) == len(conversation)


@pytest.mark.parametrize(("raw", "field"), [
    (b'{"prompt": "x", "max_tokens": 1e999}', "max_tokens"),
    (b'{"prompt": "x", "seed": NaN}', None),
    (b'{"prompt": "x", "stream": true, "stream_options": 5}', "stream_options"),
    (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", None),
    (b"[" * 100_000 + b"]" * 100_000, None),
    (b'{"prompt": "\\ud800"}', "prompt"),
    (b'{"prompt": "x", "n": 2}', "n"),
    (b'{"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}', "stop"),
    (b'{"prompt": [1, 2]}', "prompt"),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "messages"),
])
def test_what_once_was_a_500_is_a_400_naming_the_field(raw: bytes, field: str | None) -> None:
    outcome = parsed(raw, chat=b"messages" in raw)
    assert isinstance(outcome, ApiError) and outcome.status == 400 and "\n" not in outcome.message
    assert outcome.param == field and (field is None or outcome.message.startswith(f"{field}")), outcome.message


def test_a_body_over_the_limit_is_a_413() -> None:
    outcome = parsed(b" " * (MAX_BODY_BYTES + 1), chat=False)
    assert isinstance(outcome, ApiError) and outcome.status == 413


def test_the_openapi_document_holds_the_request_models() -> None:
    document = openapi()
    schemas = document["components"]["schemas"]
    assert schemas["CompletionRequest"]["properties"]["max_tokens"]["anyOf"][0]["maximum"] == 1 << 20
    assert set(schemas["ChatMessage"]["properties"]["role"]["enum"]) == {"system", "user", "assistant"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        answers = document["paths"][path]["post"]["responses"]
        assert {"200", "400", "404", "413", "429"} <= set(answers)
