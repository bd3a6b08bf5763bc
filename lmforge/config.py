"""Dataclass configs built from plain dicts (YAML, JSON, CLI overrides) with strict keys and types.

A typo in a key is the most common config mistake; it must fail loudly and say what was meant. A
value of the wrong type (`trainer.max_steps=abc`) fails the same way, naming the key and what it
expected, before it can surface later as a comparison between a str and an int.
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
        raise UserError(
            f"config section '{where.rstrip('.') or cls.__name__}' must be a mapping, got {data!r}"
        )
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise unknown_key_error(key, fields, where)
        sub = _dataclass_in(hints[key])
        if sub and isinstance(value, dict):
            kwargs[key] = from_dict(sub, value, f"{where}{key}.")
        elif sub and not (value is None and type(None) in typing.get_args(hints[key])):
            raise UserError(
                f"config section '{where}{key}' must be a mapping, got {value!r}: set its keys "
                f"('{where}{key}.NAME=VALUE'), or leave it out for the defaults"
            )
        else:
            kwargs[key] = checked(value, hints[key], f"{where}{key}")
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise UserError(f"config '{where.rstrip('.') or cls.__name__}': {e}") from None


def check_types(cls: type, data: dict[str, Any], where: str = "") -> None:
    """UserError for the first value in `data` whose type does not fit the field of `cls` it
    names."""
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        if key in hints:
            checked(value, hints[key], f"{where}{key}")


_NAMES = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "true or false",
    list: "a list",
    dict: "a mapping",
}


def checked(value: Any, hint: Any, key: str) -> Any:
    """`value` if it fits the type hint `hint` (an int where a float is expected becomes a
    float), else a UserError `key: expected ..., got ...`. Any, and types this does not know,
    pass unchecked."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        for option in options:
            try:
                return checked(value, option, key)
            except UserError:
                continue
        raise _type_error(key, options[0] if len(options) == 1 else hint, value)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _type_error(key, list, value)
        return (
            [checked(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
            if args
            else list(value)
        )
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise _type_error(key, dict, value)
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise _type_error(key, bool, value)
    elif hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _type_error(key, int, value)
    elif hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _type_error(key, float, value)
        return float(value)
    elif hint is str:
        if not isinstance(value, str):
            raise _type_error(key, str, value)
    return value


def _type_error(key: str, hint: Any, value: Any) -> UserError:
    expected = (
        _NAMES.get(hint) or _NAMES.get(typing.get_origin(hint)) or str(hint).replace("typing.", "")
    )
    # YAML read text with braces, brackets or ': ' as a mapping or a list: the text wanted quoting.
    quote = (
        f": quote the text for YAML inside the shell's quotes, '{key}=\"...\"'"
        if "str" in expected and isinstance(value, (dict, list))
        else ""
    )
    return UserError(f"{key}: expected {expected}, got {value!r}{quote}")


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
