"""The configuration reference of docs/configuration.md, generated from the dataclasses: per section,
each setting's type, value in params.yaml and meaning (its field's docstring)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
from typing import Any, get_args, get_origin, get_type_hints

from tasks.config.base import SettingsError
from tasks.config.coerce import describe
from tasks.config.settings import Settings

MD_BAR = " \\| "  # a | inside a Markdown table cell


def _field_docs(cls: Any) -> dict[str, str]:
    """Each field's docstring: the string literal under it (as Sphinx reads attribute docs)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in itertools.pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr) \
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    text = "" if value is None else str(value)
    return text if len(text) <= 48 else text[:45] + "..."


def _rows(cls: Any, values: Any, prefix: str) -> list[str]:
    rows = []
    docs, hints = _field_docs(cls), get_type_hints(cls)
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        tp, value, name = hints[field.name], getattr(values, field.name), f"{prefix}{field.name}"
        if dataclasses.is_dataclass(tp):
            rows.append(f"| `{name}` | section | | {docs.get(field.name, '')} |")
            rows += _rows(tp, value, f"{name}.")
        elif get_origin(tp) is dict and dataclasses.is_dataclass(get_args(tp)[1]):
            # one set of rows for the entries' fields; the entries are named, their values are in params.yaml
            rows.append(f"| `{name}` | {describe(tp, MD_BAR)} | {', '.join(value)} | {docs.get(field.name, '')} |")
            item_cls = get_args(tp)[1]
            item_docs, item_hints = _field_docs(item_cls), get_type_hints(item_cls)
            rows += [f"| `{name}.<name>.{item.name}` | {describe(item_hints[item.name], MD_BAR)} | | {item_docs.get(item.name, '')} |"
                     for item in dataclasses.fields(item_cls)]
        else:
            shown = _value(value) if not isinstance(value, dict) else ", ".join(f"{k}: {_value(v)}" for k, v in value.items())
            rows.append(f"| `{name}` | {describe(tp, MD_BAR)} | `{shown}` | {docs.get(field.name, '')} |" if shown
                        else f"| `{name}` | {describe(tp, MD_BAR)} | | {docs.get(field.name, '')} |")
    return rows


def reference(settings: Settings) -> str:
    """The configuration reference: per section, each setting's type, value and meaning."""
    docs = _field_docs(Settings)
    out = []
    for field in dataclasses.fields(Settings):
        section_cls = get_type_hints(Settings)[field.name]
        out += [f"### `{field.name}`", "", docs.get(field.name, ""), "",
                "| setting | type | params.yaml | meaning |", "|---|---|---|---|",
                *_rows(section_cls, getattr(settings, field.name), f"{field.name}."), ""]
    return "\n".join(out)


REFERENCE_START = "<!-- reference: generated from tasks/config/ by `make config-docs`; edit the dataclasses, not this -->"
REFERENCE_END = "<!-- end of the generated reference -->"


def with_reference(page: str, settings: Settings) -> str:
    """``page`` (docs/configuration.md) with its generated reference brought up to date."""
    head, start, rest = page.partition(REFERENCE_START)
    _, end, tail = rest.partition(REFERENCE_END)
    if not start or not end:
        raise SettingsError(f"the page has no {REFERENCE_START!r} ... {REFERENCE_END!r} block")
    return f"{head}{start}\n\n{reference(settings)}\n{end}{tail}"
