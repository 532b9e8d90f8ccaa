"""The reference for ``kernel_gpu.mixed_matvec``: the AttnRes mix, the RMSNorm and the projection in jnp.

``x = RMSNorm(Σ_n softmax(logit)_n v_n)`` with ``logit_n = (v_n·d) / rms(v_n)`` over the sources
``v_1..v_N`` (the stored block sums, the current partial sum last; SPEC §5), the mix in float32 and
rounded to the compute dtype (``AttnResMix``), the norm in float32 and rounded (``RMSNorm``); then
``x · W`` with ``W`` stored output axis first (``[N, D]``, the decode layout) in the projection's dtype,
accumulated in float32. With a second weight the two products are a gated activation's gate and up
(the MLP's ``gate`` and ``up``): ``act(x·W_gate, x·W_up)`` in float32, rounded. The model's own
functions (``k3jax.layers.attn_res.attn_res_mix``, ``k3jax.layers.norm.rms_norm``, ``Proj``) compute
the same sums; ``tests/pallas_kernels/mix_matvec`` holds the two together.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from pallas_kernels.moe.activations import gated_activation


def mixed_input(sources: tuple, mix: tuple, mix_eps: float, scale: Float[Array, "G"], norm_eps: float,
                dtype, addends: tuple = (),
                gate: Float[Array, "T D"] | None = None) -> Float[Array, "T D"]:
    """``RMSNorm(mix(sources))`` in ``dtype``: ``sources`` ``[T, D]`` each, the partial sum last (alone:
    no mix; plus the sum of ``addends`` in its dtype); ``mix``: the pseudo-query ``w`` and the key-norm
    weight ``γ`` (none for one source); ``scale`` ``[G]`` with ``G < D``: a norm per group of ``G``
    columns; ``gate``: ``× sigmoid(gate)`` after the norm, in float32."""
    f32 = jnp.promote_types(dtype, jnp.float32)
    if addends:
        y = addends[0]
        for a in addends[1:]:
            y = y + a  # the MoE's routed + shared experts
        sources = (*sources[:-1], sources[-1] + y.astype(sources[-1].dtype))
    vs = [v.astype(f32) for v in sources]
    if len(vs) == 1:
        h = vs[0]
        G = scale.shape[0]
        if G != h.shape[-1]:  # per group (head): [T, D/G, G]
            hg = h.reshape(h.shape[0], -1, G)
            x = hg * jax.lax.rsqrt(jnp.mean(hg * hg, -1, keepdims=True) + norm_eps) * scale.astype(f32)
            return _gated(x.reshape(h.shape), gate, f32).astype(dtype)
    else:
        d = mix[1].astype(f32) * mix[0].astype(f32)  # γ ⊙ w
        logits = jnp.stack([jnp.sum(v * d, -1) * jax.lax.rsqrt(jnp.mean(v * v, -1) + mix_eps) for v in vs])
        p = jax.nn.softmax(logits, axis=0)  # [N, T]
        h = sum(p[n][:, None] * v for n, v in enumerate(vs))
        h = h.astype(dtype).astype(f32)  # the mix's output
    x = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + norm_eps) * scale.astype(f32)
    return _gated(x, gate, f32).astype(dtype)


def _gated(x, gate, f32):
    return x if gate is None else x * jax.nn.sigmoid(gate.astype(f32))


def mixed_matvec_reference(sources: tuple, mix: tuple, mix_eps: float, scale: Float[Array, "G"], norm_eps: float,
                           weights: tuple, *, dtype, proj_dtype, out_dtype=None, activation: dict | None = None,
                           epilogue: str | None = None, addends: tuple = (), gate=None) -> Float[Array, "T N"]:
    """``x · W`` (one weight ``[N, D]``; ``epilogue="sigmoid"``: its sigmoid in float32) or
    ``act(x · W_gate, x · W_up)`` (two, ``activation`` the ``gated_activation`` keywords),
    ``x = mixed_input(...)``; products in ``proj_dtype`` accumulated in float32, returned in ``out_dtype``
    (default ``proj_dtype``), the activation's result in ``dtype``."""
    x = mixed_input(sources, mix, mix_eps, scale, norm_eps, dtype, addends, gate).astype(proj_dtype)
    ys = [jnp.einsum("TD,ND->TN", x, w.astype(proj_dtype), preferred_element_type=out_dtype) for w in weights]
    if len(ys) == 1:
        y = ys[0]
        return y if epilogue is None else jax.nn.sigmoid(y.astype(jnp.float32)).astype(y.dtype)
    g, u = ys
    return gated_activation(g, u, **activation).astype(dtype)


def token_matmul_reference(x: Float[Array, "T D"], weights: tuple, out_dtype=None,
                           activation: dict | None = None) -> Float[Array, "T N"]:
    """``kernel_gpu_tokens.token_matmul``'s definition: ``x · Wᵀ`` (``W [N, D]``) summed in float32 and
    rounded once to ``out_dtype`` (default: x's), as the model's einsum; with ``(W_gate, W_up)`` both
    products rounded to x's dtype, ``gated_activation`` in float32, rounded to x's dtype."""
    ys = [jnp.einsum("td,nd->tn", x, w, preferred_element_type=jnp.float32) for w in weights]
    if activation is None:
        return ys[0].astype(out_dtype or x.dtype)
    g, u = (y.astype(x.dtype).astype(jnp.float32) for y in ys)
    return gated_activation(g, u, **activation).astype(x.dtype)


__all__ = ["mixed_input", "mixed_matvec_reference", "token_matmul_reference"]
