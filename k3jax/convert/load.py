"""Load a Hugging Face checkpoint folder of any Kimi family into ``(cfg, variables)``.

Steps: (1) ``config.json`` -> ``ModelConfig``; (2) the key mapping of ``hf_keys`` gives every
expected tensor; (3) the folder's keys, shapes, dtypes and byte ranges are checked against it before
any data is read (``hf_checks``); (4) tensors are read one at a time from memory-mapped shards
(``sharded_read.HFSource``, here each leaf whole), converted to the tree layout (docs/params.md) and
cast; routed experts are stacked ``[E, in, out]``, decoding MXFP4 (``weight_packed`` +
``weight_scale``) where the release ships it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig
from k3jax.convert.hf_config import from_hf_config
from k3jax.convert.sharded_read import HFSource
from k3jax.layout import to_scanned


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for name in path[:-1]:
        tree = tree.setdefault(name, {})
    tree[path[-1]] = value


def _check_dtype(name: str, dtype) -> None:
    if jnp.dtype(dtype).itemsize == 8 and not jax.config.jax_enable_x64:
        raise ValueError(f"{name}={jnp.dtype(dtype).name} needs jax_enable_x64 (jax.config.update('jax_enable_x64', True))")


def load_hf(path: str, *, dtype: Any = None, param_dtype: Any = None) -> tuple[ModelConfig, dict]:
    """``(cfg, {"params": ..., "balance": ...})`` from a Hugging Face folder of any Kimi family.

    The variables are in ``cfg``'s layout: each scanned run of layers stacked (``k3jax.layout``; pass
    ``cfg`` through ``k3jax.layout.unrolled`` and ``to_per_layer`` for one entry per layer).
    ``dtype`` / ``param_dtype`` override the config's compute / parameter dtypes (default bfloat16 /
    float32); the SPEC §10 fp32 parameters (convs, gate biases, ``A_log``, router, QB bias) are kept in
    ``promote(param_dtype, float32)``.
    """
    if not os.path.isdir(path):
        raise ValueError(f"path={str(path)!r} " + ("does not exist" if not os.path.exists(path) else
                         "is a file; expected a Hugging Face folder (config.json + safetensors)"))
    cfg = from_hf_config(path)
    if dtype is not None:
        cfg = dataclasses.replace(cfg, dtype=dtype)
    if param_dtype is not None:
        cfg = dataclasses.replace(cfg, param_dtype=param_dtype)
    _check_dtype("dtype", cfg.dtype)
    _check_dtype("param_dtype", cfg.param_dtype)
    source = HFSource(path, cfg)  # every key, shape, dtype and byte range checked first
    wide = jnp.promote_types(cfg.param_dtype, jnp.float32)
    variables: dict = {"params": {}, "balance": {}}
    for entry in source.table:
        value = source.read(entry, (), wide if entry.wide else jnp.dtype(cfg.param_dtype))
        _set(variables[entry.collection], entry.path, value)
    # Stacked on the host (the scanned layout of cfg, k3jax.layout), then placed leaf by leaf.
    return cfg, jax.tree.map(jnp.asarray, to_scanned(variables, cfg))
