"""Exact MLA attention of one shard's queries over the gathered latent, key block by key block, in XLA.

Context parallel's XLA path (TPU, and CPU tests; :mod:`sharding.cp_attention`) has every shard
attend with its ``T`` queries over all ``S`` keys of the row. Done densely it holds the per-head
keys and values ``[B, S, H, dn+dv]`` and logits ``[B, H, T, S]``: for K3 at a 1 M-token context
on 128 shards, 100 GB of fp32 keys and 3 TB of logits per sequence. Here the loop runs over blocks
of ``key_block`` keys with an online softmax (FlashAttention-2, arXiv:2307.08691, written in
``jnp``): each block expands its slice of the latent ``[c, k_rope]`` into per-head keys and values
with ``kv_b``, so at most one block of expanded keys and one ``[B, H, T, key_block]`` block of
logits exist at a time. Blocks past the shard's last query (``q_start + T``) are skipped, not
masked: the loop's trip count is traced.

The backward pass is the same loop again (``jax.custom_vjp``): it recomputes each block's keys
and probabilities from the saved ``logsumexp`` and accumulates ``dq`` and the latent's, rope key's
and ``kv_b``'s gradients; nothing of size ``S × T`` is saved. Numerics: the logits, softmax and
outputs are in ``q``'s dtype (the model's fp32), like the dense path this replaces.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

# Bytes of one fp32 block of logits [B, H, T, key_block] the automatic block size aims under.
_LOGITS_BUDGET = 1 << 30


def key_block_for(batch: int, heads: int, queries: int, keys: int, itemsize: int = 4) -> int:
    """The largest power-of-two block (128 … 2048 keys where ``keys`` allows) dividing ``keys`` whose
    logits block stays under ``_LOGITS_BUDGET`` (one such block: 128 keys, whatever the budget)."""
    block = 2048
    while block > 128 and batch * heads * queries * block * itemsize > _LOGITS_BUDGET:
        block //= 2
    while keys % block:  # also shrinks a block longer than the keys
        block //= 2
    return block


def _expand(c_blk, kr_blk, kv_b, nope_dim, dt):
    """One block's per-head ``k_nope [B,K,H,dn]``, shared ``k_rope [B,K,dr]`` and ``v [B,K,H,dv]``."""
    kv = jnp.einsum("BSR,RHK->BSHK", c_blk, kv_b.astype(c_blk.dtype)).astype(dt)
    return kv[..., :nope_dim], kr_blk.astype(dt), kv[..., nope_dim:]


def _block(args, i, key_block, nope_dim, scale):
    """Block ``i``: its operands (for the VJP of the expansion), masked logits ``[B,H,T,K]``, mask."""
    q, c, k_rope, kv_b, q_seg, k_seg, q_start = args
    sl = lambda x: lax.dynamic_slice_in_dim(x, i * key_block, key_block, axis=1)
    c_blk, kr_blk = sl(c), sl(k_rope)
    kn, kr, v = _expand(c_blk, kr_blk, kv_b, nope_dim, q.dtype)
    logits = (jnp.einsum("BTHN,BSHN->BHTS", q[..., :nope_dim], kn)
              + jnp.einsum("BTHR,BSR->BHTS", q[..., nope_dim:], kr)) * scale
    q_pos = q_start + jnp.arange(q.shape[1])
    k_pos = i * key_block + jnp.arange(key_block)
    mask = (q_pos[:, None] >= k_pos[None]) & (q_seg[:, :, None] == sl(k_seg)[:, None, :])  # [B, T, K]
    return (c_blk, kr_blk, kn, kr, v), jnp.where(mask[:, None], logits, -jnp.inf), mask


