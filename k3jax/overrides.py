"""Typed ``--set key=value`` overrides of a frozen dataclass config tree.

Each value is parsed against the type annotation of the field it sets (``int``, ``float``,
``bool``, ``str``, ``X | None``, ``Literal[...]``, enums, ``tuple[...]``, dtypes), so a wrong
value fails here, naming the key, the value and the expected type — not as a ``TypeError`` deep
in the model, or after a checkpoint folder has been created (``steps=1.5``). The config's own
``__post_init__`` then checks ranges as usual.

    apply_overrides(cfg, ["optimizer.learning_rate=1e-3", "model.mla_layers=(1, 3)", "log_dir=None"])
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import types
import typing
from typing import Any

import jax.numpy as jnp
import numpy as np

_NONE = ("none", "null")
_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


class _Mismatch(Exception):
    """``raw`` is not a value of the annotation (caught and reported with the key)."""


def apply_overrides(cfg: Any, assignments: list[str]) -> Any:
    """``cfg`` with every ``"dotted.key=value"`` of ``assignments`` applied in order (later wins).

    Raises ``ValueError`` naming the key, the value and the expected type for an unknown key or a
    value that does not parse as the field's type.
    """
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--set {assignment!r} must look like key=value (e.g. optimizer.learning_rate=1e-3)")
        cfg = _replace_path(cfg, key.split("."), raw.strip(), key)
    return cfg


def _replace_path(node: Any, path: list[str], raw: str, key: str) -> Any:
    if not dataclasses.is_dataclass(node):
        raise ValueError(f"--set {key}: {type(node).__name__} has no field {path[0]!r}")
    fields = {f.name: f for f in dataclasses.fields(node)}
    if path[0] not in fields:
        raise ValueError(f"--set {key}: {type(node).__name__} has no field {path[0]!r}; fields are {sorted(fields)}")
    current = getattr(node, path[0])
    if len(path) > 1:
        value = _replace_path(current, path[1:], raw, key)
    else:
        hint = _hints(type(node))[path[0]]
        try:
            value = parse_value(raw, hint, current)
        except _Mismatch as err:
            raise ValueError(f"--set {key}={raw!r}: expected {describe(hint, current)}{err}") from None
    try:
        return dataclasses.replace(node, **{path[0]: value})
    except TypeError as err:
        raise ValueError(f"--set {key}={raw!r}: {err}") from None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def parse_value(raw: str, hint: Any, current: Any = None) -> Any:
    """``raw`` (command-line text) as a value of type ``hint``; ``current``, the field's value now,
    decides what an ``Any`` field holds (a dtype stays a dtype). Raises ``_Mismatch``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if raw.lower() in _NONE and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return parse_value(raw, option, current)
            except _Mismatch:
                continue
        raise _Mismatch()
    if origin is typing.Literal:
        value = _literal(raw)
        if value not in args:
            raise _Mismatch()
        return value
    if origin is tuple:
        return _tuple(_literal(raw), args)
    if dataclasses.is_dataclass(hint):
        raise _Mismatch(f"; {hint.__name__} is a section: set its fields, e.g. KEY.field=value")
    if hint is Any:
        return _any(raw, current)
    if hint is str:
        value = _literal(raw)
        return value if isinstance(value, str) else raw  # quotes are optional; "123" stays text
    return _scalar(_literal(raw), hint)


def _literal(raw: str) -> Any:
    """A Python literal, or the text itself (so that ``kind=wsd`` needs no quotes)."""
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


def _scalar(value: Any, hint: Any) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in _BOOLS:
            return _BOOLS[str(value).lower()]
        raise _Mismatch()
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str) and value.lower() in ("inf", "-inf", "nan"):
        return float(value)
    if hint is str and isinstance(value, str):
        return value
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        for member in hint:
            if value in (member.name, member.value):
                return member
    raise _Mismatch()


def _tuple(value: Any, args: tuple) -> tuple:
    if not isinstance(value, (tuple, list)):
        raise _Mismatch()
    if len(args) == 2 and args[1] is Ellipsis:
        args = (args[0],) * len(value)
    if len(args) != len(value):
        raise _Mismatch()
    return tuple(_element(v, a) for v, a in zip(value, args))


def _element(value: Any, hint: Any) -> Any:
    if typing.get_origin(hint) is tuple:
        return _tuple(value, typing.get_args(hint))
    return _scalar(value, hint)


def _any(raw: str, current: Any) -> Any:
    if _is_dtype(current):
        try:
            return jnp.dtype(raw.removeprefix("jnp.").removeprefix("np."))
        except TypeError:
            raise _Mismatch() from None
    return _literal(raw)


def _is_dtype(value: Any) -> bool:
    """A dtype or a scalar type (``jnp.bfloat16``), as the model configs' ``dtype`` fields hold."""
    if isinstance(value, np.dtype):
        return True
    if value is None or isinstance(value, (str, bool, int, float, tuple)):
        return False
    try:
        jnp.dtype(value)
    except TypeError:
        return False
    return True


def describe(hint: Any, current: Any = None) -> str:
    """A reader's name of the type ``hint`` (``int``, ``float or None``, ``one of ('cosine', 'wsd')``)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a, current) for a in args)
    if origin is typing.Literal:
        return f"one of {args}"
    if origin is tuple:
        return f"a tuple {hint}".replace("typing.", "")
    if hint is type(None):
        return "None"
    if hint is Any:
        return "a dtype name (float32, bfloat16, …)" if _is_dtype(current) else "a Python literal"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return f"one of {[m.value for m in hint]}"
    return getattr(hint, "__name__", str(hint))
