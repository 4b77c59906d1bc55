"""Building the dataclasses from YAML: every key known, every value coerced to its field's type
(:func:`build`), types described in messages and the reference (:func:`describe`), a ``Literal``'s
values for the DAGs' Params (:func:`choices`)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import types
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from tasks.config.base import SettingsError

T = TypeVar("T")


def build(cls: type[T], values: Mapping[str, Any], where: str = "") -> T:
    """``cls`` from a mapping: every key known, every value of its field's type, the class's
    checks passed; else :class:`SettingsError` naming the setting (``where.key``)."""
    if not isinstance(values, Mapping):
        raise SettingsError(f"{where or cls.__name__}: expected a section (a mapping), got {values!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    prefix = f"{where}." if where else ""
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise SettingsError(f"{prefix}{unknown[0]}: unknown setting (known: {', '.join(fields)})")
    hints = get_type_hints(cls)
    kwargs = {}
    for name, field in fields.items():
        if name in values:
            kwargs[name] = _coerce(hints[name], values[name], f"{prefix}{name}")
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise SettingsError(f"{prefix}{name}: missing")
    try:
        return cls(**kwargs)
    except SettingsError as exc:  # a check of the class: it names the setting
        raise SettingsError(f"{prefix}{exc}") from None
    except ValueError as exc:  # anything else a check met
        raise SettingsError(f"{where or cls.__name__}: {exc}") from None


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return build(tp, value, where)  # type: ignore[arg-type]
    if origin is Literal:
        # True == 1: a bool is only ever a bool
        if any(value == arg and type(value) is type(arg) for arg in args):
            return value
        raise SettingsError(f"{where} {value!r}: expected one of {', '.join(map(str, args))}")
    if origin in (Union, types.UnionType):
        for arm in args:
            try:
                return _coerce(arm, value, where)
            except SettingsError:
                continue
        raise SettingsError(f"{where} {value!r}: expected {describe(tp)}")
    if tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            with contextlib.suppress(ValueError):
                return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, dt.date):  # an unquoted date in YAML or --set end_date=2026-11-25
            return value.isoformat()
    elif origin is tuple and isinstance(value, list | tuple):
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], item, f"{where}[{i}]") for i, item in enumerate(value))
        if len(value) == len(args):
            return tuple(_coerce(arm, item, f"{where}[{i}]") for i, (arm, item) in enumerate(zip(args, value, strict=True)))
    elif origin is dict and isinstance(value, Mapping):
        return {str(key): _coerce(args[1], item, f"{where}.{key}") for key, item in value.items()}
    elif origin is None or origin not in (tuple, dict):
        raise TypeError(f"{where}: unsupported setting type {tp!r}")
    raise SettingsError(f"{where} {value!r}: expected {describe(tp)}")


def describe(tp: Any, bar: str = " | ") -> str:
    """A type as an error message (or, ``bar`` escaped, the configuration reference) writes it."""
    origin, args = get_origin(tp), get_args(tp)
    if dataclasses.is_dataclass(tp):
        return "section"
    if origin is Literal:
        return bar.join(str(arg).lower() if isinstance(arg, bool) else str(arg) for arg in args)
    if origin in (Union, types.UnionType):
        return bar.join(describe(arm, bar) for arm in args)
    if origin is tuple:
        return f"list of {describe(args[0], bar)}" if len(args) == 2 and args[1] is Ellipsis else \
            f"[{', '.join(describe(arm, bar) for arm in args)}]"
    if origin is dict:
        return f"mapping of {describe(args[1], bar)}"
    return {type(None): "null", bool: f"true{bar}false", int: "integer", float: "number", str: "string"}.get(tp, "any")


def choices(cls: type, name: str) -> list[Any]:
    """A field's allowed values (its ``Literal``'s), e.g. for a DAG Param's ``enum``."""
    tp = get_type_hints(cls)[name]
    if get_origin(tp) is not Literal:
        raise TypeError(f"{cls.__name__}.{name} is not a Literal")
    return list(get_args(tp))