def _num_blocks(q_start, queries: int, keys: int, key_block: int):
    """Blocks holding a key some query can see: up to the one holding position ``q_start + T - 1``."""
    return jnp.minimum((q_start + queries - 1) // key_block + 1, keys // key_block)


def _forward(args, key_block, nope_dim, scale):
    q = args[0]
    B, T, H = q.shape[:3]
    dv = args[3].shape[-1] - nope_dim

    def body(i, carry):
        m, l, acc = carry  # running max [B,H,T], normaliser [B,H,T], unnormalised output [B,T,H,dv]
        (_, _, _, _, v), logits, _ = _block(args, i, key_block, nope_dim, scale)
        m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
        base = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row with nothing visible yet
        p = jnp.exp(logits - base[..., None])
        fix = jnp.exp(m - base)
        acc = acc * jnp.moveaxis(fix, 1, 2)[..., None] + jnp.einsum("BHTS,BSHV->BTHV", p, v)
        return m_new, l * fix + jnp.sum(p, axis=-1), acc

    init = (jnp.full((B, H, T), -jnp.inf, q.dtype), jnp.zeros((B, H, T), q.dtype), jnp.zeros((B, T, H, dv), q.dtype))
    m, l, acc = lax.fori_loop(0, _num_blocks(args[6], T, args[1].shape[1], key_block), body, init)
    o = acc / jnp.moveaxis(l, 1, 2)[..., None]  # every query sees itself: l > 0
    return o, m, m + jnp.log(l)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _attention(q, c, k_rope, kv_b, q_seg, k_seg, q_start, key_block, nope_dim, scale):
    o, row_max, _ = _forward((q, c, k_rope, kv_b, q_seg, k_seg, q_start), key_block, nope_dim, scale)
    return o, row_max


def _attention_fwd(q, c, k_rope, kv_b, q_seg, k_seg, q_start, key_block, nope_dim, scale):
    args = (q, c, k_rope, kv_b, q_seg, k_seg, q_start)
    o, row_max, lse = _forward(args, key_block, nope_dim, scale)
    return (o, row_max), (args, o, lse)


def _attention_bwd(key_block, nope_dim, scale, res, cotangents):
    args, o, lse = res
    q, c, k_rope, kv_b, _, _, q_start = args
    do = cotangents[0].astype(q.dtype)  # the row max is a statistic: no gradient
    delta = jnp.einsum("BTHV,BTHV->BHT", o, do)  # FlashAttention-2's D = rowsum(dO ⊙ O)

    def body(i, carry):
        dq, dc, dkr, dkv_b = carry
        (c_blk, kr_blk, kn, kr, v), logits, mask = _block(args, i, key_block, nope_dim, scale)
        p = jnp.where(mask[:, None], jnp.exp(logits - lse[..., None]), 0.0)  # [B, H, T, K]
        dv = jnp.einsum("BHTS,BTHV->BSHV", p, do)
        ds = p * (jnp.einsum("BTHV,BSHV->BHTS", do, v) - delta[..., None]) * scale
        dq = dq + jnp.concatenate([jnp.einsum("BHTS,BSHN->BTHN", ds, kn),
                                   jnp.einsum("BHTS,BSR->BTHR", ds, kr)], axis=-1)
        dkn = jnp.einsum("BHTS,BTHN->BSHN", ds, q[..., :nope_dim])
        dkr_blk = jnp.einsum("BHTS,BTHR->BSR", ds, q[..., nope_dim:])
        _, expand_vjp = jax.vjp(lambda cb, w: _expand(cb, kr_blk, w, nope_dim, q.dtype)[::2], c_blk, kv_b)
        dc_blk, dw = expand_vjp((dkn, dv))
        put = lambda full, blk: lax.dynamic_update_slice_in_dim(full, blk.astype(full.dtype), i * key_block, axis=1)
        return dq, put(dc, dc_blk), put(dkr, dkr_blk), dkv_b + dw.astype(dkv_b.dtype)

    init = (jnp.zeros_like(q), jnp.zeros_like(c), jnp.zeros_like(k_rope), jnp.zeros(kv_b.shape, jnp.float32))
    dq, dc, dkr, dkv_b = lax.fori_loop(0, _num_blocks(q_start, q.shape[1], c.shape[1], key_block), body, init)
    return dq, dc, dkr, dkv_b.astype(kv_b.dtype), None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def latent_attention(q: Float[Array, "B T H Dq"], c: Float[Array, "B S R"], k_rope: Float[Array, "B S Dr"],
                     kv_b: Float[Array, "R H Dkv"], q_segment_ids: Int[Array, "B T"],
                     key_segment_ids: Int[Array, "B S"], q_start: int | Int[Array, ""], *, scale: float,
                     nope_dim: int, key_block: int | None = None
                     ) -> tuple[Float[Array, "B T H V"], Float[Array, "H"]]:
    """Causal same-document attention of queries at positions ``q_start + t`` over ``S`` keys given as
    the latent ``c`` and rope key ``k_rope`` (per-head ``[k_nope, v] = c · kv_b``); returns
    ``(o [B,T,H,dv] in q's dtype, max_logit [H])``, ``max_logit`` under ``stop_gradient``.

    ``q = [q_nope, q_rope]``; ``key_block`` (default :func:`key_block_for`) must divide ``S``; every
    query must see at least itself (``q_start + T <= S``, ``q_segment_ids[t] ==
    key_segment_ids[q_start + t]``), as in context parallel's shards.
    """
    B, T, H, _ = q.shape
    S = c.shape[1]
    key_block = key_block_for(B, H, T, S, jnp.dtype(q.dtype).itemsize) if key_block is None else key_block
    if S % key_block:
        raise ValueError(f"latent_attention: key_block={key_block} must divide the S={S} keys")
    o, row_max = _attention(q, c, k_rope, kv_b, q_segment_ids.astype(jnp.int32), key_segment_ids.astype(jnp.int32),
                            jnp.asarray(q_start, jnp.int32), key_block, nope_dim, float(scale))
    return o, jnp.max(lax.stop_gradient(row_max), axis=(0, 2))
