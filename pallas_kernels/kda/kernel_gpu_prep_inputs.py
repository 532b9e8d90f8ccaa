"""The prep kernels' inputs, laid out in XLA: chunk-padded token-major q/k/v and g, the per-chunk row
vectors, and for the backward kernels the chunk-local cumsum G, its anchors and the masked chunk decay.
Shared by :mod:`kernel_gpu_prep` (forward) and the prep backward kernels."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.kda.kernel_gpu_intra import SUB, document_masks

BF16 = jnp.bfloat16
F32 = jnp.float32
CHUNK = 64


def _kernel_inputs(q, k, v, g, beta, sidx):
    """:func:`prep_fwd`'s inputs (token-major bf16 q/k/v and f32 g padded to whole chunks,
    head-major row vectors) and, for d's mask, whether each chunk's last row is fresh [B,N]."""
    B, T, H, K = k.shape
    C = CHUNK
    n = -(-T // C)
    pad = n * C - T
    padded = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) if pad else x
    q, k, v = (padded(x).astype(BF16) for x in (q, k, v))
    seg, fresh, to_end = document_masks(sidx, C)  # [B,N,C]
    per_head = lambda x: jnp.broadcast_to(x.reshape(B, 1, n * C), (B, H, n * C)).astype(F32)
    b = jnp.moveaxis(padded(beta.astype(F32)), 2, 1)  # [B,H,Tp]
    vecs = jnp.stack([b, per_head(fresh), per_head(to_end), per_head(seg), per_head(seg)], axis=2)
    return q, k, v, padded(g.astype(F32)), vecs.reshape(B * H, 5, n * C), fresh[:, :, -1]


def _masked_decay(decay, fresh_last):
    """``d``: the chunk decay ``[B*H,N,K]`` where the chunk's last row is fresh ``[B,N]``, else 0."""
    H = decay.shape[0] // fresh_last.shape[0]
    return jnp.where(jnp.repeat(fresh_last, H, axis=0)[..., None], decay, 0.0)


def _cumsum_anchors(g_p):
    """The backward kernels' G ``[B,Tp,H,K]`` (chunk-local cumsum of the padded f32 g) and anchors
    ``[B,N*8,H,K]`` (rows 0-3: G at each tile's first row, row 4: G at the chunk's last row), in XLA."""
    B, Tp, H, K = g_p.shape
    C = CHUNK
    n = Tp // C
    G = jnp.cumsum(g_p.reshape(B, n, C, H, K), axis=2)  # [B,N,C,H,K]
    anchors = jnp.concatenate(
        [G[:, :, ::SUB], G[:, :, -1:], jnp.zeros((B, n, 8 - C // SUB - 1, H, K), F32)], axis=2
    )
    return G.reshape(B, Tp, H, K), anchors.reshape(B, n * 8, H, K)


def _bwd_inputs(q, k, v, g, beta, sidx):
    """The backward kernels' inputs, all in XLA: ``(q, k, v, G, anchors, vecs, d)``."""
    q, k, v, g_p, vecs, fresh_last = _kernel_inputs(q, k, v, g, beta, sidx)
    G, anchors = _cumsum_anchors(g_p)
    B, Tp, H, K = G.shape
    decay = jnp.exp(jnp.moveaxis(G.reshape(B, Tp // CHUNK, CHUNK, H, K)[:, :, -1], 2, 1))  # [B,H,N,K]
    return q, k, v, G, anchors, vecs, _masked_decay(decay.reshape(B * H, -1, K), fresh_last)
