"""Backward of the KDA intra-chunk prep as two Mosaic GPU kernels (``prep_bwd="split"``).

Math in :mod:`kernel_gpu_prep_bwd_common` (its docstring has the derivation), cut where the work
stops needing all K channels of a chunk at once (plan: ``DESIGN_BWD.md``):

A. ``kda_prep_bwd_wy``, one CTA per chunk: recompute ``S_kk`` and ``T = (I + L)^{-1}`` as the
   forward does; ``dX = T^T dW``, ``dY = T^T dU`` and ``dL = -T^T Z T^T`` with
   ``Z = dW X^T + dU Y^T`` (strictly lower, same document; no ``W, U`` recompute, and hi/lo ``T``
   on both sides, which is closer to fp32 than the deleted one-kernel version's bf16 ``W, U``); writes
   ``dv = beta dY``, ``dX`` (bf16), ``M_kk = beta dL`` (bf16, the score backward's upstream matrix)
   and ``dbeta`` (complete: its ``rowsum(dL S_kk)`` needs every channel). 104 KiB of shared memory
   at K = V = 128 (G's memory goes to the inverse once ``X / beta`` is formed; dW, dU arrive after
   the inverse, in its memory), so two CTAs share an SM.
B. ``kda_prep_bwd_intra`` (:mod:`kernel_gpu_prep_bwd_intra`), one CTA per (64-channel slab, chunk):
   every remaining term is per channel:
   the score backward of ``A_qk`` and ``L`` on the slab, the assembly of dq, dk, dG, and the
   in-chunk reverse cumsum dG -> dg. Half the channels per CTA halves its live registers and its
   shared memory (102 KiB at K = 128), so two CTAs share an SM, and there are twice as many CTAs.

A kernel A reading the forward's saved ``T`` instead of inverting again (``prep_bwd="split-saved"``)
was deleted: 13.90 against 13.75 ms fwd+bwd on the H200 (``DESIGN_BWD.md`` section 4).
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
    BETA, CHUNK, FRESH, WGMMA, _bwd_inputs, _chain, _kernel_inputs, _masked_decay, _split,
    _unit_lower_inverse, _wg, prep_fwd,
)
from pallas_kernels.kda.kernel_gpu_prep_bwd_common import APPROX, _masks, _scores_kk, _vec_loaders, finish_grads
from pallas_kernels.kda.kernel_gpu_prep_bwd_intra import intra_bwd
from pallas_kernels.kda.kernel_gpu_util import T, smem

BF16 = jnp.bfloat16
F32 = jnp.float32
ONE = dict(slots=None)


def _three(acc, a_hi, a_lo, b_hi, b_lo):
    """``a @ b`` into ``acc`` from hi/lo bf16 halves (the lo*lo term is below fp32)."""
    return _chain(acc, [(a_hi, b_hi), (a_hi, b_lo), (a_lo, b_hi)])


def _t_transpose_times(th, tl, rhs_s, shape):
    """``T^T rhs`` with ``T`` from its hi/lo halves."""
    return pl.run_scoped(lambda acc: _chain(acc, [(T(th), rhs_s), (T(tl), rhs_s)]), plgpu.ACC(shape, F32))


def _inverse_grad(th, tl, bufs, x_s, v_s, dw_s, du_s, beta_c):
    """``T^T Z T^T`` (unmasked; ``dL`` is its negative) with ``Z = dW X^T + dU Y^T``.

    ``Z = (dW X'^T + dU v^T) diag(beta)`` with ``X' = X / beta`` in ``x_s``, so neither ``W, U``
    nor ``beta``-scaled operands are recomputed. ``bufs``: two hi/lo pairs (for ``Z`` and
    ``T^T Z``), which may share memory with dW, dU.
    """
    zh, zl, yh, yl = bufs
    C = th.shape[0]
    acc = lambda: plgpu.ACC((C, C), F32)
    z = pl.run_scoped(lambda a: _chain(a, [(dw_s, T(x_s)), (du_s, T(v_s))]), acc()) * beta_c
    plgpu.commit_smem()  # every wgmma reading dW, dU is done (its result is read): Z's halves may overwrite them
    zh[...], zl[...] = _split(_wg(z))
    plgpu.commit_smem()
    y = pl.run_scoped(lambda a: _three(a, T(th), T(tl), zh, zl), acc())
    yh[...], yl[...] = _split(_wg(y))
    plgpu.commit_smem()
    return pl.run_scoped(lambda a: _three(a, yh, yl, T(th), T(tl)), acc())


def _wy_tail(refs, dl_bufs, s_kk, strict, col_vec, row_vec, vec_s, outs, dv_dtype):
    """Kernel A once ``T``'s halves, dW, dU, ``X'`` and v are in smem: stores dv, dX, ``M_kk``, dbeta.

    dX then dY, each stored and folded into dbeta at once: one [C, K] f32 live at a time.
    """
    th, tl, dw_s, du_s, k_s, v_s = refs
    dv_o, dx_o, mkk_o, db_o = outs
    C, K, V = th.shape[0], k_s.shape[1], v_s.shape[1]
    load = lambda ref: plgpu.load(ref, layout=WGMMA).astype(F32)
    dx = _t_transpose_times(th, tl, dw_s, (C, K))
    dx_o[...] = _wg(dx.astype(BF16))  # in bf16, as kernel B reads it
    dbeta = jnp.sum(dx * load(k_s), axis=1)
    dy = _t_transpose_times(th, tl, du_s, (C, V))
    dv_o[...] = (row_vec(BETA, V) * dy).astype(dv_dtype)
    dbeta = dbeta + jnp.sum(dy * load(v_s), axis=1)
    d_l = _inverse_grad(th, tl, dl_bufs, k_s, v_s, dw_s, du_s, col_vec(vec_s.at[BETA], C))
    d_l = _wg(jnp.where(strict, -d_l, 0.0))
    db_o[...] = dbeta + jnp.sum(d_l * s_kk, axis=1)
    mkk_o[...] = _wg((row_vec(BETA, C) * d_l).astype(BF16))


# Jitted so that identical layers (and remat recomputes) share one traced jaxpr and one kernel.
@functools.partial(jax.jit, static_argnames=("interpret", "dv_dtype"))
def wy_bwd(k, v, G, anchors, vecs, dw, du, *, interpret: bool, dv_dtype):
    """Kernel A: ``(dv [B,Tp,H,V], dx [B*H,Tp,K] bf16, m_kk [B*H,Tp,C] bf16, dbeta [B*H,Tp] f32)``.

    Inputs as :func:`kernel_gpu_prep.prep_fwd` takes them (no q); dw, du head-major bf16.
    """
    B, Tp, H, K = k.shape
    V = v.shape[-1]
    C = CHUNK
    n = Tp // C

    def kernel(k_g, v_g, G_g, anc_g, vec_g, dw_g, du_g, dv_g, dx_g, mkk_g, db_g,
               k_s, v_s, anc_s, vec_s, union, bar, bar_d):
        (G_s, *score_bufs), inv_bufs, (th, tl, dw_s, du_s), (_, _, *dl_bufs) = union
        c, bh = lax.axis_index("c"), lax.axis_index("bh")
        b, h = int_ops.div(bh, H), int_ops.rem(bh, H)
        rows = pl.ds(c * C, C)
        for src, dst in ((k_g.at[b, rows, h], k_s), (v_g.at[b, rows, h], v_s), (G_g.at[b, rows, h], G_s),
                         (anc_g.at[b, pl.ds(c * 8, 8), h], anc_s), (vec_g.at[bh, :, rows], vec_s)):
            plgpu.copy_gmem_to_smem(src, dst, bar)
        plgpu.barrier_wait(bar)
        col_vec, row_vec = _vec_loaders(vec_s, C)
        ri, cj, strict, _ = _masks(col_vec, row_vec, vec_s, C)
        G = plgpu.load(G_s, layout=WGMMA)
        s_kk = _wg(jnp.where(strict, _scores_kk(G, k_s, lambda t: col_vec(anc_s.at[t], K), score_bufs), 0.0))
        # k becomes X' = fresh k e^G (X = beta X'), the only use of G: G's memory goes to the inverse.
        k_s[...] = _wg((row_vec(FRESH, K) * plgpu.load(k_s, layout=WGMMA).astype(F32) * jnp.exp(G)).astype(BF16))
        plgpu.commit_smem()
        t_inv = _unit_lower_inverse(_wg(-row_vec(BETA, C) * s_kk), ri, cj, inv_bufs)
        # dW, dU land in the inverse's memory (after T's halves), now that its last product is read.
        plgpu.copy_gmem_to_smem(dw_g.at[bh, rows], dw_s, bar_d)
        plgpu.copy_gmem_to_smem(du_g.at[bh, rows], du_s, bar_d)
        th[...], tl[...] = _split(t_inv)
        plgpu.commit_smem()
        plgpu.barrier_wait(bar_d)
        outs = (dv_g.at[b, rows, h], dx_g.at[bh, rows], mkk_g.at[bh, rows], db_g.at[bh, rows])
        _wy_tail((th, tl, dw_s, du_s, k_s, v_s), dl_bufs, s_kk, strict, col_vec, row_vec, vec_s, outs, dv_dtype)

    out_type = _wy_out_type(B, Tp, H, K, V, dv_dtype)
    cc = lambda: smem((C, C), **ONE)
    # 104 KiB at K = V = 128, so two CTAs share an SM: G with the score recompute, the inverse, and
    # then T's halves (the first two buffers of both later groups) with dW, dU or the dL products.
    union = plgpu.RefUnion(
        (smem((C, K), F32, mma=False, **ONE), smem((C, K), **ONE), smem((C, K), **ONE)),
        tuple(cc() for _ in range(6)),
        (cc(), cc(), smem((C, K), **ONE), smem((C, V), **ONE)),
        (cc(), cc(), cc(), cc(), cc(), cc()),
    )
    scratch = [
        smem((C, K), **ONE), smem((C, V), **ONE), smem((8, K), F32, mma=False, **ONE),
        smem((5, C), F32, mma=False, **ONE), union, plgpu.Barrier(num_arrivals=5), plgpu.Barrier(num_arrivals=2),
    ]
    extra = {"interpret": plgpu.InterpretGPUParams()} if interpret else {}
    call = plgpu.kernel(
        kernel, out_type=out_type, scratch_types=scratch, grid=(n, B * H), grid_names=("c", "bh"),
        kernel_name="kda_prep_bwd_wy", compiler_params=APPROX, **extra,
    )
    return call(k, v, G, anchors, vecs, dw, du)


def _wy_out_type(B, Tp, H, K, V, dv_dtype):
    BH = B * H
    return [jax.ShapeDtypeStruct((B, Tp, H, V), dv_dtype), jax.ShapeDtypeStruct((BH, Tp, K), BF16),
            jax.ShapeDtypeStruct((BH, Tp, CHUNK), BF16), jax.ShapeDtypeStruct((BH, Tp), F32)]


def prepare_bwd_split(q, k, v, g, beta, sidx, cts, *, scale: float, interpret: bool):
    """Gradients ``(dq, dk, dv, dg, dbeta)`` of :func:`kernel_gpu_intra.prepare_from_index` (chunk 64).

    ``cts``: the cotangents of ``(w, u, qg, kg, aqk, d)``, head-major as the prep returns them.
    """
    _, _, _, *inputs = _bwd_inputs(q, k, v, g, beta, sidx)
    return _grads(q, k, v, g, beta, inputs, cts, scale=scale, interpret=interpret)


def _grads(q, k, v, g, beta, inputs, cts, *, scale: float, interpret: bool):
    """:func:`prepare_bwd_split` from the kernel inputs ``(G, anchors, vecs, d)``; g only gives its dtype."""
    G, anchors, vecs, d = inputs
    pad = G.shape[1] - q.shape[1]
    qh, kh, vh = (jnp.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)]).astype(BF16) for x in (q, k, v))
    dw, du, dqg, dkg, daqk, dd = cts
    wy_args = (dw.astype(BF16), du.astype(BF16))
    wy = dict(interpret=interpret, dv_dtype=v.dtype)
    dv, dx, mkk, dbeta = wy_bwd(kh, vh, G, anchors, vecs, *wy_args, **wy)
    dq, dk, dg = intra_bwd(qh, kh, G, anchors, vecs, daqk.astype(F32), mkk, dx, dqg.astype(F32),
                           dkg.astype(F32), scale=scale, interpret=interpret, dtypes=(q.dtype, k.dtype),
                           dd_d=dd * d)  # d's term added in the kernel
    return finish_grads((q, k, v, g, beta), (dq, dk, dv, dg, dbeta), None, d)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def prepare_split(q, k, v, g, beta, sidx_f, scale: float, interpret: bool):
    """:func:`kernel_gpu_prep.prepare_fused`'s kernel forward with this module's two-kernel backward.

    The residuals are the inputs with g as the kernel takes it (padded, f32; of g itself only its
    dtype is kept), the per-token vectors and d, and the chunk cumsum G and its anchors, which the
    forward kernel takes and (differentiated) writes out for the backward kernels (``save_g``:
    ~0.6 GB of stores at B,T,H,K = 4,8192,32,128 instead of XLA's three fusions and ~2.3 GB).
    W and U stay bf16 (the scan reads them so, and
    this backward takes their cotangents in bf16: the scan's backward stores them so); qg, kg, A_qk
    are upcast to f32 like :func:`prepare_fused`'s, so their cotangents stay fp32.
    """
    qh, kh, vh, g_p, vecs, fresh_last = _kernel_inputs(q, k, v, g, beta, sidx_f.astype(jnp.int32))
    outs = prep_fwd(qh, kh, vh, g_p, vecs, scale=scale, interpret=interpret)
    return _split_outputs(outs, fresh_last)


def _split_outputs(outs, fresh_last):
    w, u, qg, kg, aqk, decay = outs[:6]
    return (w, u, *(x.astype(F32) for x in (qg, kg, aqk)), _masked_decay(decay, fresh_last))


def _split_fwd(q, k, v, g, beta, sidx_f, scale, interpret):
    qh, kh, vh, g_p, vecs, fresh_last = _kernel_inputs(q, k, v, g, beta, sidx_f.astype(jnp.int32))
    outs = prep_fwd(qh, kh, vh, g_p, vecs, scale=scale, interpret=interpret, save_g=True)
    primal = _split_outputs(outs, fresh_last)
    d = primal[-1]
    g_saved = tuple(outs[6:])  # G and its anchors
    g_dtype = jnp.zeros((0,), g.dtype)
    return primal, (q, k, v, g_dtype, beta, sidx_f, (g_saved, vecs, d))


def _split_bwd(scale, interpret, res, cts):
    q, k, v, g_dtype, beta, sidx_f, (g_saved, vecs, d) = res
    G, anchors = g_saved  # the forward kernel's
    grads = _grads(q, k, v, g_dtype, beta, (G, anchors, vecs, d), tuple(cts), scale=scale,
                   interpret=interpret)
    return (*grads, jnp.zeros_like(sidx_f))


prepare_split.defvjp(_split_fwd, _split_bwd)
