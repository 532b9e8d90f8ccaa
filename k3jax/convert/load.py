"""Load a Hugging Face checkpoint folder of any Kimi family into ``(cfg, variables)``.

Steps: (1) ``config.json`` -> ``ModelConfig``; (2) the key mapping of ``hf_keys`` gives every
expected tensor; (3) the folder's key set is checked against it before any data is read (missing,
unexpected); (4) tensors are read one at a time from memory-mapped shards, shape-checked, converted
to the tree layout (docs/params.md) and cast; routed experts are stacked ``[E, in, out]``, decoding
MXFP4 (``weight_packed`` + ``weight_scale``) where the release ships it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig
from k3jax.convert import mxfp4
from k3jax.convert.hf_config import family, from_hf_config
from k3jax.convert.hf_keys import LAYOUTS, Entry, entries, ignored_prefixes
from k3jax.convert.safetensors_io import SafetensorsReader
from k3jax.layout import to_scanned

PACKED, SCALE = "weight_packed", "weight_scale"


def _mxfp4_keys(key: str) -> tuple[str, str]:
    base = key.removesuffix("weight")
    return base + PACKED, base + SCALE


def _resolve(entry: Entry, reader: SafetensorsReader) -> Entry:
    """The entry under the spelling the checkpoint uses (its ``hf`` key or one of its aliases)."""
    for alias in entry.aliases:
        if alias in reader and entry.hf not in reader:
            return dataclasses.replace(entry, hf=alias, aliases=())
    return entry


def _expected_keys(table: list[Entry], reader: SafetensorsReader) -> set[str]:
    keys = set()
    for entry in table:
        if not entry.is_experts:
            keys.add(entry.hf)
            continue
        for e in range(entry.shape[0]):
            key = entry.expert_key(e)
            packed, _ = _mxfp4_keys(key)
            keys.update(_mxfp4_keys(key) if packed in reader and key not in reader else (key,))
    return keys


def _check_keys(cfg: ModelConfig, table: list[Entry], reader: SafetensorsReader) -> None:
    expected = _expected_keys(table, reader)
    present = {k for k in reader.keys() if not k.startswith(ignored_prefixes(cfg))}
    missing, unexpected = sorted(expected - present), sorted(present - expected)
    where = f"for a {family(cfg)!r} checkpoint of this config"
    if missing:
        raise ValueError(f"tensor {missing[0]!r} is missing {where} ({len(missing)} missing, "
                         f"e.g. {missing[:3]})")
    if unexpected:
        raise ValueError(f"tensor {unexpected[0]!r} is unexpected {where} ({len(unexpected)} unexpected, "
                         f"e.g. {unexpected[:3]}); a checkpoint of another family or config?")


def _read(reader: SafetensorsReader, key: str, shape: tuple[int, ...]) -> np.ndarray:
    """One HF matrix as float32 or wider (MXFP4 pairs decoded), shape-checked."""
    if key in reader:
        value = reader.get(key)
    else:
        packed_key, scale_key = _mxfp4_keys(key)
        packed, scale = reader.get(packed_key), reader.get(scale_key)
        if packed.shape != (shape[0], shape[1] // 2):
            raise ValueError(f"tensor {packed_key!r} has shape {packed.shape}, expected "
                             f"{(shape[0], shape[1] // 2)} (MXFP4 of {shape})")
        value = mxfp4.decode(packed, scale, name=packed_key)
    if value.shape != shape:
        raise ValueError(f"tensor {key!r} has shape {value.shape}, expected {shape}")
    if not np.issubdtype(value.dtype, np.floating) and value.dtype.name != "bfloat16":
        raise ValueError(f"tensor {key!r} has dtype {value.dtype}, expected a floating dtype")
    return value


def _leaf(entry: Entry, reader: SafetensorsReader, dtype) -> np.ndarray:
    layout = LAYOUTS[entry.layout]
    if not entry.is_experts:
        return layout.to_tree(_read(reader, entry.hf, entry.hf_shape), entry.shape).astype(dtype)
    out = np.empty(entry.shape, dtype=dtype)  # [E, in, out]
    for e in range(entry.shape[0]):
        out[e] = layout.to_tree(_read(reader, entry.expert_key(e), entry.hf_shape), entry.shape[1:])
    return out


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for name in path[:-1]:
        tree = tree.setdefault(name, {})
    tree[path[-1]] = value


def _check_dtype(name: str, dtype) -> None:
    if jnp.dtype(dtype).itemsize == 8 and not jax.config.jax_enable_x64:
        raise ValueError(f"{name}={jnp.dtype(dtype).name} needs jax_enable_x64 (jax.config.update('jax_enable_x64', True))")


def load_hf(path: str, *, dtype: Any = None, param_dtype: Any = None) -> tuple[ModelConfig, dict]:
    """``(cfg, {"params": ..., "balance": ...})`` from a Hugging Face folder of any Kimi family.

    The variables are in ``cfg``'s layout: the scanned run of layers stacked (``k3jax.layout``; pass
    ``cfg`` through ``k3jax.layout.unrolled`` and ``to_per_layer`` for one entry per layer).
    ``dtype`` / ``param_dtype`` override the config's compute / parameter dtypes (default bfloat16 /
    float32); the SPEC §10 fp32 parameters (convs, gate biases, ``A_log``, router, QB bias) are kept in
    ``promote(param_dtype, float32)``.
    """
    cfg = from_hf_config(path)
    if dtype is not None:
        cfg = dataclasses.replace(cfg, dtype=dtype)
    if param_dtype is not None:
        cfg = dataclasses.replace(cfg, param_dtype=param_dtype)
    _check_dtype("dtype", cfg.dtype)
    _check_dtype("param_dtype", cfg.param_dtype)
    reader = SafetensorsReader(path)
    table = [_resolve(entry, reader) for entry in entries(cfg)]
    _check_keys(cfg, table, reader)
    wide = jnp.promote_types(cfg.param_dtype, jnp.float32)
    variables: dict = {"params": {}, "balance": {}}
    for entry in table:
        value = _leaf(entry, reader, wide if entry.wide else jnp.dtype(cfg.param_dtype))
        _set(variables[entry.collection], entry.path, value)
    # Stacked on the host (the scanned layout of cfg, k3jax.layout), then placed leaf by leaf.
    return cfg, jax.tree.map(jnp.asarray, to_scanned(variables, cfg))
