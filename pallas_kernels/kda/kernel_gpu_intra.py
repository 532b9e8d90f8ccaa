"""KDA intra-chunk preparation for the GPU chunk scan (SPEC §2, chunkwise form), in XLA.

Everything here is parallel over chunks; only the inter-chunk recurrence is sequential, and that
is the Pallas kernel (:mod:`pallas_kernels.kda.kernel_gpu`). Per chunk of C tokens, with G the
inclusive in-chunk cumsum of g (fp32, never reset at documents):

1. Sub-tile anchors: the 16-token tile holding row i is anchored at its *first* row ``a``, so
   ``exp(G_i - a) <= 1`` (a causal anchor; a mid-tile anchor would let rounding read future gates).
   Columns get ``exp(a - G_j)``, only for tiles up to the row's own (later ones are never
   exponentiated); with the gate bounded below by -5 the diagonal tile's factors stay within
   ``e^{±75}`` (fp32 range), so ``A_kk`` and ``A_qk`` are dense matmuls, not a per-token walk.
2. ``A_kk[i,j] = beta_i sum_c k_ic k_jc e^{G_ic-G_jc}`` (j < i, same document) and
   ``A_qk[i,j] = scale sum_c q_ic k_jc e^{G_ic-G_jc}`` (j <= i, same document).
3. ``T = (I + A_kk)^{-1}`` applied by block forward substitution over the 16-token tiles (each
   diagonal tile inverted by the product form ``(I-L)(I+L^2)(I+L^4)(I+L^8)``, L nilpotent), so
   the solve and its gradient are small batched matmuls rather than a batched triangular solve:
   ``U = T(beta v)``, ``W = T(beta k e^G)`` (rows cut off from the entering state by a document
   start are zeroed).
4. ``qg = scale q e^G`` (same rows zeroed), ``kg = k e^{G_last - G}`` (only tokens whose write
   survives to the chunk end) and ``d = e^{G_last}`` (0 when a document starts in the chunk).

Outputs are head-major ``[B*H, T_pad, ·]`` fp32 so the kernel reads one contiguous slab per head;
gradients come from JAX autodiff of this function.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from pallas_kernels.kda.reference import segment_index

SUB = 16  # sub-tile length: 16 tokens x (-5) = -80 stays inside fp32 exp range
PRECISIONS = {"highest": lax.Precision.HIGHEST, "tf32": lax.Precision.DEFAULT}


def _head_major(x, n: int, c: int):
    """``[B,T_pad,H,...] -> [B,H,N,C,...]`` in fp32."""
    B, _, H = x.shape[:3]
    x = x.astype(jnp.float32).reshape((B, n, c, H) + x.shape[3:])
    return jnp.moveaxis(x, 3, 1)


def _anchored_scores(q, k, G, sub: int, einsum):
    """Unmasked ``(sum_c q_i k_j e^{G_i-G_j}, same for k)`` for j in tiles up to i's: [B,H,N,C,C].

    Row tile t only reads columns of tiles <= t (later ones are sliced away, never exponentiated),
    which also keeps the column-factor tensors at 10/16 of a full 4 x C replication.
    """
    *lead, C, K = G.shape
    s_qk, s_kk = [], []
    for t in range(C // sub):
        rows, cols = slice(t * sub, (t + 1) * sub), (t + 1) * sub
        anchor = G[..., t * sub : t * sub + 1, :]  # causal anchor: the tile's first row
        row = jnp.exp(G[..., rows, :] - anchor)  # <= 1
        kc = k[..., :cols, :] * jnp.exp(anchor - G[..., :cols, :])  # <= e^{75} with the -5 bound
        pad = [(0, 0)] * len(lead) + [(0, 0), (0, C - cols)]
        s_qk.append(jnp.pad(einsum("...uc,...jc->...uj", q[..., rows, :] * row, kc), pad))
        s_kk.append(jnp.pad(einsum("...uc,...jc->...uj", k[..., rows, :] * row, kc), pad))
    return jnp.concatenate(s_qk, axis=-2), jnp.concatenate(s_kk, axis=-2)


def _solve_unit_lower(a, rhs, sub: int, einsum):
    """``(I + a)^{-1} rhs`` for strictly lower-triangular ``a [..., C, C]``, by ``sub``-row tiles."""
    C = a.shape[-1]
    nt = C // sub
    tiles = a.reshape(*a.shape[:-2], nt, sub, nt, sub)
    diag = jnp.stack([tiles[..., t, :, t, :] for t in range(nt)], axis=-3)  # [..., nt, sub, sub]
    eye = jnp.eye(sub, dtype=a.dtype)
    inv, power = eye - diag, diag
    for _ in range(3):  # (I + L)^{-1} = (I - L)(I + L^2)(I + L^4)(I + L^8) since L^16 = 0
        power = einsum("...ij,...jk->...ik", power, power)
        inv = inv + einsum("...ij,...jk->...ik", inv, power)
    solved = []
    for t in range(nt):
        r = rhs[..., t * sub:(t + 1) * sub, :]
        if t:
            r = r - einsum("...ij,...jv->...iv", a[..., t * sub:(t + 1) * sub, : t * sub],
                            jnp.concatenate(solved, axis=-2))
        solved.append(einsum("...ij,...jv->...iv", inv[..., t, :, :], r))
    return jnp.concatenate(solved, axis=-2)


def prepare(q, k, v, g, beta, *, scale: float, segment_ids, chunk: int, precision: str = "highest"):
    """``(w, u, qg, kg, aqk, d)``: head-major fp32 chunk operands of the inter-chunk scan.

    Shapes: w, qg, kg ``[B*H, Tp, K]``; u ``[B*H, Tp, V]``; aqk ``[B*H, Tp, C]``; d ``[B*H, N, K]``.
    ``precision`` of the fp32 matmuls: ``"highest"`` (full fp32) or ``"tf32"`` (tensor-core TF32
    operands on GPUs that have it, fp32 accumulation; plain fp32 on CPU).
    """
    B, T = k.shape[:2]
    return prepare_from_index(q, k, v, g, beta, segment_index(segment_ids, B, T), scale=scale, chunk=chunk,
                              precision=precision)


def document_masks(sidx, chunk: int):
    """Padded document index ``[B,N,C]`` and the per-row masks ``fresh``, ``to_end`` (bool ``[B,N,C]``)."""
    B, T = sidx.shape
    n = -(-T // chunk)
    sprev = jnp.concatenate([jnp.zeros((B, 1), sidx.dtype), sidx[:, :-1]], axis=1)[:, ::chunk]
    sidx = jnp.pad(sidx, [(0, 0), (0, n * chunk - T)], mode="edge").reshape(B, n, chunk)
    fresh = sidx == sprev[..., None]  # row still sees the state entering the chunk
    to_end = sidx == sidx[..., -1:]  # row's write survives to the chunk end
    return sidx, fresh, to_end


def prepare_from_index(q, k, v, g, beta, sidx, *, scale: float, chunk: int, precision: str = "highest"):
    """:func:`prepare` with the running document index ``sidx [B,T]`` already computed."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    einsum = functools.partial(jnp.einsum, precision=PRECISIONS[precision])
    B, T, H, K = k.shape
    V = v.shape[-1]
    n = -(-T // chunk)
    pad = n * chunk - T
    sidx, fresh, to_end = document_masks(sidx, chunk)
    sidx = sidx[:, None]  # [B,1,N,C]
    fresh, to_end = fresh[:, None, ..., None], to_end[:, None, ..., None]  # [B,1,N,C,1]
    # Padded tokens (k = v = beta = g = 0) leave the state unchanged.
    padded = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    q, k, v, g = (_head_major(padded(x), n, chunk) for x in (q, k, v, g))
    b = _head_major(padded(beta), n, chunk)[..., None]  # [B,H,N,C,1]

    G = jnp.cumsum(g, axis=-2)
    a_qk, a_kk = _anchored_scores(q, k, G, SUB, einsum)
    same = sidx[..., :, None] == sidx[..., None, :]  # [B,1,N,C,C]
    causal = same & jnp.tril(jnp.ones((chunk, chunk), bool))
    strict = causal & ~jnp.eye(chunk, dtype=bool)
    a_qk = jnp.where(causal, scale * a_qk, 0.0)
    a_kk = jnp.where(strict, b * a_kk, 0.0)

    rhs = jnp.concatenate([b * v, jnp.where(fresh, b * k * jnp.exp(G), 0.0)], axis=-1)
    sol = _solve_unit_lower(a_kk, rhs, SUB, einsum)
    u, w = sol[..., :V], sol[..., V:]

    G_last = G[..., -1:, :]  # [B,H,N,1,K]
    kg = jnp.where(to_end, k * jnp.exp(G_last - G), 0.0)
    qg = jnp.where(fresh, scale * q * jnp.exp(G), 0.0)
    d = jnp.where(fresh[..., -1:, :], jnp.exp(G_last), 0.0)[..., 0, :]  # [B,H,N,K]

    flat = lambda x: x.reshape(B * H, n * chunk, x.shape[-1])
    return flat(w), flat(u), flat(qg), flat(kg), flat(a_qk), d.reshape(B * H, n, K)
