"""A base checkpoint's model served behind the router, asked through the openai SDK: chat is
rendered by the model's own chat template (system and user messages, the generation prompt, its
special tokens) and ends at its own end-of-turn token; completions open with its BOS. The engine
answers token for token what PyTorch's greedy decoding of the same ids gives. A tiny Llama (Llama
3's tokens and template) and a tiny Qwen2 (ChatML, no BOS), built offline (examples/tiny_base.py),
imported by the tokenize step, registered, exported by the export step, staged in the stack's
Triton."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    export,
    imported_base,
    params_with_model_name,
    register_model_dir,
    served_alone,
    write_eval_text,
)

from tasks.lib import tokens
from tasks.lib.model import generate_greedy
from tasks.lib.model_store import load_model_dir
from tasks.serving.contract import CHAT_STOP
from tasks.serving.triton_models.llm_generate.chat import PLAIN_STOP, ChatTemplate

pytestmark = pytest.mark.integration

MESSAGES = [{"role": "system", "content": "You answer in one line."},
            {"role": "user", "content": "Return the number of items"}]


def greedy_text(model: Any, vocabulary: tokens.Vocabulary, ids: list[int], max_tokens: int) -> tuple[str, str]:
    """PyTorch's greedy continuation of ``ids`` as the API answers it: (text, finish reason)."""
    out = generate_greedy(model, ids, max_tokens, vocabulary.special.eos_ids)
    return vocabulary.tokenizer.decode(out), "length" if len(out) == max_tokens else "stop"


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_chat_renders_the_models_own_template_and_completions_open_with_its_bos(
    family: str, stack_env: dict[str, str], snapshot: Path, tmp_path: Path
) -> None:
    import openai

    assert PLAIN_STOP == CHAT_STOP  # the stop the engine drops is the one the front adds
    env = {**stack_env, **params_with_model_name(f"chat-{family}", tmp_path)}
    imported = imported_base(family, snapshot, tmp_path, env)
    version = register_model_dir(env["MODEL_NAME"], str(imported["init_model_uri"]))
    export(version, tmp_path / "export", env, write_eval_text(tmp_path, 600, 620))
    generate_dir = tmp_path / "export" / "triton" / "llm_generate" / version
    assert (generate_dir / "chat.py").exists() and (generate_dir / "tokenizer_config.json").exists()

    loaded = load_model_dir(str(imported["init_model_uri"]), tmp_path / "load")
    vocabulary = tokens.load_vocabulary(str(imported["tokenizer_uri"]), tmp_path / "tok")
    template = ChatTemplate.from_tokenizer_config(json.loads(vocabulary.chat_config or "{}"))
    rendered = template.render(MESSAGES)
    assert rendered.startswith("<|begin_of_text|><|start_header_id|>system" if family == "llama" else
                               "<|im_start|>system\nYou answer in one line.<|im_end|>")
    chat_ids = vocabulary.tokenizer.encode(rendered, add_special_tokens=False).ids
    prompt_ids = vocabulary.special.prefix + vocabulary.tokenizer.encode("Return the number of",
                                                                         add_special_tokens=False).ids

    client = openai.OpenAI(base_url=f"{env['ROUTER_URL']}/v1", api_key="unused", max_retries=0, timeout=60)
    with served_alone(env, version, tmp_path / "export", tmp_path / "scratch"):
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12,  # type: ignore[arg-type]
                                              temperature=0)
        streamed = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12,  # type: ignore[arg-type]
                                                  temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = list(streamed)
        completion = client.completions.create(model=model, prompt="Return the number of", max_tokens=12,
                                               temperature=0)

    text, reason = greedy_text(loaded.model, vocabulary, chat_ids, 12)
    assert chat.usage is not None and chat.usage.prompt_tokens == len(chat_ids)  # the template's ids, BOS included
    assert chat.choices[0].message.content == text and chat.choices[0].finish_reason == reason
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == len(chat_ids)
    text, reason = greedy_text(loaded.model, vocabulary, prompt_ids, 12)
    assert completion.usage is not None and completion.usage.prompt_tokens == len(prompt_ids)
    assert completion.choices[0].text == text and completion.choices[0].finish_reason == reason
