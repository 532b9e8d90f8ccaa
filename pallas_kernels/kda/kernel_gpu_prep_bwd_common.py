"""Helpers shared by the two kernels of the split KDA prep backward (``prep_bwd="split"``).

Kernel A (:mod:`kernel_gpu_prep_bwd_split`) and kernel B (:mod:`kernel_gpu_prep_bwd_intra`)
take from here the score recompute (:func:`_scores_kk`), the score backward (:func:`_scores_bwd`),
the smem vector loaders and masks, ``APPROX`` and :func:`finish_grads`. (As
``kernel_gpu_prep_bwd.py`` it also held the one-kernel backward ``kda_prep_bwd``,
``prep_bwd="kernel"``, deleted: H200 fwd+bwd at 4,8192,32,128 44.04 ms against 27.74 with XLA
autodiff and 25.81 with the split one, since cut to 13.73; ``DESIGN_BWD.md``.)

The math, per 64-token chunk. The forward (:mod:`kernel_gpu_prep`, math in :mod:`kernel_gpu_intra`)
is, with ``L = beta_i S_kk`` (strictly lower, same document), ``T = (I + L)^{-1}``,
``X = fresh beta k e^G``, ``Y = beta v``: ``W = T X``, ``U = T Y``, ``A_qk = scale S_qk`` (causal,
same document), ``qg = fresh scale q e^G``, ``kg = to_end k e^{G_last - G}``, where
``S_ab[i,j] = sum_c a_ic b_jc e^{G_ic - G_jc}``. Given ``dW, dU, dqg, dkg, dA_qk`` the backward
recomputes ``S_kk`` and ``T`` (as the forward does) and forms

1. ``dX = T^T dW``, ``dY = T^T dU`` and ``dL = -(dX W^T + dY U^T)`` (the gradient of the inverse,
   ``-T^T dT T^T`` with ``dT = dW X^T + dU Y^T``), masked strictly lower and same document;
   ``dv = beta dY``; ``dbeta = rowsum(dL S_kk) + rowsum(dX X / beta) + rowsum(dY v)``.
2. With ``M = scale dA_qk`` or ``beta dL``: ``da_i = sum_j M_ij b_j e^{G_i - G_j}`` and
   ``db_j = sum_i M_ij a_i e^{G_i - G_j}``. Row side anchored at the row's tile t (first row
   ``b_t``): ``e^{G_i - b_t} (M[tile t rows] @ (k e^{b_t - G}, columns j < 16(t+1)))``; column side
   at the column's tile s: ``e^{b_s - G_j} (M[:, tile s]^T @ (a e^{G - b_s}, rows i >= 16 s))``.
   Every exponent is at most 75 (the -5 gate bound), as in the forward (:func:`_scores_bwd`).
3. ``dG`` collects each ``e^{±G}`` factor: ``q dq_S + k (dk_rows - dk_cols) + dX X + dqg qg - dkg kg``,
   plus ``sum_i dkg_i kg_i`` on the chunk's last row (through ``G_last``); the reverse in-chunk
   cumsum turns dG into dg. The anchors are constants: the scores do not depend on them, so their
   gradient is zero. ``d``'s gradient (``dd e^{G_last}``, on every row of the chunk) comes last.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import int_ops
from pallas_kernels.kda.kernel_gpu_prep import CHUNK, COL, ROW, SEG, SEG_T, SUB, WGMMA, _split, _wg
from pallas_kernels.kda.kernel_gpu_util import T

BF16 = jnp.bfloat16
F32 = jnp.float32
# exp as ex2.approx (2 instructions instead of ~10; relative error ~1e-6 even at the exponent
# bound of 75, far below the bf16 operands'): the kernels are instruction-issue bound.
APPROX = plgpu.CompilerParams(approx_math=True)


def _scores_kk(G, k_s, anchor, bufs):
    """Unmasked ``sum_c k_i k_j e^{G_i-G_j}`` [C, C], anchored per column tile as in the forward.

    A real loop over the tiles (as the forward's): tile s is ``k_i e^{G_i - b_s}`` (rows
    ``i >= 16 s``) times ``k_j e^{b_s - G_j}`` on tile s's rows j only, accumulated full width.
    """
    C, K = G.shape
    kc_s, ka_s = bufs
    r = plgpu.broadcasted_iota(jnp.int32, (C, K), 0, layout=WGMMA)

    def scope(acc):
        def tile(s, carry):
            b, k = anchor(s), plgpu.load(k_s, layout=WGMMA).astype(F32)
            ka_s[...] = _wg((k * jnp.exp(jnp.where(r >= s * SUB, G - b, -jnp.inf))).astype(BF16))
            kc_s[...] = _wg((k * jnp.exp(jnp.where(int_ops.div(r, SUB) == s, b - G, -jnp.inf))).astype(BF16))
            plgpu.commit_smem()
            plgpu.wgmma(acc, ka_s, T(kc_s))
            plgpu.wgmma_wait(0)  # the next tile overwrites the operands
            return carry

        lax.fori_loop(0, C // SUB, tile, 0)
        return acc[...]

    return pl.run_scoped(scope, plgpu.ACC((C, C), F32))


def _scores_bwd(G_s, q_s, k_s, m_qk, m_kk, anchor, bufs):
    """``(sum_t M_qk[t rows] @ B_t, sum_t M_kk[t rows] @ B_t, sum_s M_qk[:, s]^T A^q_s + M_kk[:, s]^T A^k_s)``.

    ``B_t = k e^{b_t - G}`` on columns ``j < 16(t+1)``; ``A^a_s = a e^{G - b_s}`` on rows ``i >= 16 s``;
    the caller applies the outer ``e^{G - own}`` / ``e^{own - G}`` factors. The exponential
    operands are hi/lo bf16 splits (two wgmmas per product): dg is a reverse cumsum of
    ``q dq - k dk`` in which the pairs of tokens after each row cancel, and plain bf16 operands
    leave it 1.4e-2 off the fp32 vjp; split operands 1.5e-3, splitting M too 3e-5, splitting only M
    1.4e-2 (measured on one 2-chunk case with documents). M comes in bf16 (as the wgmmas read it)
    and G is reloaded from smem per tile, to spare registers; the column side runs first so that
    one accumulator, not two, stays live through the other loop.

    The tiles are real loops (the unrolled kernel was bound by instruction fetch), so every wgmma
    contracts over all C tokens: the masks zero what the causal structure leaves out.
    """
    C, K = G_s.shape
    r = plgpu.broadcasted_iota(jnp.int32, (C, K), 0, layout=WGMMA)
    tile_of = lambda axis: int_ops.div(plgpu.broadcasted_iota(jnp.int32, (C, C), axis, layout=WGMMA), SUB)
    load = lambda ref: plgpu.load(ref, layout=WGMMA).astype(F32)
    m1_s, m2_s, a1h, a1l, a2h, a2l = bufs
    bf16 = lambda x: _wg(x.astype(BF16))

    def rows_scope(acc_q, acc_kr):
        def tile(t, carry):
            in_rows = tile_of(0) == t
            m1_s[...], m2_s[...] = bf16(jnp.where(in_rows, m_qk, 0.0)), bf16(jnp.where(in_rows, m_kk, 0.0))
            x = jnp.exp(jnp.where(r < (t + 1) * SUB, anchor(t) - load(G_s), -jnp.inf))
            a1h[...], a1l[...] = _split(load(k_s) * x)
            plgpu.commit_smem()
            for acc, m_s in ((acc_q, m1_s), (acc_kr, m2_s)):
                plgpu.wgmma(acc, m_s, a1h)
                plgpu.wgmma(acc, m_s, a1l)
            plgpu.wgmma_wait(0)  # the next tile overwrites every operand
            return carry

        lax.fori_loop(0, C // SUB, tile, 0)
        return acc_q[...], acc_kr[...]

    def cols_scope(acc):
        def tile(t, carry):
            in_cols = tile_of(1) == t
            m1_s[...], m2_s[...] = bf16(jnp.where(in_cols, m_qk, 0.0)), bf16(jnp.where(in_cols, m_kk, 0.0))
            x = jnp.exp(jnp.where(r >= t * SUB, load(G_s) - anchor(t), -jnp.inf))
            a1h[...], a1l[...] = _split(load(q_s) * x)
            a2h[...], a2l[...] = _split(load(k_s) * x)
            plgpu.commit_smem()
            for m_s, ah, al in ((m1_s, a1h, a1l), (m2_s, a2h, a2l)):
                plgpu.wgmma(acc, T(m_s), ah)
                plgpu.wgmma(acc, T(m_s), al)
            plgpu.wgmma_wait(0)
            return carry

        lax.fori_loop(0, C // SUB, tile, 0)
        return acc[...]

    acc_kc = pl.run_scoped(cols_scope, plgpu.ACC((C, K), F32))
    acc_q, acc_kr = pl.run_scoped(rows_scope, plgpu.ACC((C, K), F32), plgpu.ACC((C, K), F32))
    return acc_q, acc_kr, acc_kc


def finish_grads(primals, grads, dd, d):
    """The kernels' padded ``(dq, dk, dv, dg, dbeta)`` cut to the inputs' length and dtypes, with d's term.

    ``dg`` comes without it (unless ``dd`` is None: the kernel added it): d = e^{G_last} (0 when a
    document starts in the chunk), so ``dd * d`` reaches every row's dg. ``dbeta`` comes head-major
    ``[B*H, Tp]``.
    """
    q, k, v, g, beta = primals
    dq, dk, dv, dg, dbeta = grads
    B, T_len, H, K = k.shape
    C = CHUNK
    n = dg.shape[1] // C
    if dd is not None:
        dd_d = jnp.moveaxis((dd * d).reshape(B, H, n, K), 1, 2)  # [B,N,H,K]
        dg = (dg.reshape(B, n, C, H, K) + dd_d[:, :, None]).reshape(B, n * C, H, K)
    dbeta = jnp.moveaxis(dbeta.reshape(B, H, n * C), 1, 2)
    cut = lambda x, dt: x[:, :T_len].astype(dt)
    return cut(dq, q.dtype), cut(dk, k.dtype), cut(dv, v.dtype), cut(dg, g.dtype), cut(dbeta, beta.dtype)


def _vec_loaders(vec_s, n_rows):
    """``(col_vec, row_vec)``: an smem row repeated down the rows; a per-token row of the vector block."""

    def col_vec(ref, n_cols):
        return _wg(lax.broadcast_in_dim(plgpu.load(ref, layout=COL), (n_rows, n_cols), [1]))

    def row_vec(i, n_cols):
        return _wg(lax.broadcast_in_dim(plgpu.load(vec_s.at[i], layout=ROW), (n_rows, n_cols), [0]))

    return col_vec, row_vec


def _masks(col_vec, row_vec, vec_s, C):
    ri = plgpu.broadcasted_iota(jnp.int32, (C, C), 0, layout=WGMMA)
    cj = plgpu.broadcasted_iota(jnp.int32, (C, C), 1, layout=WGMMA)
    same = row_vec(SEG, C) == col_vec(vec_s.at[SEG_T], C)
    return ri, cj, (cj < ri) & same, (cj <= ri) & same
