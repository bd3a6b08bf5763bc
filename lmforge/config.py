"""Dataclass configs built from plain dicts (YAML, JSON, CLI overrides) with strict keys.

A typo in a key is the most common config mistake; it must fail loudly and say what was meant.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, TypeVar

from lmforge.errors import UserError

T = TypeVar("T")


def closest(word: str, choices: typing.Iterable[str], prefix: str = "") -> str:
    """' (did you mean X?)' for the nearest choice, or '' when nothing is close."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{prefix}{match[0]}'?)" if match else ""


def unknown_key_error(key: str, known: typing.Iterable[str], where: str) -> UserError:
    known = sorted(known)
    hint = closest(key, known, where)
    return UserError(f"unknown config key '{where}{key}'{hint}: valid keys are {', '.join(known)}")


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Build dataclass `cls` from `data`, recursing into nested dataclass fields.

    Unknown keys raise a UserError naming the dotted key and the closest valid one.
    """
    if not isinstance(data, dict):
        raise UserError(f"config section '{where.rstrip('.') or cls.__name__}' must be a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise unknown_key_error(key, fields, where)
        sub = _dataclass_in(hints[key])
        kwargs[key] = from_dict(sub, value, f"{where}{key}.") if sub and isinstance(value, dict) else value
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise UserError(f"config '{where.rstrip('.') or cls.__name__}': {e}") from None


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass inside `X`, `X | None` or `Optional[X]`, else None."""
    if dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            if dataclasses.is_dataclass(arg):
                return arg
    return None


def to_dict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj)
