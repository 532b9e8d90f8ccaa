"""Context parallel's flash path over the gathered latent: the Pallas kernels key chunk by key chunk.

The flash path of :mod:`sharding.cp_attention` (CUDA GPUs) gathers only the latent ``[c, k_rope]``
of the row. Expanding it to per-head keys and values for all ``S`` keys at once costs
``S × H × (dn + dv)`` values per shard: for K3 at a 1 M-token context ``bf16[1048576, 96, 256]``,
48 GB per sequence, and the 1 M-token train step then needs 296 GB per H200. Here the keys are
taken ``key_chunk`` at a time: each chunk's slice of the latent is expanded with ``kv_b`` and the
flash forward (``ops.flash_forward``: the Mosaic GPU kernel with a float32 output where it takes
the call) attends the shard's queries over it;
the chunks' outputs combine by their log-sum-exp (the same online softmax as the kernel's key
blocks, one level up). Only the chunks up to the one holding the last query run (the loop's trip
count is traced), so a shard's work is still its causal share.

Backward (``jax.custom_vjp``) runs the kernels' FlashAttention-2 backward chunk by chunk with the
combined log-sum-exp and ``D = rowsum(dO ⊙ O)`` of the whole row — exactly the chunk's share of
the gradients — re-expands each chunk, and takes the latent's and ``kv_b``'s gradients through the
expansion; ``dq`` sums over chunks in fp32. Nothing of size ``S × H`` is saved or built.

Chunks: ``key_chunk`` divides the keys ``S`` and is a multiple of the queries' count ``T`` or a
divisor of it, and the queries' start ``q_start`` is a multiple of the smaller of the two (context
parallel: of ``T``), so no chunk starts inside the queries unless it is shorter than them. Then a
query block lying wholly before a chunk runs no key block there and is dropped from that chunk's
sum; keys of the last chunk past the last query are skipped by the kernel's causal loop bounds.
Padded keys carry the segment id ``PAD_SEGMENT``, which no real token may use.

:mod:`sharding.latent_attention` is the same computation in XLA (the TPU path) and this one's
reference in the tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from pallas_kernels.mla_attention import kernel_gpu
from pallas_kernels.mla_attention.kernel_gpu import BlockSizes
from pallas_kernels.mla_attention.ops import flash_forward, pad_axis, padded_length, pow2_width

PAD_SEGMENT = int(jnp.iinfo(jnp.int32).min)  # padded keys' document: no query's
KEY_CHUNK_CAP = 16384  # keys per chunk: bf16[16384, 96, 256] expanded = 0.8 GB for K3


def key_chunk_for(queries: int, keys: int) -> int:
    """Keys per kernel call: the largest multiple of ``queries`` up to ``KEY_CHUNK_CAP`` that divides
    ``keys``; for more queries than the cap, their largest power-of-two divisor under it (at least
    128), else all of them. Longer chunks mean fewer, fuller kernel calls (H200, K3 width, 2048
    queries over 64 K keys: see benchmarks/RESULTS.md)."""
    if queries > KEY_CHUNK_CAP:
        chunk = KEY_CHUNK_CAP
        while chunk >= 128 and queries % chunk:
            chunk //= 2
        return chunk if chunk >= 128 else queries
    multiple = KEY_CHUNK_CAP // queries
    while multiple > 1 and keys % (multiple * queries):
        multiple -= 1
    return multiple * queries


def _queries(q, q_seg, nope_dim, blocks):
    """``q_nope, q_rope`` and segment ids padded for the kernels: power-of-two widths, block rows."""
    Tp = padded_length(blocks, q.shape[1], keys=False)
    pad = lambda x, width: pad_axis(pad_axis(x, 3, width), 1, Tp)
    qn, qr = q[..., :nope_dim], q[..., nope_dim:]
    return pad(qn, pow2_width(qn.shape[-1])), pad(qr, pow2_width(qr.shape[-1])), pad_axis(q_seg, 1, Tp)


def _chunk(c, k_rope, kv_b, k_seg, j, *, key_chunk, nope_dim, blocks):
    """Chunk ``j``'s latent slice and its per-head ``k_nope, k_rope, v``, segment ids, padded for the kernels."""
    sl = lambda x: lax.dynamic_slice_in_dim(x, j * key_chunk, key_chunk, axis=1)
    c_j, kr_j, seg_j = sl(c), sl(k_rope), sl(k_seg)
    kv = jnp.einsum("BSR,RHK->BSHK", c_j, kv_b.astype(c.dtype))
    Kp = padded_length(blocks, key_chunk, keys=True)
    pad = lambda x, width: pad_axis(pad_axis(x, x.ndim - 1, width), 1, Kp)
    kn, v = kv[..., :nope_dim], kv[..., nope_dim:]
    seg_p = jnp.pad(seg_j, ((0, 0), (0, Kp - key_chunk)), constant_values=PAD_SEGMENT)
    return c_j, (pad(kn, pow2_width(nope_dim)), pad(kr_j, pow2_width(kr_j.shape[-1])), pad(v, pow2_width(v.shape[-1])),
                 seg_p)


