"""QK-Clip for MLA (MuonClip, Kimi K2 report arXiv 2507.20534 §2.1; SPEC §7).

After each optimizer step, per MLA layer and head h, with S_h the largest pre-softmax logit the
forward pass saw (``stats layers_{i}/mla/max_logit [H]``; ``[R, H]`` per offset of the scanned stack):
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


def max_logits_from_stats(stats: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Float[Array, "... H"]]:
    """``{path of the MLA module: max_logit [H]}`` (``[R, H]`` for an offset of the scanned stack) from a
    ``stats`` tree (values sown as 1-tuples).

    The path addresses the MLA's parameters in the params tree of the same structure, e.g.
    ``("layers_3", "mla")``.
    """
    out = {}
    for name, child in stats.items():
        if name == "max_logit":
            values = child if isinstance(child, tuple) else (child,)
            out[prefix] = jnp.max(jnp.stack(values), axis=0)
        elif isinstance(child, dict):
            out.update(max_logits_from_stats(child, prefix + (name,)))
    return out


def clip_factors(max_logit: Float[Array, "... H"], tau: float) -> Float[Array, "... H"]:
    """γ_h = min(1, τ / S_h), written so that S_h ≤ 0 (or ≤ τ) gives exactly 1."""
    s = max_logit.astype(jnp.float32)
    return jnp.where(s > tau, tau / jnp.maximum(s, tau), 1.0)


def _scale_heads(kernel, first: Float[Array, "*R H"], second: Float[Array, "*R H"], split: int):
    """Scale ``kernel[..., h, :split]`` by first[h] and ``kernel[..., h, split:]`` by second[h]; in the
    scanned stack ``kernel [R, in, H, W]`` and the factors ``[R, H]`` carry the layer axis first."""
    width = kernel.shape[-1]
    cols = jnp.arange(width) < split  # [W]
    scale = jnp.where(cols, first[..., None], second[..., None])  # [*R, H, W]
    return (kernel.astype(jnp.float32) * jnp.expand_dims(scale, -3)).astype(kernel.dtype)


def _clip_mla(mla: dict, gamma: Float[Array, "... H"], dn: int) -> dict:
    root, ones = jnp.sqrt(gamma), jnp.ones_like(gamma)
    mla = dict(mla)
    q_name = "q_b" if "q_b" in mla else "q_proj"
    mla[q_name] = {**mla[q_name], "kernel": _scale_heads(mla[q_name]["kernel"], root, gamma, dn)}
    mla["kv_b"] = {**mla["kv_b"], "kernel": _scale_heads(mla["kv_b"]["kernel"], root, ones, dn)}
    return mla


def _replace_at(tree: dict, path: tuple[str, ...], fn) -> dict:
    if not path:
        return fn(tree)
    if not isinstance(tree, dict) or path[0] not in tree:
        raise ValueError(f"QK-Clip: max_logit reported for {path} but params have no such module")
    return {**tree, path[0]: _replace_at(tree[path[0]], path[1:], fn)}


def qk_clip(params: Any, max_logits: dict[tuple[str, ...], Float[Array, "... H"]], mla: MLAConfig,
            tau: float) -> tuple[Any, dict[tuple[str, ...], Float[Array, "... H"]]]:
    """Params with every reported MLA module clipped, and the applied γ per module (1 = untouched)."""
    gammas = {}
    for path, s in max_logits.items():
        gammas[path] = clip_factors(s, tau)
        params = _replace_at(params, path, lambda m, g=gammas[path]: _clip_mla(m, g, mla.qk_nope_head_dim))
    return params, gammas
