"""Absorbed decode attention over MLA's compressed cache: the definition the decode kernel must match.

SPEC §3, decode: each new token's query has ``W_k`` absorbed (``q_c = q_nope·W_k``, ``[B, T, H, R]``)
and attends, with the shared rope query part ``q_r``, over the cached rows ``[c, k_r]`` (``latent [B,
S, R + dr]``) at positions ``s <= last[b, t]``: logits ``scale·(q_c·c + q_r·k_r)``, softmax in the
queries' (wide) dtype at JAX's default matmul precision (as the model's ``linear.einsum``), and the
output is the attention-weighted latent ``Σ p·c`` (the caller applies ``W_v``). Rows past the cache
see all of it. :func:`absorbed_query_reference` makes ``q_c`` and ``q_r`` from the layer's packed input
projections, as the query kernel (``kernel_gpu_query``) does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


# Cached keys per block of the decode attention (a longer cache must be a multiple of it).
KEY_BLOCK = 2048


def _cached_block(q_c, q_r, latent, first, last, scale, R):
    """Logits of the absorbed query against cache rows, masked to ``first <= s <= last[b, t]``."""
    S = latent.shape[1]
    logits = jnp.einsum("BTHR,BSR->BHTS", q_c, latent[..., :R].astype(q_c.dtype))
    logits = logits + jnp.einsum("BTHK,BSK->BHTS", q_r, latent[..., R:].astype(q_r.dtype))
    pos = first + jnp.arange(S)
    return jnp.where((pos[None, None, :] <= last[:, :, None])[:, None], logits * scale, -jnp.inf)


def _weighted_latent(p: Float[Array, "B H T S"], latent: Float[Array, "B S C"], dtype,
                     R: int) -> Float[Array, "B T H R"]:
    """``p`` applied to the latent part of the cache rows (their first ``R`` columns).

    Contracted over all ``C`` columns and sliced after: an operand sliced to ``R`` columns made XLA
    write the whole cache out in fp32 before the product (``small()`` at batch 64: 71 MB per MLA
    layer and step); each output column is the same sum either way."""
    return jnp.einsum("BHTS,BSC->BTHC", p, latent.astype(dtype))[..., :R]


def cached_attention_reference(q_c: Float[Array, "B T H R"], q_r: Float[Array, "B T H K"],
                               latent: Float[Array, "B S C"], last: Int[Array, "B T"],
                               scale: float) -> Float[Array, "B T H R"]:
    """Softmax attention of absorbed queries over the compressed cache, key position ``<= last``.

    Returns the attention-weighted latent (``W_v`` is applied by the caller). Long caches go block
    by block with an online softmax over only the blocks some query can see.
    """
    R, S = q_c.shape[-1], latent.shape[1]
    if S <= KEY_BLOCK:
        p = jax.nn.softmax(_cached_block(q_c, q_r, latent, 0, last, scale, R), axis=-1)
        return _weighted_latent(p, latent, q_c.dtype, R)
    if S % KEY_BLOCK:
        raise ValueError(f"cache length {S} must be <= {KEY_BLOCK} or a multiple of it")

    def body(i, carry):
        m, l, acc = carry  # running max [B,H,T], normaliser [B,H,T], output [B,T,H,R]
        rows = jax.lax.dynamic_slice_in_dim(latent, i * KEY_BLOCK, KEY_BLOCK, axis=1)
        logits = _cached_block(q_c, q_r, rows, i * KEY_BLOCK, last, scale, R)
        m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
        p = jnp.exp(logits - m_new[..., None])
        fix = jnp.exp(m - m_new)
        acc = acc * jnp.moveaxis(fix, 1, 2)[..., None] + _weighted_latent(p, rows, q_c.dtype, R)
        return m_new, l * fix + jnp.sum(p, axis=-1), acc

    B, T, H = q_c.shape[:3]
    # Block 0 always holds a visible key (position 0), so the running max is finite from the start.
    init = (jnp.full((B, H, T), -jnp.inf, q_c.dtype), jnp.zeros((B, H, T), q_c.dtype), jnp.zeros_like(q_c))
    num_blocks = jnp.minimum(jnp.max(last) // KEY_BLOCK + 1, S // KEY_BLOCK)  # rows past the cache see all of it
    m, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    return acc / jnp.moveaxis(l, 1, 2)[..., None]


def absorbed_query_reference(y: Float[Array, "rows N"], scale: Float[Array, "R"], w_qb: Float[Array, "R H Dq"],
                             w_kv_b: Float[Array, "Rkv H Dkv"], *, offset: int, nope_dim: int,
                             eps: float) -> tuple[Float[Array, "rows H Rkv"], Float[Array, "rows H dr"]]:
    """The decode query with ``W_k`` absorbed, at the layer's rounding points (``MLA._query``, then
    ``_attend_cached``): ``q_a = y[:, offset:offset+R]`` RMS-normed in float32 and rounded to ``W_qb``'s
    dtype, ``q = q_a·W_qb`` summed in float32 and rounded to it, then ``(q_nope·W_k, q_rope)`` in float32
    (``W_k = w_kv_b[..., :nope_dim]``)."""
    f32, dt, R = jnp.float32, w_qb.dtype, w_qb.shape[0]
    c = y[:, offset:offset + R].astype(f32)
    normed = (c * jax.lax.rsqrt(jnp.mean(jnp.square(c), axis=-1, keepdims=True) + eps) * scale.astype(f32)).astype(dt)
    q = jnp.einsum("TR,RHK->THK", normed, w_qb, preferred_element_type=f32).astype(dt).astype(f32)
    q_c = jnp.einsum("THK,RHK->THR", q[..., :nope_dim], w_kv_b[..., :nope_dim].astype(f32),
                     precision=jax.lax.Precision.HIGHEST)
    return q_c, q[..., nope_dim:]


def gated_output_reference(o: Float[Array, "B n M R"], m: Float[Array, "B n M"], l: Float[Array, "B n M"],
                           w_kv_b: Float[Array, "R H Dkv"], gate: Float[Array, "B T H dv"], *,
                           nope_dim: int) -> Float[Array, "B T H dv"]:
    """The decode output from the attention's key splits, at the layer's rounding points (the merge of
    ``kernel_gpu_decode.cached_attention_pallas``, ``W_v`` in float32 as ``MLA._attend_cached``, then
    ``gates.sigmoid_gate``), in ``gate``'s dtype."""
    B, T, H, _ = gate.shape
    top = jnp.max(m, axis=1, keepdims=True)
    w = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - top))
    latent = jnp.sum(o * w[..., None], axis=1) / jnp.sum(l * w, axis=1)[..., None]  # [B, M, R]
    latent = latent[:, :T * H].reshape(B, T, H, -1)
    v = jnp.einsum("BTHR,RHV->BTHV", latent, w_kv_b[..., nope_dim:].astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    return (v * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(gate.dtype)


__all__ = ["KEY_BLOCK", "absorbed_query_reference", "cached_attention_reference", "gated_output_reference"]