def _trip_count(q_start, queries: int, key_chunk: int):
    """Chunks up to the one holding the last query (``q_start`` is a multiple of ``key_chunk`` or of ``queries``)."""
    return (q_start + queries + key_chunk - 1) // key_chunk


def _forward(args, statics):
    q, c, k_rope, kv_b, q_seg, k_seg, q_start = args
    key_chunk, nope_dim, scale, blocks, interpret = statics
    B, T, H, _ = q.shape
    qn, qr, q_seg_p = _queries(q, q_seg, nope_dim, blocks)
    Tp, Vp = qn.shape[1], pow2_width(kv_b.shape[-1] - nope_dim)

    def body(j, carry):
        o, lse, row_max = carry
        _, (kn, kr, v, seg_j) = _chunk(c, k_rope, kv_b, k_seg, j, key_chunk=key_chunk, nope_dim=nope_dim,
                                       blocks=blocks)
        start = jnp.broadcast_to(q_start - j * key_chunk, (B,))
        o_j, lse_j, max_j = flash_forward(qn, qr, kn, kr, v, q_seg_p, seg_j, start, scale=scale, blocks=blocks,
                                          interpret=interpret, out_dtype=jnp.float32)
        ran = lse_j > -jnp.inf  # a query block before the chunk runs no key block: 0/0 there
        new = jnp.logaddexp(lse, lse_j)
        base = jnp.where(ran | (lse > -jnp.inf), new, 0.0)
        weight = lambda x: jnp.moveaxis(jnp.exp(x - base), 1, 2)[..., None]  # [B,H,T] -> [B,T,H,1]
        o = o * weight(lse) + jnp.where(jnp.moveaxis(ran, 1, 2)[..., None], o_j, 0.0) * weight(lse_j)
        return o, new, jnp.maximum(row_max, max_j)

    rows = jnp.full((B, H, Tp), -jnp.inf, jnp.float32)
    init = (jnp.zeros((B, Tp, H, Vp), jnp.float32), rows, rows)
    o, lse, row_max = lax.fori_loop(0, _trip_count(q_start, T, key_chunk), body, init)
    return o, lse, row_max


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attention(q, c, k_rope, kv_b, q_seg, k_seg, q_start, statics):
    o, _, row_max = _forward((q, c, k_rope, kv_b, q_seg, k_seg, q_start), statics)
    return o, row_max


def _attention_fwd(q, c, k_rope, kv_b, q_seg, k_seg, q_start, statics):
    args = (q, c, k_rope, kv_b, q_seg, k_seg, q_start)
    o, lse, row_max = _forward(args, statics)
    return (o, row_max), (args, o, lse)


