"""Core: JSON read into frozen dataclasses with every field's type checked (plan.json, manifest.json, programs).

A compiled folder is untrusted input: ``from_json`` builds a dataclass only from values of the annotated types
(``int``, ``float``, ``str``, ``bool``, ``X | None``, ``tuple[X, ...]``, fixed tuples, nested dataclasses),
rejects unknown keys, and says which file and which field is wrong.
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing

from ppsplit.core.errors import ConfigError


class FolderError(ConfigError):
    """A compiled folder (or a file in it) that ppsplit cannot or will not load."""


def from_json(cls, data, where: str):
    """``cls(**data)`` with every value checked against ``cls``'s annotations, recursively; a missing field takes
    its default. Raises ``FolderError`` naming ``where`` and the field.

    Example::

        from_json(StagePlan, {"index": 0, "start": 0, "end": 4, ...}, "plan.json: stages[0]")
    """
    if not isinstance(data, dict):
        raise FolderError(f"{where} must be a JSON object, but is {_kind(data)}")
    hints = _hints(cls)
    unknown = sorted(set(data) - set(hints))
    if unknown:
        raise FolderError(f"{where} has unknown field {unknown[0]!r} (known: {', '.join(hints)})")
    values = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise FolderError(f"{where} lacks the field {f.name!r}")
            continue
        values[f.name] = check(hints[f.name], data[f.name], f"{where}.{f.name}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:  # the dataclass's own invariants (__post_init__)
        raise FolderError(f"{where}: {e}") from None


def check(kind, value, where: str):
    """``value`` as type ``kind`` (lists become tuples), or ``FolderError``."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        for option in options:
            try:
                return check(option, value, where)
            except FolderError:
                if len(options) == 1:
                    raise
        raise FolderError(f"{where} is {_kind(value)}, not one of {', '.join(map(_name, options))}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise FolderError(f"{where} must be a list, but is {_kind(value)}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(check(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise FolderError(f"{where} must have {len(args)} entries, but has {len(value)}")
        return tuple(check(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise FolderError(f"{where} must be a JSON object, but is {_kind(value)}")
        return {k: check(args[1], v, f"{where}.{k}") for k, v in value.items()} if args else dict(value)
    if dataclasses.is_dataclass(kind):
        return from_json(kind, value, where)
    if kind is bool:
        if not isinstance(value, bool):
            raise FolderError(f"{where} must be true or false, but is {_kind(value)}")
        return value
    if kind is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise FolderError(f"{where} must be an integer, but is {_kind(value)}")
        return value
    if kind is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise FolderError(f"{where} must be a number, but is {_kind(value)}")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise FolderError(f"{where} must be a string, but is {_kind(value)}")
        return value
    if kind is typing.Any:
        return value
    raise TypeError(f"from_json cannot check a field of type {kind!r}")  # a ppsplit bug, not bad input


@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _name(kind) -> str:
    return getattr(kind, "__name__", str(kind))


def _kind(value) -> str:
    if value is None:
        return "null"
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"
