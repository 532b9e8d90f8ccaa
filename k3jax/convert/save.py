"""Save ``(cfg, variables)`` as a Hugging Face checkpoint folder in the family's own layout.

The inverse of ``load_hf``: every leaf goes back through its ``hf_keys`` layout to PyTorch's
``[out, in]``; K3's ``A_log`` padding is restored (zeros). Tensors are written one at a time.
``dtype=None`` keeps every leaf's own dtype (lossless); ``dtype=jnp.bfloat16`` writes the release
layout (bf16, with the release's F32 tensors in float32). ``mxfp4=True`` packs K3's routed experts
as in the release (exact for experts that are MXFP4 values, as the released ones are).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from k3jax.config import ModelConfig
from k3jax.convert import mxfp4 as mx
from k3jax.convert.hf_config import family, to_hf_config
from k3jax.convert.hf_keys import LAYOUTS, Entry, entries
from k3jax.convert.safetensors_io import PendingTensor, write_folder
from k3jax.layout import to_per_layer

# compressed-tensors' block of the released K3 config.json (text_config.quantization_config).
MXFP4_QUANTIZATION_CONFIG = {
    "config_groups": {"group_0": {
        "format": "mxfp4-pack-quantized", "input_activations": None, "output_activations": None,
        "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": mx.GROUP,
                    "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8",
                    "strategy": "group", "symmetric": True, "type": "float", "zp_dtype": None}}},
    "format": "mxfp4-pack-quantized", "global_compression_ratio": None,
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}


def _get(tree: dict, path: tuple[str, ...], collection: str) -> Any:
    node = tree
    for i, name in enumerate(path):
        if not isinstance(node, dict) or name not in node:
            raise ValueError(f"variables[{collection!r}] has no leaf {'/'.join(path[:i + 1])!r}, "
                             "expected by the config (docs/params.md)")
        node = node[name]
    return node


def _check_leaf(entry: Entry, leaf) -> None:
    if tuple(leaf.shape) != entry.shape:
        raise ValueError(f"variables[{entry.collection!r}] leaf {'/'.join(entry.path)!r} has shape "
                         f"{tuple(leaf.shape)}, expected {entry.shape} (HF {entry.hf!r})")


def _hf_dtype(entry: Entry, leaf, dtype) -> np.dtype:
    if dtype is None:
        return np.dtype(leaf.dtype)
    return np.dtype(np.float32) if entry.hf_f32 else np.dtype(dtype)


class _HostLeaf:
    """A leaf copied to host memory when first needed and dropped after its last use, so the writer
    holds one layer's tensors at a time (keys are written in sorted order, a layer's keys together)."""

    def __init__(self, leaf, uses: int):
        self.leaf, self.uses, self.value = leaf, uses, None

    def get(self) -> np.ndarray:
        if self.value is None:
            self.value = np.asarray(jax.device_get(self.leaf))
        value = self.value
        self.uses -= 1
        if self.uses == 0:
            self.value = None
        return value


def _pending(entry: Entry, leaf, dtype, use_mxfp4: bool) -> list[tuple[str, PendingTensor]]:
    layout = LAYOUTS[entry.layout]
    out_dtype = _hf_dtype(entry, leaf, dtype)
    if not entry.is_experts:
        host = _HostLeaf(leaf, 1)
        make = lambda: layout.to_hf(host.get()).astype(out_dtype)  # noqa: E731
        return [(entry.hf, PendingTensor(entry.hf_shape, out_dtype, make))]
    rows, cols = entry.hf_shape
    host = _HostLeaf(leaf, entry.shape[0])
    items = []
    for e in range(entry.shape[0]):
        key = entry.expert_key(e)
        matrix = lambda e=e: layout.to_hf(host.get()[e])  # noqa: E731
        if not use_mxfp4:
            items.append((key, PendingTensor(entry.hf_shape, out_dtype, lambda m=matrix: m().astype(out_dtype))))
            continue
        base = key.removesuffix("weight")
        packed = _Encoded(matrix, key)
        u8 = np.dtype(np.uint8)
        items += [(base + "weight_packed", PendingTensor((rows, cols // 2), u8, packed.packed)),
                  (base + "weight_scale", PendingTensor((rows, cols // mx.GROUP), u8, packed.scale))]
    return items


class _Encoded:
    """MXFP4 of one expert matrix, encoded once for its two tensors (written one after the other)."""

    def __init__(self, matrix, key: str):
        self.matrix, self.key, self.pair = matrix, key, None

    def _pair(self):
        if self.pair is None:
            self.pair = mx.encode(self.matrix(), name=self.key)
        return self.pair

    def packed(self) -> np.ndarray:
        return self._pair()[0]

    def scale(self) -> np.ndarray:
        scale = self._pair()[1]
        self.pair = None  # both halves written: free the memory
        return scale


def _leaf_paths(tree, prefix=()) -> list[tuple[str, ...]]:
    if not isinstance(tree, dict):
        return [prefix]
    return [p for k, v in tree.items() for p in _leaf_paths(v, prefix + (k,))]


def _check_no_extra(table: list[Entry], variables: dict) -> None:
    known = {(e.collection,) + e.path for e in table}
    for collection in ("params", "balance"):
        for path in _leaf_paths(variables[collection], (collection,)):
            if path not in known:
                raise ValueError(f"variables leaf {'/'.join(path)!r} has no Hugging Face key for this config")


def _config_dict(cfg: ModelConfig, dtype_name: str, use_mxfp4: bool) -> dict:
    d = to_hf_config(cfg)
    d["dtype"] = dtype_name
    if "text_config" in d:
        d["text_config"]["dtype"] = dtype_name
        if use_mxfp4:
            d["text_config"]["quantization_config"] = copy.deepcopy(MXFP4_QUANTIZATION_CONFIG)
            d["text_config"] = dict(sorted(d["text_config"].items()))
    return d


def save_hf(cfg: ModelConfig, variables: dict, path: str, *, dtype: Any = None, mxfp4: bool = False,
            max_shard_bytes: int = 5 << 30, extra_tensors: Sequence[tuple[str, PendingTensor]] = (),
            extra_config: dict | None = None) -> None:
    """Write ``variables`` (``{"params", "balance"}``, docs/params.md, either layer layout) as a HF folder at ``path``.

    ``extra_tensors`` / ``extra_config`` add tensors and top-level config fields of other parts of the
    checkpoint (the vision tower: ``k3jax.vision.checkpoint``)."""
    if mxfp4 and family(cfg) != "kimi_k3":
        raise ValueError(f"mxfp4=True is the K3 release format; cfg is {family(cfg)!r}")
    for collection in ("params", "balance"):
        if collection not in variables:
            raise ValueError(f"variables must hold {collection!r} (docs/params.md), got {sorted(variables)}")
    variables = to_per_layer(variables, cfg)  # the HF layout is per layer (a no-op on per-layer trees)
    table = entries(cfg)
    _check_no_extra(table, variables)
    tensors = []
    for entry in table:
        leaf = _get(variables[entry.collection], entry.path, entry.collection)
        _check_leaf(entry, leaf)
        tensors += _pending(entry, leaf, dtype, mxfp4 and entry.is_experts)
    tensors += list(extra_tensors)
    os.makedirs(path, exist_ok=True)
    write_folder(path, tensors, max_shard_bytes=max_shard_bytes)
    embed = variables["params"]["embed"]["embedding"]
    name = np.dtype(dtype if dtype is not None else embed.dtype).name
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**_config_dict(cfg, name, mxfp4), **(extra_config or {})}, f, indent=2, sort_keys=True)