def _attention_bwd(statics, res, cotangents):
    (q, c, k_rope, kv_b, q_seg, k_seg, q_start), o, lse = res
    key_chunk, nope_dim, scale, blocks, interpret = statics
    B, T, H, _ = q.shape
    qn, qr, q_seg_p = _queries(q, q_seg, nope_dim, blocks)
    do = cotangents[0]  # [B, Tp, H, Vp] fp32; the row max is a statistic: no gradient
    delta = jnp.einsum("BTHV,BTHV->BHT", o, do)  # FlashAttention-2's D of the whole row
    do = do.astype(c.dtype)
    dn, dr, dv_width = nope_dim, k_rope.shape[-1], kv_b.shape[-1] - nope_dim

    def body(j, carry):
        dqn, dqr, dc, dkr, dkv_b = carry
        c_j, (kn, kr, v, seg_j) = _chunk(c, k_rope, kv_b, k_seg, j, key_chunk=key_chunk, nope_dim=nope_dim,
                                         blocks=blocks)
        start = jnp.broadcast_to(q_start - j * key_chunk, (B,))
        dqn_j, dqr_j, dkn, dkr_j, dv = kernel_gpu.flash_backward(
            qn, qr, kn, kr, v, q_seg_p, seg_j, start, do, lse, delta, scale=scale, blocks=blocks,
            interpret=interpret, dq_dtype=jnp.float32)
        dkv = jnp.concatenate([dkn[:, :key_chunk, :, :dn], dv[:, :key_chunk, :, :dv_width]], axis=-1)
        dc_j = jnp.einsum("BSHK,RHK->BSR", dkv, kv_b.astype(dkv.dtype))
        dkv_b = dkv_b + jnp.einsum("BSR,BSHK->RHK", c_j, dkv, preferred_element_type=jnp.float32)
        put = lambda full, blk: lax.dynamic_update_slice_in_dim(full, blk.astype(full.dtype), j * key_chunk, axis=1)
        dkr_j = jnp.sum(dkr_j[:, :key_chunk, :, :dr], axis=2)  # the rope key is shared by every head
        return dqn + dqn_j, dqr + dqr_j, put(dc, dc_j), put(dkr, dkr_j), dkv_b

    init = (jnp.zeros(qn.shape, jnp.float32), jnp.zeros(qr.shape, jnp.float32), jnp.zeros_like(c),
            jnp.zeros_like(k_rope), jnp.zeros(kv_b.shape, jnp.float32))
    dqn, dqr, dc, dkr, dkv_b = lax.fori_loop(0, _trip_count(q_start, T, key_chunk), body, init)
    dq = jnp.concatenate([dqn[:, :T, :, :dn], dqr[:, :T, :, :q.shape[-1] - dn]], axis=-1).astype(q.dtype)
    return dq, dc, dkr, dkv_b.astype(kv_b.dtype), None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def latent_flash(q: Float[Array, "B T H Dq"], c: Float[Array, "B S R"], k_rope: Float[Array, "B S Dr"],
                 kv_b: Float[Array, "R H Dkv"], q_segment_ids: Int[Array, "B T"], key_segment_ids: Int[Array, "B S"],
                 q_start: int | Int[Array, ""], *, scale: float, nope_dim: int, key_chunk: int | None = None,
                 blocks: BlockSizes | None = None, interpret: bool = False
                 ) -> tuple[Float[Array, "B T H V"], Float[Array, "H"]]:
    """Causal same-document attention of queries at positions ``q_start + t`` over ``S`` keys given
    as the latent ``c`` and rope key ``k_rope`` (per-head ``[k_nope, v] = c · kv_b``), by the flash
    kernels; returns ``(o [B,T,H,dv] fp32, max_logit [H])``, ``max_logit`` under ``stop_gradient``.

    ``q = [q_nope, q_rope]``, ``c``, ``k_rope`` and ``kv_b`` in the kernels' dtype (bf16/f16);
    ``key_chunk`` (default :func:`key_chunk_for`) must divide ``S`` and divide ``T`` or be a multiple of
    it; ``q_start`` must be a multiple of ``min(key_chunk, T)``; every query must see at least itself
    (``q_segment_ids[t] == key_segment_ids[q_start + t]``).
    """
    B, T, H, _ = q.shape
    S = c.shape[1]
    key_chunk = key_chunk_for(T, S) if key_chunk is None else key_chunk
    if S % key_chunk or (T % key_chunk and key_chunk % T):
        raise ValueError(f"latent_flash: key_chunk={key_chunk} must divide the S={S} keys and divide the T={T} "
                         "queries or be a multiple of them")
    blocks = (blocks or BlockSizes()).clipped(T, key_chunk)
    statics = (key_chunk, nope_dim, float(scale), blocks, interpret)
    o, row_max = _attention(q, c, k_rope, kv_b, q_segment_ids.astype(jnp.int32), key_segment_ids.astype(jnp.int32),
                            jnp.asarray(q_start, jnp.int32), statics)
    dv = kv_b.shape[-1] - nope_dim
    return o[:, :T, :, :dv], jnp.max(lax.stop_gradient(row_max)[:, :, :T], axis=(0, 2))
