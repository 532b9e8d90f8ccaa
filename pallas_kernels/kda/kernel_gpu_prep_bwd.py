"""Backward of the KDA intra-chunk prep as one Mosaic GPU kernel per 64-token chunk.

The forward (:mod:`kernel_gpu_prep`, math in :mod:`kernel_gpu_intra`) is, per chunk, with
``L = beta_i S_kk`` (strictly lower, same document), ``T = (I + L)^{-1}``, ``X = fresh beta k e^G``,
``Y = beta v``: ``W = T X``, ``U = T Y``, ``A_qk = scale S_qk`` (causal, same document),
``qg = fresh scale q e^G``, ``kg = to_end k e^{G_last - G}``, where
``S_ab[i,j] = sum_c a_ic b_jc e^{G_ic - G_jc}``. Given ``dW, dU, dqg, dkg, dA_qk`` this kernel
recomputes ``S_kk`` and ``T`` (as the forward does) and forms

1. ``dX = T^T dW``, ``dY = T^T dU`` and ``dL = -(dX W^T + dY U^T)`` (the gradient of the inverse,
   ``-T^T dT T^T`` with ``dT = dW X^T + dU Y^T``), masked strictly lower and same document;
   ``dv = beta dY``; ``dbeta = rowsum(dL S_kk) + rowsum(dX X / beta) + rowsum(dY v)``.
2. With ``M = scale dA_qk`` or ``beta dL``: ``da_i = sum_j M_ij b_j e^{G_i - G_j}`` and
   ``db_j = sum_i M_ij a_i e^{G_i - G_j}``. Row side anchored at the row's tile t (first row
   ``b_t``): ``e^{G_i - b_t} (M[tile t rows] @ (k e^{b_t - G}, columns j < 16(t+1)))``; column side
   at the column's tile s: ``e^{b_s - G_j} (M[:, tile s]^T @ (a e^{G - b_s}, rows i >= 16 s))``.
   Every exponent is at most 75 (the -5 gate bound), as in the forward. Each tile's masked M and
   (hi/lo) operands are 64-row wgmmas into one running accumulator per output (dq, dk rows, dk
   cols), each a real loop over the tiles contracting over the whole chunk (masked operands are zero).
3. ``dG`` collects each ``e^{±G}`` factor: ``q dq_S + k (dk_rows - dk_cols) + dX X + dqg qg - dkg kg``,
   plus ``sum_i dkg_i kg_i`` on the chunk's last row (through ``G_last``); the reverse in-chunk
   cumsum that turns dG into dg is one more (hi/lo) product. The anchors are constants: the
   scores do not depend on them, so their gradient is zero.

XLA adds ``d``'s gradient (``dd e^{G_last}``, on every row of the chunk).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import int_ops
from pallas_kernels.kda.kernel_gpu_prep import (
    BETA, CHUNK, COL, FRESH, ROW, SEG, SEG_T, SUB, TO_END, WGMMA, _bwd_inputs, _chain, _pair, _split,
    _unit_lower_inverse, _wg,
)
from pallas_kernels.kda.kernel_gpu_util import T, smem

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


# Jitted so that identical layers (and remat recomputes) share one traced jaxpr and one kernel.
@functools.partial(jax.jit, static_argnames=("scale", "interpret", "dtypes"))
def prep_bwd(q, k, v, G, anchors, vecs, dw, du, dqg, dkg, daqk, *, scale: float, interpret: bool,
             dtypes: tuple):
    """``(dq, dk, dv, dg [B,Tp,H,.] token-major, dbeta [B*H,Tp] f32)``; dg lacks only d's term.

    Forward inputs as :func:`kernel_gpu_prep.prep_fwd` takes them; cotangents head-major
    ``[B*H,Tp,.]``: dw, du bf16 (wgmma operands), dqg, dkg, daqk f32. ``dtypes``: (dq, dk, dv) dtypes.
    """
    B, Tp, H, K = q.shape
    V = v.shape[-1]
    C = CHUNK
    n, nt = Tp // C, C // SUB

    def kernel(q_g, k_g, v_g, G_g, anc_g, vec_g, dw_g, du_g, dqg_g, dkg_g, daqk_g,
               dq_g, dk_g, dv_g, dg_g, db_g,
               q_s, k_s, v_s, G_s, anc_s, vec_s, dw_s, du_s, union, bar, bar_aqk, bar_tail):
        score_bufs, inv_bufs, (th, tl, xw_s, yu_s), (daqk_s,), bwd_bufs, (dqg_s, dkg_s, up_s) = union
        (G_s,), (dgh_s, dgl_s) = G_s
        c, bh = lax.axis_index("c"), lax.axis_index("bh")
        b, h = int_ops.div(bh, H), int_ops.rem(bh, H)
        rows = pl.ds(c * C, C)
        for src, dst in ((q_g.at[b, rows, h], q_s), (k_g.at[b, rows, h], k_s), (v_g.at[b, rows, h], v_s),
                         (G_g.at[b, rows, h], G_s), (anc_g.at[b, pl.ds(c * 8, 8), h], anc_s),
                         (vec_g.at[bh, :, rows], vec_s), (dw_g.at[bh, rows], dw_s), (du_g.at[bh, rows], du_s)):
            plgpu.copy_gmem_to_smem(src, dst, bar)
        plgpu.barrier_wait(bar)

        def col_vec(ref, n_cols=K):  # a [n_cols] smem row, repeated down the rows
            return _wg(lax.broadcast_in_dim(plgpu.load(ref, layout=COL), (C, n_cols), [1]))

        def row_vec(i, n_cols):  # row i of the vector block, one value per token row
            return _wg(lax.broadcast_in_dim(plgpu.load(vec_s.at[i], layout=ROW), (C, n_cols), [0]))

        anchor = lambda t: col_vec(anc_s.at[t])
        load = lambda ref: plgpu.load(ref, layout=WGMMA).astype(F32)
        ri = plgpu.broadcasted_iota(jnp.int32, (C, C), 0, layout=WGMMA)
        cj = plgpu.broadcasted_iota(jnp.int32, (C, C), 1, layout=WGMMA)
        same = row_vec(SEG, C) == col_vec(vec_s.at[SEG_T], n_cols=C)
        strict, causal = (cj < ri) & same, (cj <= ri) & same

        # Recompute S_kk and T exactly as the forward does.
        s_kk = _wg(jnp.where(strict, _scores_kk(load(G_s), k_s, anchor, score_bufs), 0.0))
        t_inv = _unit_lower_inverse(_wg(-row_vec(BETA, C) * s_kk), ri, cj, inv_bufs)
        th[...], tl[...] = _split(t_inv)
        eg = jnp.exp(load(G_s))
        x_w = row_vec(BETA, K) * row_vec(FRESH, K) * load(k_s) * eg
        xw_s[...] = _wg(x_w.astype(BF16))
        yu_s[...] = _wg((row_vec(BETA, V) * load(v_s)).astype(BF16))
        plgpu.commit_smem()
        w, u = _pair([(th, xw_s), (tl, xw_s)], [(th, yu_s), (tl, yu_s)], ((C, K), (C, V)))
        dx, dy = _pair([(T(th), dw_s), (T(tl), dw_s)], [(T(th), du_s), (T(tl), du_s)], ((C, K), (C, V)))
        xw_s[...], yu_s[...] = _wg(w.astype(BF16)), _wg(u.astype(BF16))
        dw_s[...], du_s[...] = _wg(dx.astype(BF16)), _wg(dy.astype(BF16))
        dv_g.at[b, rows, h][...] = (row_vec(BETA, V) * dy).astype(dtypes[2])
        dbeta = jnp.sum(dy * load(v_s), axis=1) + jnp.sum(dx * row_vec(FRESH, K) * load(k_s) * eg, axis=1)
        plgpu.commit_smem()
        d_l = pl.run_scoped(lambda acc: _chain(acc, [(dw_s, T(xw_s)), (du_s, T(yu_s))]), plgpu.ACC((C, C), F32))
        d_l = _wg(jnp.where(strict, -d_l, 0.0))
        db_g.at[bh, rows][...] = dbeta + jnp.sum(d_l * s_kk, axis=1)
        # dA_qk lands in the WY operands' memory, free once dL is read.
        plgpu.copy_gmem_to_smem(daqk_g.at[bh, rows], daqk_s, bar_aqk)
        plgpu.barrier_wait(bar_aqk)

        m_qk = _wg(jnp.where(causal, scale * plgpu.load(daqk_s, layout=WGMMA), 0.0).astype(BF16))
        m_kk = _wg((row_vec(BETA, C) * d_l).astype(BF16))
        plgpu.commit_smem()  # every thread has read dA_qk before the score backward reuses its memory
        acc_q, acc_kr, acc_kc = _scores_bwd(G_s, q_s, k_s, m_qk, m_kk, anchor, bwd_bufs)
        G = load(G_s)
        # dqg, dkg land in the score operands' memory, free now that the last wgmma is read.
        plgpu.copy_gmem_to_smem(dqg_g.at[bh, rows], dqg_s, bar_tail)
        plgpu.copy_gmem_to_smem(dkg_g.at[bh, rows], dkg_s, bar_tail)
        r = plgpu.broadcasted_iota(jnp.int32, (C, K), 0, layout=WGMMA)
        own = anchor(0)
        for s in range(1, nt):
            own = _wg(jnp.where(r >= s * SUB, anchor(s), own))
        plgpu.barrier_wait(bar_tail)

        # Each term is folded into dq, dk, dG as soon as it is formed, to keep few [C, K] live.
        q, k, eg, e_own = load(q_s), load(k_s), jnp.exp(G), jnp.exp(G - own)
        dq = e_own * acc_q + plgpu.load(dqg_s, layout=WGMMA) * (scale * row_vec(FRESH, K) * eg)
        dq_g.at[b, rows, h][...] = dq.astype(dtypes[0])
        dk_c = acc_kc * jnp.exp(own - G)  # enters dG with a minus sign: its factor is e^{-G_j}
        dk_x = e_own * acc_kr + load(dw_s) * (row_vec(BETA, K) * row_vec(FRESH, K) * eg)  # + dX X / k
        dG = q * dq + k * (dk_x - dk_c)
        kg_f = row_vec(TO_END, K) * jnp.exp(anchor(nt) - G)  # kg = k * kg_f
        dkg = plgpu.load(dkg_s, layout=WGMMA)
        dk_g.at[b, rows, h][...] = (dk_x + dk_c + dkg * kg_f).astype(dtypes[1])
        dkg_kg = dkg * k * kg_f
        dG = dG - dkg_kg
        # dg = reverse in-chunk cumsum of dG, as one product with the 0/1 upper triangle (exact in
        # bf16) and dG split hi/lo; G_last's term sum_i dkg_i kg_i reaches every row of the chunk.
        up_s[...] = _wg(jnp.where(cj >= ri, 1.0, 0.0).astype(BF16))
        plgpu.commit_smem()  # every thread has read G_s before dG's halves overwrite it
        dgh_s[...], dgl_s[...] = _split(dG)
        plgpu.commit_smem()
        dg = pl.run_scoped(lambda acc: _chain(acc, [(up_s, dgh_s), (up_s, dgl_s)]), plgpu.ACC((C, K), F32))
        dg_g.at[b, rows, h][...] = _wg(dg + lax.broadcast_in_dim(jnp.sum(dkg_kg, axis=0), (C, K), [1]))

    BH = B * H
    out_type = [jax.ShapeDtypeStruct((B, Tp, H, K), dtypes[0]), jax.ShapeDtypeStruct((B, Tp, H, K), dtypes[1]),
                jax.ShapeDtypeStruct((B, Tp, H, V), dtypes[2]), jax.ShapeDtypeStruct((B, Tp, H, K), F32),
                jax.ShapeDtypeStruct((BH, Tp), F32)]
    one = dict(slots=None)
    cc = lambda: smem((C, C), **one)
    # Buffers by lifetime (200 KB at K = V = 128, one CTA per SM): the score recompute, the
    # inverse, the WY products, the score backward and the final elementwise inputs share one region.
    union = plgpu.RefUnion(
        (smem((C, K), **one), smem((C, K), **one)),
        tuple(cc() for _ in range(6)),
        (cc(), cc(), smem((C, K), **one), smem((C, V), **one)),
        (smem((C, C), F32, mma=False, **one),),
        (cc(), cc(), *(smem((C, K), **one) for _ in range(4))),
        (smem((C, K), F32, mma=False, **one), smem((C, K), F32, mma=False, **one), cc()),
    )
    scratch = [
        smem((C, K), **one), smem((C, K), **one), smem((C, V), **one),
        plgpu.RefUnion((smem((C, K), F32, mma=False, **one),), (smem((C, K), **one), smem((C, K), **one))),
        smem((8, K), F32, mma=False, **one), smem((5, C), F32, mma=False, **one),
        smem((C, K), **one), smem((C, V), **one),
        union, plgpu.Barrier(num_arrivals=8), plgpu.Barrier(num_arrivals=1), plgpu.Barrier(num_arrivals=2),
    ]
    extra = {"interpret": plgpu.InterpretGPUParams()} if interpret else {}
    call = plgpu.kernel(
        kernel, out_type=out_type, scratch_types=scratch, grid=(n, BH), grid_names=("c", "bh"),
        kernel_name="kda_prep_bwd", compiler_params=APPROX, **extra,
    )
    return call(q, k, v, G, anchors, vecs, dw, du, dqg, dkg, daqk)


def prepare_bwd(q, k, v, g, beta, sidx, cts, *, scale: float, interpret: bool):
    """Gradients ``(dq, dk, dv, dg, dbeta)`` of :func:`kernel_gpu_intra.prepare_from_index` (chunk 64).

    ``cts``: the cotangents of ``(w, u, qg, kg, aqk, d)``, head-major as the prep returns them.
    """
    qh, kh, vh, G, anchors, vecs, d = _bwd_inputs(q, k, v, g, beta, sidx)
    dw, du, dqg, dkg, daqk, dd = cts
    grads = prep_bwd(
        qh, kh, vh, G, anchors, vecs, dw.astype(BF16), du.astype(BF16), dqg.astype(F32), dkg.astype(F32),
        daqk.astype(F32), scale=scale, interpret=interpret, dtypes=(q.dtype, k.dtype, v.dtype),
    )
    return finish_grads((q, k, v, g, beta), grads, dd, d)


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


# ---- shared with the split backward (kernel_gpu_prep_bwd_split / _intra)

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
