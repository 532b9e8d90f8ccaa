"""Chunkwise KDA forward as a Pallas TPU (Mosaic) kernel (SPEC §2; Kimi Linear, arXiv:2510.26692).

Grid ``(B, H, N)``: one program per chunk of C tokens, chunks walked in order ("arbitrary") with
the fp32 state ``S [K, V]`` in VMEM. Per chunk, with ``G`` the in-chunk inclusive cumsum of g:

1. Intra-chunk scores ``A_qk[i, j] = q_i . k_j e^{G_i - G_j}`` and ``A_kk`` (same with k_i):
   across sub-tiles of ``sub_tile`` rows, one MXU matmul per later tile anchored at that tile's
   first row (both exponents <= 0, safe for any gate); inside a tile, one column per step, the
   exponent masked before ``exp`` (exact for unbounded gates too). Then causal/document masks.
2. ``T = (I + A_kk)^{-1}`` without a serial solve: the block-diagonal part by the nilpotent product
   ``(I-L)(I+L^2)(I+L^4)...``, the sub-tile merge by the same product on ``N = T_d A_off``.
3. WY: ``U = T(beta v)``, ``W = T(beta k e^G)``, ``v_new = U - W S``.
4. ``o = scale (q e^G) S + A_qk v_new``; ``S <- e^{G_last} S + (k e^{G_last - G})^T v_new``.

Everything runs in fp32 on the MXU with HIGHEST precision. For training the forward also stores
each chunk's entering state; the backward kernel (:mod:`kernel_tpu_bwd`, wired in ``ops.py``)
walks the chunks in reverse from those.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from pallas_kernels import int_ops
from pallas_kernels.kda.reference import segment_index


@dataclasses.dataclass(frozen=True)
class TpuKdaTiles:
    """Tile sizes: ``chunk_size`` tokens per grid step, ``sub_tile`` rows per intra-chunk tile."""

    chunk_size: int = 64
    sub_tile: int = 16

    def __post_init__(self):
        if self.chunk_size % self.sub_tile or self.sub_tile % 8:
            raise ValueError(
                f"chunk_size={self.chunk_size} must be a multiple of sub_tile={self.sub_tile}, "
                "itself a multiple of 8"
            )


MAX_HEAD_DIM = 256  # fp32 state plus one chunk of every operand stays well inside VMEM


def supports(q, k, v, g, beta, *, initial_state=None, chunk_size: int = 64) -> bool:
    """Trace-time check: fp32/bf16 inputs, head dims <= 256, chunk % 16 == 0.

    No float64, and no float16: Mosaic TPU has no float16 vector loads (v4 to TPU7x, libtpu 0.0.48:
    "Invalid vector type for load"), which only the real compiler reports, not the interpreter.
    """
    arrays = (q, k, v, g, beta) + (() if initial_state is None else (initial_state,))
    if any(a.dtype in (jnp.float64, jnp.float16) for a in arrays):
        return False
    return q.shape[-1] <= MAX_HEAD_DIM and v.shape[-1] <= MAX_HEAD_DIM and chunk_size % 16 == 0


def dot_f32(a, b, contract=((1,), (0,))):
    """fp32 MXU matmul at HIGHEST precision, contracting ``contract`` (default ``a @ b``)."""
    return lax.dot_general(
        a, b, (contract, ((), ())), precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )


def _unit_lower_inverse(L, steps: int):
    """``(I + L)^{-1} = (I - L)(I + L^2)(I + L^4)...`` for nilpotent L with ``L^(2^steps) = 0``."""
    eye = (lax.broadcasted_iota(jnp.int32, L.shape, 0) == lax.broadcasted_iota(jnp.int32, L.shape, 1))
    eye = eye.astype(jnp.float32)
    inv, power = eye - L, L
    for _ in range(steps - 1):
        power = dot_f32(power, power)
        inv = dot_f32(inv, eye + power)
    return inv


def intra_scores(q_ref, k_ref, g_ref, aqk_ref, akk_ref, *, sub: int):
    """Unmasked ``sum_c x_ic k_jc e^{G_ic - G_jc}`` for x = q, k into VMEM, valid where j <= i."""
    C = g_ref.shape[2]
    k = k_ref[0, 0].astype(jnp.float32)
    G = g_ref[0, 0]
    aqk_ref[...] = jnp.zeros_like(aqk_ref)
    akk_ref[...] = jnp.zeros_like(akk_ref)
    for t in range(1, C // sub):  # earlier tiles, anchored at this tile's first row a
        a = t * sub
        G_a = G[a : a + 1]  # [1,K]
        k_prev = k * jnp.exp(jnp.minimum(G_a - G, 0.0))  # rows j >= a are masked out below
        rows = slice(a, a + sub)
        inner = jnp.exp(G[rows] - G_a)  # [sub,K], exponents <= 0
        earlier = lax.broadcasted_iota(jnp.int32, (sub, C), 1) < a
        q_a = q_ref[0, 0, rows, :].astype(jnp.float32) * inner
        aqk_ref[rows, :] = jnp.where(earlier, dot_f32(q_a, k_prev, ((1,), (1,))), 0.0)
        akk_ref[rows, :] = jnp.where(earlier, dot_f32(k[rows] * inner, k_prev, ((1,), (1,))), 0.0)
    col = lax.broadcasted_iota(jnp.int32, (sub, C), 1)
    row_in_tile = lax.broadcasted_iota(jnp.int32, (sub, 1), 0)

    def column(j, carry):
        a = pl.multiple_of(int_ops.div(j, sub) * sub, sub)  # j >= 0: no floor fix-up
        rows = pl.ds(a, sub)
        # Row j is picked from its aligned tile by a masked sum, not a 1-row dynamic load,
        # which packed (bf16) layouts do not allow at arbitrary offsets.
        pick = row_in_tile == j - a  # [sub,1]
        G_t = g_ref[0, 0, rows, :]
        q_t = q_ref[0, 0, rows, :].astype(jnp.float32)
        k_t = k_ref[0, 0, rows, :].astype(jnp.float32)
        G_j = jnp.sum(jnp.where(pick, G_t, 0.0), axis=0, keepdims=True)  # [1,K]
        k_j = jnp.sum(jnp.where(pick, k_t, 0.0), axis=0, keepdims=True)
        causal = row_in_tile >= j - a  # [sub,1]
        decay = jnp.where(causal, jnp.exp(jnp.where(causal, G_t - G_j, 0.0)), 0.0)
        onehot = (col == j).astype(jnp.float32)  # [sub,C]
        aqk_ref[rows, :] += jnp.sum(q_t * k_j * decay, axis=1, keepdims=True) * onehot
        akk_ref[rows, :] += jnp.sum(k_t * k_j * decay, axis=1, keepdims=True) * onehot
        return carry

    lax.fori_loop(0, C, column, 0)


def chunk_masks(sid_col_ref, sid_row_ref):
    """``(causal, strict)`` ``[C, C]`` masks: same document and ``j <= i`` (resp. ``j < i``)."""
    C = sid_col_ref.shape[1]
    row = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    col = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    same_doc = sid_col_ref[0] == sid_row_ref[0, 0]  # [C,1] == [1,C]
    return same_doc & (row >= col), same_doc & (row > col)


def chunk_solve(aqk_ref, akk_ref, sid_col_ref, sid_row_ref, beta, *, scale: float, sub: int):
    """Masked ``(a_qk, a_kk, T = (I + a_kk)^{-1})`` of one chunk from its unmasked scores."""
    C = aqk_ref.shape[0]
    row = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    col = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    causal, strict = chunk_masks(sid_col_ref, sid_row_ref)
    a_qk = jnp.where(causal, aqk_ref[...], 0.0) * scale
    a_kk = jnp.where(strict, akk_ref[...], 0.0) * beta

    same_tile = int_ops.div(row, sub) == int_ops.div(col, sub)
    t_diag = _unit_lower_inverse(jnp.where(same_tile, a_kk, 0.0), steps=(sub - 1).bit_length())
    merge = dot_f32(t_diag, jnp.where(same_tile, 0.0, a_kk))  # strictly block-lower
    t_full = dot_f32(_unit_lower_inverse(merge, steps=max(1, (C // sub - 1).bit_length())), t_diag)
    return a_qk, a_kk, t_full


def _chunk_kernel(
    q_ref, k_ref, v_ref, g_ref, beta_ref, sid_col_ref, sid_row_ref, fresh_ref, to_end_ref,
    s_decay_ref, s0_ref, o_ref, s_out_ref, *rest, scale: float, sub: int, store_states: bool,
):
    h_ref = rest[0] if store_states else None
    s_scr, aqk_ref, akk_ref = rest[int(store_states):]
    n = pl.program_id(2)
    C = g_ref.shape[2]

    @pl.when(n == 0)
    def _():
        s_scr[...] = s0_ref[0, 0].astype(jnp.float32)

    intra_scores(q_ref, k_ref, g_ref, aqk_ref, akk_ref, sub=sub)
    beta = beta_ref[0, 0]  # [C,1]
    a_qk, _, t_full = chunk_solve(aqk_ref, akk_ref, sid_col_ref, sid_row_ref, beta, scale=scale, sub=sub)

    G = g_ref[0, 0]
    fresh = fresh_ref[0]  # [C,1]: the carried state still reaches token i
    k = k_ref[0, 0].astype(jnp.float32)
    S = s_scr[...]
    if store_states:
        h_ref[0, 0, 0] = S
    u = dot_f32(t_full, beta * v_ref[0, 0].astype(jnp.float32))
    w = dot_f32(t_full, beta * k * jnp.exp(G) * fresh)
    v_new = u - dot_f32(w, S)  # [C,V]
    q_dec = q_ref[0, 0].astype(jnp.float32) * jnp.exp(G) * fresh
    o = scale * dot_f32(q_dec, S) + dot_f32(a_qk, v_new)
    o_ref[0, 0] = o.astype(o_ref.dtype)

    k_end = k * jnp.exp(G[C - 1 : C] - G) * to_end_ref[0]
    s_scr[...] = s_decay_ref[0, 0, 0] * S + dot_f32(k_end, v_new, ((0,), (0,)))

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        s_out_ref[0, 0] = s_scr[...]


def head_major(x, pad: int):
    """``[B,T,H,...] -> [B,H,T+pad,...]``; padded tokens (zeros) leave the state unchanged."""
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x, 2, 1)


def _document_masks(segment_ids, B: int, T: int, n: int, C: int):
    """Per-chunk document bookkeeping: ids as column/row, fresh and to-end masks, carry flag."""
    sidx = segment_index(segment_ids, B, T)
    sprev = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), sidx[:, :-1]], axis=1)[:, ::C]  # [B,n]
    sidx = jnp.pad(sidx, [(0, 0), (0, n * C - T)], mode="edge").reshape(B, n, C)
    fresh = sidx == sprev[..., None]  # [B,n,C]: no document start since the chunk began
    to_end = sidx == sidx[..., -1:]  # [B,n,C]: same document as the chunk's last token
    as_col = lambda x: x.reshape(B, n * C, 1)
    return as_col(sidx), sidx[:, :, None, :], as_col(fresh).astype(jnp.float32), \
        as_col(to_end).astype(jnp.float32), fresh[..., -1]


def chunk_operands(q, k, v, g, beta, segment_ids, C: int):
    """Head-major kernel operands padded to whole chunks of C: ``(q, k, v, G, beta, sid_col,
    sid_row, fresh, to_end, s_decay)``, G the in-chunk inclusive cumsum of g (fp32)."""
    B, T, H, K = q.shape
    n = -(-T // C)
    pad = n * C - T
    q_h, k_h, v_h = (head_major(x, pad) for x in (q, k, v))
    G = head_major(g.astype(jnp.float32), pad).reshape(B, H, n, C, K).cumsum(axis=3)
    s_decay = jnp.exp(G[:, :, :, -1, :])  # [B,H,n,K]
    G = G.reshape(B, H, n * C, K)
    beta_h = head_major(beta.astype(jnp.float32), pad)[..., None]  # [B,H,Tp,1]
    sid_col, sid_row, fresh, to_end, keep = _document_masks(segment_ids, B, T, n, C)
    s_decay = (s_decay * keep[:, None, :, None])[..., None]  # [B,H,n,K,1]
    return q_h, k_h, v_h, G, beta_h, sid_col, sid_row, fresh, to_end, s_decay


def chunk_specs(C: int, K: int, V: int, n: int, *, reverse: bool = False):
    """BlockSpecs of :func:`chunk_operands` for grid ``(B, H, n)``; ``reverse`` walks chunks last
    to first. Also returns ``tok(d)``, the spec of a ``[B,H,Tp,d]`` per-token array."""
    at = (lambda i: n - 1 - i) if reverse else (lambda i: i)
    tok = lambda d: pl.BlockSpec((1, 1, C, d), lambda b, h, i: (b, h, at(i), 0))
    per_batch = pl.BlockSpec((1, C, 1), lambda b, h, i: (b, at(i), 0))
    specs = [
        tok(K), tok(K), tok(V), tok(K), tok(1), per_batch,
        pl.BlockSpec((1, 1, 1, C), lambda b, h, i: (b, at(i), 0, 0)),
        per_batch, per_batch,
        pl.BlockSpec((1, 1, 1, K, 1), lambda b, h, i: (b, h, at(i), 0, 0)),
    ]
    return specs, tok


def chunk_kda_fwd(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T H V"],
    g: Float[Array, "B T H K"],
    beta: Float[Array, "B T H"],
    *,
    scale: float,
    initial_state: Float[Array, "B H K V"] | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
    chunk_size: int = 64,
    interpret: bool = False,
    tiles: TpuKdaTiles | None = None,
    return_states: bool = False,
) -> (
    tuple[Float[Array, "B T H V"], Float[Array, "B H K V"]]
    | tuple[Float[Array, "B T H V"], Float[Array, "B H K V"], Float[Array, "B H N K V"]]
):
    """Forward: ``(o in v.dtype, final_state fp32)``; same contract as ``chunk_kda_reference``.

    ``return_states=True`` also returns every chunk's entering state ``[B, H, N, K, V]`` (fp32),
    the residual of :func:`kernel_tpu_bwd.chunk_kda_bwd`. ``interpret=True`` runs the kernel in
    the TPU interpreter (``pltpu.InterpretParams``) on CPU.
    """
    tiles = tiles or TpuKdaTiles(chunk_size=chunk_size)
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = tiles.chunk_size
    n = -(-T // C)
    operands = chunk_operands(q, k, v, g, beta, segment_ids, C)
    s0 = jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)

    specs, tok = chunk_specs(C, K, V, n)
    state = pl.BlockSpec((1, 1, K, V), lambda b, h, i: (b, h, 0, 0))
    out_specs = [tok(V), state]
    out_shape = [
        jax.ShapeDtypeStruct((B, H, n * C, V), v.dtype),
        jax.ShapeDtypeStruct((B, H, K, V), jnp.float32),
    ]
    if return_states:
        out_specs.append(pl.BlockSpec((1, 1, 1, K, V), lambda b, h, i: (b, h, i, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((B, H, n, K, V), jnp.float32))
    outs = pl.pallas_call(
        functools.partial(_chunk_kernel, scale=float(scale), sub=tiles.sub_tile, store_states=return_states),
        grid=(B, H, n),
        in_specs=specs + [state],
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((K, V), jnp.float32)] + [pltpu.VMEM((C, C), jnp.float32)] * 2,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="kda_chunk_fwd_tpu",
    )(*operands, s0)
    o = jnp.moveaxis(outs[0], 1, 2)[:, :T]
    return (o, outs[1], outs[2]) if return_states else (o, outs[1])
