"""``k3jax_overrides`` in a Hugging Face ``config.json``: the ``ModelConfig`` fields that have no
Hugging Face field, as ``{"section.field": value}`` (``k3jax.convert.hf_config`` reads and writes them)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax.numpy as jnp

from k3jax.config import ModelConfig

OVERRIDES = "k3jax_overrides"


def leaves(cfg, prefix: str = "") -> dict[str, Any]:
    """Every leaf field of a (nested) config by its dotted path."""
    out = {}
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if dataclasses.is_dataclass(value):
            out.update(leaves(value, f"{prefix}{field.name}."))
        else:
            out[f"{prefix}{field.name}"] = value
    return out


def to_json(path: str, value):
    """A config value as ``config.json`` stores it (dtype names, enum values, lists)."""
    if path.endswith("dtype"):
        return jnp.dtype(value).name
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"{path}={value!r} cannot be written to config.json")


def _replace(obj, parts: list[str], value):
    if len(parts) == 1:
        old = getattr(obj, parts[0])
        if parts[0].endswith("dtype"):
            value = getattr(jnp, value)
        elif isinstance(old, enum.Enum):
            value = type(old)(value)
        elif isinstance(old, tuple) or (old is None and isinstance(value, list)):
            value = tuple(value)
        return dataclasses.replace(obj, **{parts[0]: value})
    child = getattr(obj, parts[0])
    if not dataclasses.is_dataclass(child):
        raise ValueError(f"{OVERRIDES} key {'.'.join(parts)!r}: {parts[0]} is not a config section here")
    return dataclasses.replace(obj, **{parts[0]: _replace(child, parts[1:], value)})


def apply_overrides(cfg: ModelConfig, overrides: dict) -> ModelConfig:
    """``cfg`` with each ``{"section.field": json value}`` applied; unknown paths are errors."""
    known = leaves(cfg)
    for path, value in overrides.items():
        if path not in known:
            raise ValueError(f"{OVERRIDES} key {path!r} must name a ModelConfig field, e.g. 'kda.chunk_size'")
        cfg = _replace(cfg, path.split("."), value)
    return cfg
