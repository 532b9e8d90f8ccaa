"""Hugging Face keys of the vision tower and projector <-> the k3jax tree, and the ``vision_config``.

Key map (``{i}`` = block; ``.bias`` entries only where the config has biases / LayerNorms):

| HF key | HF shape | tree leaf (under ``params``) | tree shape |
|---|---|---|---|
| ``vision_tower.patch_embed.proj.weight`` | ``[W, C, p, p]`` (Conv2d) | ``vision_tower/patch_embed/proj/kernel`` | ``[C·p·p, W]`` |
| ``vision_tower.patch_embed.pos_emb.weight`` | ``[Gh, Gw, W]`` | ``vision_tower/patch_embed/pos_emb`` | same |
| ``vision_tower.encoder.blocks.{i}.norm0.weight`` / ``norm1`` | ``[W]`` | ``…/blocks_{i}/norm0/scale`` | same |
| ``vision_tower.encoder.blocks.{i}.wqkv.weight`` | ``[3·H·K, W]`` | ``…/blocks_{i}/wqkv/kernel`` | ``[W, 3, H, K]`` |
| ``vision_tower.encoder.blocks.{i}.wo.weight`` | ``[W, H·K]`` | ``…/blocks_{i}/wo/kernel`` | ``[H, K, W]`` |
| ``vision_tower.encoder.blocks.{i}.mlp.fc0.weight`` / ``fc1`` | ``[F, W]`` / ``[W, F]`` | ``…/fc0/kernel`` / ``fc1`` | transposed |
| ``vision_tower.encoder.final_layernorm.weight`` | ``[W]`` | ``vision_tower/encoder/final_layernorm/scale`` | same |
| ``mm_projector.proj.0.weight`` / ``proj.2.weight`` | ``[4W, 4W]`` / ``[D, 4W]`` | ``mm_projector/proj_0/kernel`` / ``proj_2`` | transposed |
| ``mm_projector.post_norm.weight`` (K3) / ``pre_norm.{weight,bias}`` (K2.5) | ``[D]`` / ``[W]`` | ``…/post_norm/scale`` | same |

``wqkv``'s rows are ``(q|k|v, head, dim)`` in that order (SGLang views its output as ``[3, H, K]``).
The ``vision_config`` field names are the tiny K3 oracle's (``vt_hidden_size``, ``qkv_hidden_size``, …).
Neither config carries the tower's norm eps or RoPE θ: they follow the norm type (SGLang's defaults).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import numpy as np

from k3jax.vision.config import FP32_EPS, MEDIA_PAD_ID, VisionConfig

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class VisionEntry:
    """One HF tensor and its leaf: ``to_tree(hf_array) -> tree_array`` and back."""

    hf: str
    path: tuple[str, ...]  # under variables["params"]
    shape: Shape  # tree shape
    hf_shape: Shape
    to_tree: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    # As the text model's ``k3jax.convert.hf_keys.Entry`` (which the orbax conversion reads): a
    # parameter, stored in the parameter dtype, one tensor.
    collection: ClassVar[str] = "params"
    wide: ClassVar[bool] = False
    is_experts: ClassVar[bool] = False


def _same(hf, path, shape) -> VisionEntry:
    return VisionEntry(hf, path, shape, shape, lambda a: a, lambda a: a)


def _linear(hf, path, shape) -> VisionEntry:
    """PyTorch ``[out, in]`` weight <-> kernel ``[in, *out]`` or ``[*in, out]`` (one of them split)."""
    if len(shape) == 2 or hf.endswith("wqkv.weight"):  # [in, *out]
        n_in = shape[0]
        return VisionEntry(hf, path, shape, (int(np.prod(shape[1:])), n_in),
                           lambda a: a.T.reshape(shape), lambda a: a.reshape(n_in, -1).T)
    n_out = shape[-1]  # wo: [H, K, W]
    return VisionEntry(hf, path, shape, (n_out, int(np.prod(shape[:-1]))),
                       lambda a: a.T.reshape(shape), lambda a: a.reshape(-1, n_out).T)


def _bias(hf, path, shape) -> VisionEntry:
    return VisionEntry(hf, path, shape, (int(np.prod(shape)),), lambda a: a.reshape(shape), lambda a: a.reshape(-1))


def _norm(cfg_norm: str, hf: str, path: tuple[str, ...], d: int) -> list[VisionEntry]:
    out = [_same(f"{hf}.weight", path + ("scale",), (d,))]
    if cfg_norm == "layernorm":
        out.append(_same(f"{hf}.bias", path + ("bias",), (d,)))
    return out


def _dense(hf: str, path: tuple[str, ...], shape: Shape, bias: bool, bias_dims: int = 1) -> list[VisionEntry]:
    out = [_linear(f"{hf}.weight", path + ("kernel",), shape)]
    if bias:
        out.append(_bias(f"{hf}.bias", path + ("bias",), shape[-bias_dims:]))
    return out


def _block(cfg: VisionConfig, i: int) -> list[VisionEntry]:
    hf, p = f"vision_tower.encoder.blocks.{i}.", ("vision_tower", "encoder", f"blocks_{i}")
    W, H, K, F = cfg.hidden, cfg.num_heads, cfg.head_dim, cfg.mlp_dim
    return (_norm(cfg.norm, f"{hf}norm0", p + ("norm0",), W) + _norm(cfg.norm, f"{hf}norm1", p + ("norm1",), W)
            + _dense(f"{hf}wqkv", p + ("wqkv",), (W, 3, H, K), cfg.bias, 3)
            + _dense(f"{hf}wo", p + ("wo",), (H, K, W), cfg.bias)
            + _dense(f"{hf}mlp.fc0", p + ("fc0",), (W, F), cfg.bias)
            + _dense(f"{hf}mlp.fc1", p + ("fc1",), (F, W), cfg.bias))


def vision_entries(cfg: VisionConfig, text_hidden: int) -> list[VisionEntry]:
    """Every tensor of the tower and projector, in checkpoint order."""
    W, P, C, p = cfg.hidden, cfg.patch_features, cfg.channels, cfg.patch_size
    pe = ("vision_tower", "patch_embed")
    out = [VisionEntry("vision_tower.patch_embed.proj.weight", pe + ("proj", "kernel"), (P, W), (W, C, p, p),
                       lambda a: a.reshape(W, P).T, lambda a: a.T.reshape(W, C, p, p))]
    if cfg.patch_bias:
        out.append(_same("vision_tower.patch_embed.proj.bias", pe + ("proj", "bias"), (W,)))
    out.append(_same("vision_tower.patch_embed.pos_emb.weight", pe + ("pos_emb",), cfg.pos_grid + (W,)))
    for i in range(cfg.num_layers):
        out += _block(cfg, i)
    out += _norm(cfg.norm, "vision_tower.encoder.final_layernorm", ("vision_tower", "encoder", "final_layernorm"), W)
    F, v2, mp = cfg.merged_width, cfg.projector == "patchmergerv2", ("mm_projector",)
    if not v2:
        out += _norm("layernorm", "mm_projector.pre_norm", mp + ("pre_norm",), W)
    out += _dense("mm_projector.proj.0", mp + ("proj_0",), (F, F), not v2)
    out += _dense("mm_projector.proj.2", mp + ("proj_2",), (F, text_hidden), not v2)
    if v2:
        out += _norm("rmsnorm", "mm_projector.post_norm", mp + ("post_norm",), text_hidden)
    return out


VISION_PREFIXES = ("vision_tower.", "mm_projector.")


def to_hf_vision_config(cfg: VisionConfig, text_hidden: int) -> dict:
    """``vision_config`` in the field names of the K3 release (the tiny oracle's config.json)."""
    return {
        "patch_size": cfg.patch_size, "vt_hidden_size": cfg.hidden, "vt_num_hidden_layers": cfg.num_layers,
        "vt_num_attention_heads": cfg.num_heads, "qkv_hidden_size": cfg.qkv_width,
        "vt_intermediate_size": cfg.mlp_dim, "norm_type": cfg.norm, "linear_bias": cfg.bias, "attn_bias": cfg.bias,
        "patch_embed_proj_bias": cfg.patch_bias, "init_pos_emb_height": cfg.pos_grid[0],
        "init_pos_emb_width": cfg.pos_grid[1], "init_pos_emb_time": cfg.pos_time,
        "pos_emb_interpolation_mode": cfg.interpolation, "pos_emb_type": "divided_fixed",
        "merge_kernel_size": list(cfg.merge), "merge_type": "sd2_tpool", "mlp_type": "mlp2",
        "activation_func": "gelu_pytorch_tanh", "projector_hidden_act": "gelu",
        "mm_projector_type": cfg.projector, "mm_hidden_size": cfg.hidden, "projector_ln_eps": cfg.projector_eps,
        "text_hidden_size": text_hidden,
    }


def _expect(d: dict, key: str, allowed: tuple) -> None:
    if key in d and d[key] not in allowed:
        raise ValueError(f"vision_config.{key}={d[key]!r} must be one of {allowed}")


def from_hf_vision_config(d: dict, name: str = "hf") -> VisionConfig:
    """A ``VisionConfig`` from a ``vision_config`` dict (K3 field names; K2.5's plain names accepted)."""
    def get(*keys, default=None):
        for k in keys:
            if k in d and d[k] is not None:
                return d[k]
        if default is None:
            raise ValueError(f"vision_config needs one of {keys}")
        return default

    _expect(d, "merge_type", ("sd2_tpool",))
    _expect(d, "pos_emb_type", ("divided_fixed",))
    _expect(d, "activation_func", ("gelu_pytorch_tanh",))
    hidden = get("vt_hidden_size", "hidden_size")
    heads = get("vt_num_attention_heads", "num_attention_heads")
    norm = get("norm_type", default="layernorm")
    bias = bool(get("linear_bias", default=True))
    if bool(get("attn_bias", default=bias)) != bias:
        raise ValueError(f"vision_config.attn_bias={d['attn_bias']!r} must equal linear_bias={bias!r} "
                         "(one bias switch)")
    return VisionConfig(
        name=name, hidden=hidden, num_layers=get("vt_num_hidden_layers", "num_hidden_layers"), num_heads=heads,
        head_dim=get("qkv_hidden_size", default=hidden) // heads,
        mlp_dim=get("vt_intermediate_size", "intermediate_size"),
        patch_size=get("patch_size"), norm=norm, norm_eps=FP32_EPS if norm == "rmsnorm" else 1e-5, bias=bias,
        patch_bias=bool(get("patch_embed_proj_bias", default=True)),
        pos_grid=(get("init_pos_emb_height"), get("init_pos_emb_width")), pos_time=get("init_pos_emb_time", default=4),
        interpolation=get("pos_emb_interpolation_mode", default="bicubic"), merge=tuple(get("merge_kernel_size")),
        projector=get("mm_projector_type", default="patchmerger"), projector_eps=get("projector_ln_eps", default=1e-5))


def media_token_id(config: dict) -> int:
    return int(config.get("media_placeholder_token_id", MEDIA_PAD_ID))
