"""Chunkwise KDA backward as a Pallas TPU (Mosaic) kernel (SPEC §2; Kimi Linear, arXiv:2510.26692).

Grid ``(B, H, N)`` with the chunks walked last to first ("arbitrary") and the fp32 state gradient
``dS [K, V]`` in VMEM. Each step recomputes its chunk's forward operands from the inputs and the
chunk's entering state ``S`` (stored by the forward, :func:`kernel_tpu.chunk_kda_fwd`), as in
:mod:`kernel_tpu`: ``T = (I + A_kk)^{-1}``, ``u = T(beta v)``, ``w = T(beta k e^G)``,
``v_new = u - w S``, ``o = qd S + A_qk v_new``, ``S' = d S + kg^T v_new`` with ``qd = scale q e^G``,
``kg = k e^{G_last - G}``, ``d = e^{G_last}`` (rows cut off by a document start zeroed, as in the
forward). With ``do`` and ``dS`` (the gradient of ``S'``):

1. State: ``dv_new = A_qk^T do + kg dS``; ``dS <- d dS + qd^T do - w^T dv_new``; and
   ``dqd = do S^T``, ``dkg = v_new dS^T``, ``dd = rowsum(dS * S)``, ``dA_qk = do v_new^T``.
2. WY solve: ``dR = T^T [dv_new, -dv_new S^T]`` (the gradients of ``beta v`` and ``beta k e^G``)
   and ``dA_kk = -(dR_v u^T + dR_k w^T)`` on the strict, same-document lower triangle.
3. Scores ``A[i, j] = sum_c x_ic k_jc e^{G_ic - G_jc}`` (x = q, k): the row gradient
   ``dx_i = sum_j dA_ij k_j e^{G_i - G_j}`` and column gradient ``dk_j = sum_i dA_ij x_i e^{G_i - G_j}``
   with the forward's tiling (one MXU matmul per later sub-tile anchored at its first row, a masked
   per-column walk inside a tile), so every exponent is <= 0 and no ``inf`` appears for any gate.
4. ``dG`` collects ``x * dx`` minus ``k * dk_col`` and the ``e^G`` terms; ``dg_l`` is its suffix
   sum over rows of l's document, plus the prefix sum of ``dkg * kg`` (``g_l`` enters
   ``G_last - G_j`` for j < l) and ``dd * d``.

No gradient crosses a document start, not even rounding: ``d``, ``qd``, ``w`` and the masks are
the forward's, and the gate sums of step 4 only add terms of l's own document (the plain suffix
sum plus ``dG_last`` would cancel them only up to rounding). Everything runs in fp32, HIGHEST.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from pallas_kernels import int_ops
from pallas_kernels.kda.kernel_tpu import (
    TpuKdaTiles,
    chunk_masks,
    chunk_operands,
    chunk_solve,
    chunk_specs,
    dot_f32,
    head_major,
    intra_scores,
)

_T = ((0,), (0,))  # contract the leading axes: a^T b
_BT = ((1,), (1,))  # contract the trailing axes: a b^T


def _score_grads_cross(q, k, G, daqk_ref, dakk_ref, dqr_ref, dkr_ref, *, sub: int):
    """Across sub-tiles: rows of tile t against earlier columns, anchored at t's first row a.

    Writes the row gradients of tiles >= 1 (tile 0 has no earlier columns) and returns the column
    gradient ``[C, K]`` of k; ``e^{G_i - G_a}`` and ``e^{G_a - G_j}`` both have exponents <= 0.
    """
    C, K = k.shape
    dqr_ref[0:sub, :] = jnp.zeros((sub, K), jnp.float32)
    dkr_ref[0:sub, :] = jnp.zeros((sub, K), jnp.float32)
    dk_col = jnp.zeros((C, K), jnp.float32)
    for t in range(1, C // sub):
        a = t * sub
        rows = slice(a, a + sub)
        G_a = G[a : a + 1]  # [1,K]
        before = lax.broadcasted_iota(jnp.int32, (C, 1), 0) < a
        col_decay = jnp.where(before, jnp.exp(jnp.minimum(G_a - G, 0.0)), 0.0)  # [C,K]
        row_decay = jnp.exp(G[rows] - G_a)  # [sub,K]
        earlier = lax.broadcasted_iota(jnp.int32, (sub, C), 1) < a
        daq = jnp.where(earlier, daqk_ref[rows, :], 0.0)
        dak = jnp.where(earlier, dakk_ref[rows, :], 0.0)
        k_prev = k * col_decay
        dqr_ref[rows, :] = row_decay * dot_f32(daq, k_prev)
        dkr_ref[rows, :] = row_decay * dot_f32(dak, k_prev)
        to_cols = dot_f32(daq, q[rows] * row_decay, _T) + dot_f32(dak, k[rows] * row_decay, _T)
        dk_col = dk_col + col_decay * to_cols
    return dk_col


def _score_grads(q_ref, k_ref, g_ref, daqk_ref, dakk_ref, dqr_ref, dkr_ref, dkc_ref, *, sub: int):
    """Gradients of the unmasked scores ``daqk``, ``dakk`` (already masked, zero above the diagonal)
    into ``dqr`` (q rows), ``dkr`` (k rows of A_kk) and ``dkc`` (k columns of both)."""
    C = g_ref.shape[2]
    q = q_ref[0, 0].astype(jnp.float32)
    k = k_ref[0, 0].astype(jnp.float32)
    dkc_ref[...] = _score_grads_cross(q, k, g_ref[0, 0], daqk_ref, dakk_ref, dqr_ref, dkr_ref, sub=sub)
    col = lax.broadcasted_iota(jnp.int32, (sub, C), 1)
    row_in_tile = lax.broadcasted_iota(jnp.int32, (sub, 1), 0)

    def column(j, carry):  # inside j's tile: exponents masked before exp, exact for any gate
        a = pl.multiple_of(int_ops.div(j, sub) * sub, sub)
        rows = pl.ds(a, sub)
        pick = row_in_tile == j - a  # [sub,1]
        G_t = g_ref[0, 0, rows, :]
        q_t = q_ref[0, 0, rows, :].astype(jnp.float32)
        k_t = k_ref[0, 0, rows, :].astype(jnp.float32)
        G_j = jnp.sum(jnp.where(pick, G_t, 0.0), axis=0, keepdims=True)  # [1,K]
        k_j = jnp.sum(jnp.where(pick, k_t, 0.0), axis=0, keepdims=True)
        causal = row_in_tile >= j - a
        decay = jnp.where(causal, jnp.exp(jnp.where(causal, G_t - G_j, 0.0)), 0.0)  # [sub,K]
        onehot = col == j
        dq_j = jnp.sum(jnp.where(onehot, daqk_ref[rows, :], 0.0), axis=1, keepdims=True)  # [sub,1]
        dk_j = jnp.sum(jnp.where(onehot, dakk_ref[rows, :], 0.0), axis=1, keepdims=True)
        dqr_ref[rows, :] += dq_j * k_j * decay
        dkr_ref[rows, :] += dk_j * k_j * decay
        to_j = jnp.sum((dq_j * q_t + dk_j * k_t) * decay, axis=0, keepdims=True)  # [1,K]
        dkc_ref[rows, :] += jnp.where(pick, to_j, 0.0)
        return carry

    lax.fori_loop(0, C, column, 0)


def _gate_grad(dG, dkg_kg, dd, G, fresh, causal):
    """``dg [C, K]`` from the gradients of G (``dG``), of ``kg`` (as ``dkg * kg``) and of ``d``.

    g_l reaches G_i for i >= l (a suffix sum over l's own document: the terms of other documents
    cancel exactly rather than up to rounding), ``G_last - G_j`` for j < l (a prefix sum) and the
    state decay ``d = e^{G_last}`` (every l, 0 when a document starts in the chunk).
    """
    C = G.shape[0]
    row = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    col = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    d_last = jnp.exp(G[C - 1 : C]) * fresh[C - 1 : C]  # [1,K]
    own_suffix = dot_f32(causal.astype(jnp.float32), dG, _T)
    return own_suffix + dot_f32((row > col).astype(jnp.float32), dkg_kg) + dd * d_last


def _bwd_kernel(
    q_ref, k_ref, v_ref, g_ref, beta_ref, sid_col_ref, sid_row_ref, fresh_ref, to_end_ref,
    s_decay_ref, h_ref, do_ref, dsT_ref,
    dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, ds0_ref,
    ds_scr, aqk_ref, akk_ref, dqr_ref, dkr_ref, dkc_ref, *, scale: float, sub: int,
):
    step = pl.program_id(2)
    C = g_ref.shape[2]

    @pl.when(step == 0)
    def _():
        ds_scr[...] = dsT_ref[0, 0]

    intra_scores(q_ref, k_ref, g_ref, aqk_ref, akk_ref, sub=sub)
    beta = beta_ref[0, 0]  # [C,1]
    a_qk, _, t_full = chunk_solve(aqk_ref, akk_ref, sid_col_ref, sid_row_ref, beta, scale=scale, sub=sub)
    causal, strict = chunk_masks(sid_col_ref, sid_row_ref)
    G = g_ref[0, 0]
    e_G = jnp.exp(G) * fresh_ref[0]  # [C,K]: 0 on rows the entering state does not reach
    k_end = jnp.exp(G[C - 1 : C] - G) * to_end_ref[0]
    q, k, v = (r[0, 0].astype(jnp.float32) for r in (q_ref, k_ref, v_ref))
    do = do_ref[0, 0].astype(jnp.float32)
    S, dS = h_ref[0, 0, 0], ds_scr[...]
    u, w = dot_f32(t_full, beta * v), dot_f32(t_full, beta * k * e_G)
    v_new = u - dot_f32(w, S)
    qd, kg = scale * q * e_G, k * k_end

    # 1. the state recursion, then the WY solve
    dv_new = dot_f32(a_qk, do, _T) + dot_f32(kg, dS)  # [C,V]
    ds_scr[...] = s_decay_ref[0, 0, 0] * dS + dot_f32(qd, do, _T) - dot_f32(w, dv_new, _T)
    dqd, dkg = dot_f32(do, S, _BT), dot_f32(v_new, dS, _BT)  # [C,K]
    # rowsum(dS * S) as a row [1,K]: an 8-row matmul, not a sublane -> lane transpose
    dd = dot_f32(jnp.ones((8, dS.shape[1]), jnp.float32), dS * S, _BT)[0:1]
    dr_v = dot_f32(t_full, dv_new, _T)
    dr_k = -dot_f32(t_full, dot_f32(dv_new, S, _BT), _T)
    da_kk = jnp.where(strict, -(dot_f32(dr_v, u, _BT) + dot_f32(dr_k, w, _BT)), 0.0)
    rowsum = lambda x: jnp.sum(x, axis=1, keepdims=True)
    dbeta_ref[0, 0] = rowsum(dr_v * v) + rowsum(dr_k * k * e_G) + rowsum(da_kk * akk_ref[...])

    # 2. the intra-chunk scores (their raw values are no longer needed)
    aqk_ref[...] = jnp.where(causal, scale * dot_f32(do, v_new, _BT), 0.0)
    akk_ref[...] = beta * da_kk
    _score_grads(q_ref, k_ref, g_ref, aqk_ref, akk_ref, dqr_ref, dkr_ref, dkc_ref, sub=sub)
    dq = dqr_ref[...] + dqd * scale * e_G
    dk = dkr_ref[...] + dkc_ref[...] + dr_k * beta * e_G + dkg * k_end
    dq_ref[0, 0] = dq.astype(dq_ref.dtype)
    dk_ref[0, 0] = dk.astype(dk_ref.dtype)
    dv_ref[0, 0] = (beta * dr_v).astype(dv_ref.dtype)

    # 3. the gate
    dG = q * dqr_ref[...] + k * (dkr_ref[...] - dkc_ref[...]) + dr_k * beta * k * e_G + dqd * qd
    dg_ref[0, 0] = _gate_grad(dG, dkg * kg, dd, G, fresh_ref[0], causal)

    @pl.when(step == pl.num_programs(2) - 1)
    def _():
        ds0_ref[0, 0] = ds_scr[...]


def chunk_kda_bwd(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T H V"],
    g: Float[Array, "B T H K"],
    beta: Float[Array, "B T H"],
    states: Float[Array, "B H N K V"],
    do: Float[Array, "B T H V"],
    d_final: Float[Array, "B H K V"],
    *,
    scale: float,
    segment_ids: Int[Array, "B T"] | None = None,
    chunk_size: int = 64,
    interpret: bool = False,
    tiles: TpuKdaTiles | None = None,
) -> tuple[
    Float[Array, "B T H K"], Float[Array, "B T H K"], Float[Array, "B T H V"],
    Float[Array, "B T H K"], Float[Array, "B T H"], Float[Array, "B H K V"],
]:
    """Gradients ``(dq, dk, dv, dg, dbeta, d_initial_state)`` of ``chunk_kda_fwd`` given the
    cotangents ``do`` (of o) and ``d_final`` (of the final state) and the per-chunk entering
    ``states`` returned by ``chunk_kda_fwd(..., return_states=True)``.

    dq, dk, dv, dg, dbeta have the dtypes of q, k, v, g, beta; the state gradient is fp32.
    """
    tiles = tiles or TpuKdaTiles(chunk_size=chunk_size)
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = tiles.chunk_size
    n = -(-T // C)
    operands = chunk_operands(q, k, v, g, beta, segment_ids, C)
    do_h = head_major(do, n * C - T)

    specs, tok = chunk_specs(C, K, V, n, reverse=True)
    state = pl.BlockSpec((1, 1, K, V), lambda b, h, i: (b, h, 0, 0))
    chunk_state = pl.BlockSpec((1, 1, 1, K, V), lambda b, h, i: (b, h, n - 1 - i, 0, 0))
    per_token = lambda d, dt: jax.ShapeDtypeStruct((B, H, n * C, d), dt)
    dq, dk, dv, dg, dbeta, ds0 = pl.pallas_call(
        functools.partial(_bwd_kernel, scale=float(scale), sub=tiles.sub_tile),
        grid=(B, H, n),
        in_specs=specs + [chunk_state, tok(V), state],
        out_specs=[tok(K), tok(K), tok(V), tok(K), tok(1), state],
        out_shape=[
            per_token(K, q.dtype), per_token(K, k.dtype), per_token(V, v.dtype),
            per_token(K, jnp.float32), per_token(1, jnp.float32),
            jax.ShapeDtypeStruct((B, H, K, V), jnp.float32),
        ],
        scratch_shapes=[pltpu.VMEM((K, V), jnp.float32)] + [pltpu.VMEM((C, C), jnp.float32)] * 2
        + [pltpu.VMEM((C, K), jnp.float32)] * 3,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="kda_chunk_bwd_tpu",
    )(*operands, states, do_h, d_final.astype(jnp.float32))
    token_major = lambda x: jnp.moveaxis(x, 1, 2)[:, :T]
    dbeta = token_major(dbeta)[..., 0]
    return (token_major(dq), token_major(dk), token_major(dv), token_major(dg).astype(g.dtype),
            dbeta.astype(beta.dtype), ds0)
