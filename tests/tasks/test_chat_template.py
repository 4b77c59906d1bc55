"""A checkpoint's chat template rendered as transformers' ``apply_chat_template`` renders it,
in the same sandbox; the plain template for models without one."""

from __future__ import annotations

from typing import Any

import pytest

from tasks.serving.triton_models.llm_generate.chat import PLAIN_STOP, ChatTemplate, TemplateError, without_plain_stop

CHATML = (  # Qwen2's shape: a default system message, roles, add_generation_prompt
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = (  # bos_token, headers, a namespace, strip, trim_blocks and lstrip_blocks at work
    "{{ bos_token }}{% set ns = namespace(system='') %}\n"
    "{% for message in messages %}\n"
    "    {% if message['role'] == 'system' %}{% set ns.system = message['content'] | trim %}{% continue %}{% endif %}\n"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}\n"
    "{% if ns.system %}[system: {{ ns.system | tojson }}]{% endif %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
ALTERNATING = (  # Mistral's shape: user/assistant turns only, anything else refused
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}{% endif %}{% endfor %}")
CONVERSATION = [{"role": "system", "content": " Answer briefly. «ok» "},
                {"role": "user", "content": "What is a canary?"},
                {"role": "assistant", "content": "A small rollout."},
                {"role": "user", "content": "And a shadow?"}]
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}


def transformers_render(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"<s>": 0, "</s>": 1, "x": 2},
                                                                             unk_token="x")), **SPECIALS)
    tokenizer.chat_template = template
    rendered: str = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return rendered


@pytest.mark.parametrize("template", [CHATML, LLAMA3], ids=["chatml", "llama3"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_templates_render_as_transformers_renders_them(template: str, add_generation_prompt: bool) -> None:
    ours = ChatTemplate.from_tokenizer_config({"chat_template": template, **SPECIALS})
    for messages in (CONVERSATION, CONVERSATION[1:2]):
        assert ours.render(messages, add_generation_prompt) == transformers_render(template, messages,
                                                                                   add_generation_prompt)
    assert ours.stops() == [] and not ours.plain


def test_a_template_that_refuses_the_messages_is_one_line() -> None:
    ours = ChatTemplate.from_tokenizer_config({"chat_template": [{"name": "default", "template": ALTERNATING},
                                                                 {"name": "tool_use", "template": "x"}],
                                               "bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>"})
    turns = CONVERSATION[1:]
    assert ours.render(turns) == transformers_render(ALTERNATING, turns, True)
    assert ours.render(turns).startswith("<s>[INST] What is a canary? [/INST]A small rollout.</s>")
    with pytest.raises(TemplateError, match="refused the messages: Conversation roles must alternate"):
        ours.render(CONVERSATION)  # a system message first


def test_the_sandbox_holds_what_transformers_holds_back() -> None:
    escape = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(TemplateError, match="refused the messages"):
        escape.render(CONVERSATION)
    with pytest.raises(TemplateError, match="a namespace attribute may not start with '_'"):
        ChatTemplate("{% set ns = namespace(_x=1) %}{{ ns }}").render(CONVERSATION)
    with pytest.raises(TemplateError, match="chat_template line 1"):
        ChatTemplate("{% for m in messages %}")


def test_a_model_without_a_template_gets_the_plain_one() -> None:
    plain = ChatTemplate.from_tokenizer_config({"eos_token": "<|endoftext|>"})
    assert plain.plain and plain.stops() == [PLAIN_STOP]
    assert plain.render(CONVERSATION[1:3]) == "User: What is a canary?\nAssistant: A small rollout.\nAssistant:"


def test_a_templated_model_drops_the_fronts_plain_stop_and_keeps_the_clients() -> None:
    """The front appends the plain template's stop to every chat request, last; a model with a
    template of its own drops that one (it stops at its EOS ids) and keeps what the client asked."""
    assert without_plain_stop(["###", PLAIN_STOP]) == ["###"]
    assert without_plain_stop([PLAIN_STOP, "###", PLAIN_STOP]) == [PLAIN_STOP, "###"]  # the client's own
    assert without_plain_stop(["###"]) == ["###"] and without_plain_stop([]) == []
