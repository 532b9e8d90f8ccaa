"""QK-Clip for MLA (MuonClip, Kimi K2 report arXiv 2507.20534 §2.1; SPEC §7).

After each optimizer step, per MLA layer and head h, with S_h the largest pre-softmax logit the
forward pass saw (``stats layers_{i}/mla/max_logit [H]``):
  1. γ_h = min(1, τ / S_h)  (heads with S_h ≤ τ keep γ_h = 1);
  2. the head's q_nope and k_nope columns are scaled by √γ_h and its q_rope columns by γ_h, so every
     logit of the head, q_nope·k_nope + q_rope·k_rope, scales by exactly γ_h;
  3. the rope key is shared by all heads and lives in ``kv_a``: it is left untouched.
Values (the ``[dn:]`` half of ``kv_b``) and the optimizer state are not touched.

Weight layout (``docs/params.md``): ``q_b [Rq, H, dn+dr]`` (or ``q_proj [D, H, dn+dr]`` without
q_lora), ``kv_b [Rkv, H, dn+dv]`` with per head ``[:dn]`` k_nope and ``[dn:]`` v.
"""

from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, Float

from k3jax.config import MLAConfig


def max_logits_from_stats(stats: Any) -> dict[str, Float[Array, "H"]]:
    """``{"layers_{i}": max_logit [H]}`` from the model's ``stats`` collection (sown as 1-tuples)."""
    out = {}
    for name, layer in stats.items():
        mla = layer.get("mla", {}) if isinstance(layer, dict) else {}
        if "max_logit" in mla:
            value = mla["max_logit"]
            out[name] = value[0] if isinstance(value, tuple) else value
    return out


def clip_factors(max_logit: Float[Array, "H"], tau: float) -> Float[Array, "H"]:
    """γ_h = min(1, τ / S_h), written so that S_h ≤ 0 (or ≤ τ) gives exactly 1."""
    s = max_logit.astype(jnp.float32)
    return jnp.where(s > tau, tau / jnp.maximum(s, tau), 1.0)


def _scale_heads(kernel, first: Float[Array, "H"], second: Float[Array, "H"], split: int):
    """Scale ``kernel[..., h, :split]`` by first[h] and ``kernel[..., h, split:]`` by second[h]."""
    width = kernel.shape[-1]
    cols = jnp.arange(width) < split  # [W]
    scale = jnp.where(cols[None, :], first[:, None], second[:, None])  # [H, W]
    return (kernel.astype(jnp.float32) * scale).astype(kernel.dtype)


def qk_clip(params: Any, max_logits: dict[str, Float[Array, "H"]], mla: MLAConfig,
            tau: float) -> tuple[Any, dict[str, Float[Array, "H"]]]:
    """Rescaled params and the applied γ per MLA layer (1 for unclipped heads)."""
    dn = mla.qk_nope_head_dim
    params = dict(params)
    gammas = {}
    for layer, s in max_logits.items():
        if layer not in params or "mla" not in params[layer]:
            raise ValueError(f"max_logits names layer {layer!r} but params have no {layer}/mla")
        gamma = clip_factors(s, tau)
        root = jnp.sqrt(gamma)
        attn = dict(params[layer]["mla"])
        q_name = "q_b" if "q_b" in attn else "q_proj"
        attn[q_name] = {**attn[q_name], "kernel": _scale_heads(attn[q_name]["kernel"], root, gamma, dn)}
        ones = jnp.ones_like(gamma)
        attn["kv_b"] = {**attn["kv_b"], "kernel": _scale_heads(attn["kv_b"]["kernel"], root, ones, dn)}
        params[layer] = {**params[layer], "mla": attn}
        gammas[layer] = gamma
    return params, gammas
