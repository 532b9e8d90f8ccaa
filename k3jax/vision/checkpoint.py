"""Multimodal Hugging Face checkpoints: the K3 text model plus ``vision_tower.*`` and ``mm_projector.*``.

The text part goes through ``k3jax.convert`` unchanged (its K3 loader already skips the vision
prefixes; its writer takes the vision tensors and config fields as extras); this module adds the
tower and projector (``k3jax.vision.hf_keys``), with the same checks: every expected key present
and no unexpected one before any data is read, shapes checked per tensor.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig
from k3jax.convert import load as text_load
from k3jax.convert import save as text_save
from k3jax.convert.hf_config import family
from k3jax.convert.safetensors_io import PendingTensor, SafetensorsReader
from k3jax.vision.config import MultimodalConfig
from k3jax.vision.hf_keys import (VISION_PREFIXES, VisionEntry, from_hf_vision_config, media_token_id,
                                  to_hf_vision_config, vision_entries)
from k3jax.vision.model import text_variables


def _check_family(cfg: MultimodalConfig) -> None:
    if family(cfg.text) != "kimi_k3":
        raise ValueError(f"a multimodal checkpoint needs a K3-family text model (keys under language_model.), "
                         f"got {family(cfg.text)!r}")


def _leaf(params: dict, entry: VisionEntry):
    node = params
    for i, name in enumerate(entry.path):
        if not isinstance(node, dict) or name not in node:
            raise ValueError(f"variables['params'] has no leaf {'/'.join(entry.path[:i + 1])!r} (HF {entry.hf!r})")
        node = node[name]
    if tuple(node.shape) != entry.shape:
        raise ValueError(f"leaf {'/'.join(entry.path)!r} has shape {tuple(node.shape)}, expected {entry.shape}")
    return node


def _paths(tree, prefix=()) -> list[tuple[str, ...]]:
    if not isinstance(tree, dict):
        return [prefix]
    return [p for k, v in tree.items() for p in _paths(v, prefix + (k,))]


def save_hf(cfg: MultimodalConfig, variables: dict, path: str, *, dtype: Any = None, mxfp4: bool = False,
            max_shard_bytes: int = 5 << 30) -> None:
    """Write the whole multimodal model as one HF folder (``dtype=None``: each leaf's own dtype)."""
    _check_family(cfg)
    params = variables["params"]
    table = vision_entries(cfg.vision, cfg.text.hidden)
    known = {e.path for e in table}
    for part in ("vision_tower", "mm_projector"):
        for p in _paths(params.get(part, {}), (part,)):
            if p not in known:
                raise ValueError(f"variables leaf params/{'/'.join(p)} has no Hugging Face key for this config")
    extra = []
    for entry in table:
        leaf = _leaf(params, entry)
        out_dtype = np.dtype(leaf.dtype if dtype is None else dtype)
        make = lambda leaf=leaf, e=entry, d=out_dtype: e.to_hf(np.asarray(jax.device_get(leaf))).astype(d)  # noqa: E731
        extra.append((entry.hf, PendingTensor(entry.hf_shape, out_dtype, make)))
    config = {"vision_config": to_hf_vision_config(cfg.vision, cfg.text.hidden),
              "media_placeholder_token_id": cfg.media_token_id}
    text_save.save_hf(cfg.text, text_variables(variables), path, dtype=dtype, mxfp4=mxfp4,
                      max_shard_bytes=max_shard_bytes, extra_tensors=extra, extra_config=config)
    with open(os.path.join(path, PREPROCESSOR), "w") as f:
        json.dump({"media_proc_cfg": _media_proc_cfg(cfg)}, f, indent=2, sort_keys=True)


PREPROCESSOR = "preprocessor_config.json"


def _media_proc_cfg(cfg: MultimodalConfig) -> dict:
    """The release's ``media_proc_cfg`` (preprocessing lives there, not in ``vision_config``)."""
    v = cfg.vision
    return {"patch_size": v.patch_size, "merge_kernel_size": v.merge[0], "in_patch_limit": v.max_patches,
            "patch_limit_on_one_side": v.max_side_patches, "temporal_merge_kernel_size": cfg.frames_per_chunk,
            "image_mean": list(v.image_mean), "image_std": list(v.image_std)}


def _read_media_proc_cfg(path: str, cfg: MultimodalConfig) -> MultimodalConfig:
    file = os.path.join(path, PREPROCESSOR)
    if not os.path.exists(file):
        return cfg
    with open(file) as f:
        m = json.load(f).get("media_proc_cfg", {})
    v = cfg.vision
    vision = dataclasses.replace(v, max_patches=m.get("in_patch_limit", v.max_patches),
                                 max_side_patches=m.get("patch_limit_on_one_side", v.max_side_patches),
                                 image_mean=tuple(m.get("image_mean", v.image_mean)),
                                 image_std=tuple(m.get("image_std", v.image_std)))
    return dataclasses.replace(cfg, vision=vision,
                               frames_per_chunk=m.get("temporal_merge_kernel_size", cfg.frames_per_chunk))


def check_vision_keys(table: list[VisionEntry], reader: SafetensorsReader) -> None:
    """Every tower / projector key present, none unexpected, each of its HF shape and a floating
    dtype: from the headers, before any data is read."""
    expected = {e.hf for e in table}
    present = {k for k in reader.keys() if k.startswith(VISION_PREFIXES)}
    missing, unexpected = sorted(expected - present), sorted(present - expected)
    if missing:
        raise ValueError(f"tensor {missing[0]!r} is missing for this vision_config ({len(missing)} missing)")
    if unexpected:
        raise ValueError(f"tensor {unexpected[0]!r} is unexpected for this vision_config "
                         f"({len(unexpected)} unexpected)")
    for entry in table:
        info = reader.infos[entry.hf]
        if tuple(info.shape) != entry.hf_shape:
            raise ValueError(f"{info.file}: tensor {entry.hf!r} has shape {tuple(info.shape)}, expected {entry.hf_shape}")
        if not np.issubdtype(info.dtype, np.floating) and info.dtype.name != "bfloat16":
            raise ValueError(f"{info.file}: tensor {entry.hf!r} has dtype {info.dtype}, expected a floating dtype")


def read_tensor(reader: SafetensorsReader, entry: VisionEntry, dtype) -> np.ndarray:
    """``entry``'s tree leaf (shape and dtype checked by `check_vision_keys`), as ``dtype``."""
    return entry.to_tree(np.asarray(reader.get(entry.hf))).astype(dtype)


def multimodal_config(path: str, text_cfg: ModelConfig) -> MultimodalConfig | None:
    """The ``MultimodalConfig`` of the folder ``path`` around its text model ``text_cfg`` (None when its
    ``config.json`` has no ``vision_config``: a text-only checkpoint). The tower takes the text model's
    compute and parameter dtypes."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    if "vision_config" not in config:
        return None
    if family(text_cfg) != "kimi_k3":
        raise ValueError(f"{path}/config.json: a vision_config needs a K3-family text model, got {family(text_cfg)!r}")
    vision = dataclasses.replace(from_hf_vision_config(config["vision_config"]), dtype=text_cfg.dtype,
                                 param_dtype=text_cfg.param_dtype)
    text_hidden = config["vision_config"].get("text_hidden_size", text_cfg.hidden)
    if text_hidden != text_cfg.hidden:
        raise ValueError(f"vision_config.text_hidden_size={text_hidden} must equal the text hidden size "
                         f"{text_cfg.hidden}")
    return _read_media_proc_cfg(path, MultimodalConfig(text=text_cfg, vision=vision,
                                                       media_token_id=media_token_id(config)))


def load_hf(path: str, *, dtype: Any = None, param_dtype: Any = None) -> tuple[MultimodalConfig, dict]:
    """``(MultimodalConfig, variables)`` from a K3 multimodal folder; dtypes as ``k3jax.convert.load_hf``
    (the tower takes the text model's compute and parameter dtypes)."""
    text_cfg, text = text_load.load_hf(path, dtype=dtype, param_dtype=param_dtype)
    cfg = multimodal_config(path, text_cfg)
    if cfg is None:
        raise ValueError(f"{path}/config.json has no vision_config: a text-only checkpoint (use k3jax.convert.load_hf)")
    reader = SafetensorsReader(path)
    table = vision_entries(cfg.vision, text_cfg.hidden)
    check_vision_keys(table, reader)
    params = {"language_model": text["params"]}
    for entry in table:
        node = params
        for name in entry.path[:-1]:
            node = node.setdefault(name, {})
        node[entry.path[-1]] = jnp.asarray(read_tensor(reader, entry, jnp.dtype(text_cfg.param_dtype)))
    return cfg, {"params": params, "balance": {"language_model": text["balance"]}}
