"""A checkpoint's own chat template, rendered as transformers renders it.

``tokenizer_config.json`` of a Hugging Face checkpoint carries ``chat_template`` (one Jinja
template, or a list of named ones: ``default`` is taken) and its special tokens. The template is
code from whoever published the model, so it runs in Jinja's immutable sandbox with exactly what
transformers' ``apply_chat_template`` gives it (``trim_blocks``, ``lstrip_blocks``, the
``loopcontrols`` extension, a ``{% generation %}`` block, the ``tojson`` filter that does not
escape HTML, ``raise_exception``, ``strftime_now``, ``dict`` and a ``namespace`` that refuses
underscore names) and the variables it passes: ``messages``, ``add_generation_prompt``, and each
special token by its name (``bos_token``, ``eos_token``, ...). A template's own
``raise_exception`` (a role it does not know, a system message where it allows none) is the
request's error, one line.

Models without a template keep the plain one (:data:`PLAIN_TEMPLATE`): one ``Role: content`` line
per message, then ``Assistant:``, stopped at ``\\nUser:``.

Standard library and jinja2 only: the export copies it beside the engine with a base's
``tokenizer_config.json``; the engine (model.py) renders a chat's messages with it, and a model
without a template answers the front's plain-template prompt.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

PLAIN_STOP = "\nUser:"


def without_plain_stop(stops: list[str]) -> list[str]:
    """A request's stop strings without the plain template's, which the front appends last for
    every chat request (it cannot know the model's template): a model rendering its own template
    ends on its EOS ids instead. A client's own identical stop, earlier in the list, stays."""
    if PLAIN_STOP not in stops:
        return stops
    last = len(stops) - 1 - stops[::-1].index(PLAIN_STOP)
    return stops[:last] + stops[last + 1:]


class TemplateError(ValueError):
    """A template that does not load or render, or refuses the messages: one line."""


class ChatTemplate:
    """One model's chat template and the special tokens it may name."""

    def __init__(self, source: str | None, special_tokens: dict[str, str] | None = None) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.compiled = compile_template(source) if source else None

    @classmethod
    def from_tokenizer_config(cls, config: dict[str, Any]) -> ChatTemplate:
        """From a ``tokenizer_config.json`` (no template: the plain one)."""
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise TemplateError(f"tokenizer_config.json: chat_template is {type(template).__name__}, not a string")
        specials = {name: token for name in SPECIAL_TOKEN_NAMES if (token := token_text(config.get(name))) is not None}
        return cls(template, specials)

    @property
    def plain(self) -> bool:
        return self.compiled is None

    def stops(self) -> list[str]:
        """The stop strings the template needs beyond the model's end-of-sequence token."""
        return [PLAIN_STOP] if self.plain else []

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self.compiled is None:
            return "".join(f"{str(m['role']).capitalize()}: {m['content']}\n" for m in messages) + "Assistant:"
        import jinja2

        try:
            return str(self.compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            tools=None, documents=None, **self.special_tokens))
        except jinja2.TemplateError as exc:  # raise_exception, a sandbox refusal, a bad expression
            raise TemplateError(f"the model's chat template refused the messages: {one_line(exc)}") from None
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
            raise TemplateError(f"the model's chat template failed on the messages: {one_line(exc)}") from None


SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def compile_template(source: str) -> Any:
    """The template compiled in the sandbox transformers uses (see the module docstring)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (templates that mark the assistant's tokens
        for training masks): rendered as its body."""

        tags = frozenset({"generation"})  # type: ignore[assignment]

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    class Namespace(jinja2.utils.Namespace):
        """Jinja's namespace refusing underscore names (no reach into Python's internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                Namespace.check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_' ({name!r})")

    class Dict:
        """``dict(...)`` and ``dict.fromkeys(...)`` for templates, nothing else of the type."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[Generation, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals.update(raise_exception=raise_exception, strftime_now=lambda f: dt.datetime.now().strftime(f),
                               dict=Dict(), namespace=Namespace)
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"tokenizer_config.json: chat_template line {exc.lineno}: {one_line(exc)}") from None
