"""Kernel B of the split KDA prep backward (``prep_bwd="split"``): ``kda_prep_bwd_intra``.

One CTA per (64-channel slab, chunk). Every term left after kernel A (:mod:`kernel_gpu_prep_bwd_split`)
is per channel: the score backward of ``A_qk`` and ``L`` on the slab, the assembly of dq, dk, dG,
and the in-chunk reverse cumsum dG -> dg. Half the channels per CTA halves its live registers and
its shared memory (102 KiB at K = 128), so two CTAs share an SM, and there are twice as many CTAs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import int_ops
from pallas_kernels.kda.kernel_gpu_prep import BETA, CHUNK, COL, FRESH, SUB, TO_END, WGMMA, _chain, _split, _wg
from pallas_kernels.kda.kernel_gpu_prep_bwd_common import APPROX, _masks, _scores_bwd, _vec_loaders
from pallas_kernels.kda.kernel_gpu_util import smem

BF16 = jnp.bfloat16
F32 = jnp.float32
SLAB = 64  # channels per CTA
ONE = dict(slots=None)


def _reverse_cumsum(dG, up_s, halves, C):
    """``sum_{s >= t} dG_s`` in the chunk: the 0/1 upper triangle (exact in bf16) times dG split hi/lo.

    ``halves`` may share memory with G: the caller has read G into registers.
    """
    ri = plgpu.broadcasted_iota(jnp.int32, (C, C), 0, layout=WGMMA)
    cj = plgpu.broadcasted_iota(jnp.int32, (C, C), 1, layout=WGMMA)
    up_s[...] = _wg(jnp.where(cj >= ri, 1.0, 0.0).astype(BF16))
    plgpu.commit_smem()  # every thread has read G before dG's halves overwrite it
    hi_s, lo_s = halves
    hi_s[...], lo_s[...] = _split(dG)
    plgpu.commit_smem()
    return pl.run_scoped(lambda acc: _chain(acc, [(up_s, hi_s), (up_s, lo_s)]), plgpu.ACC(dG.shape, F32))


def _intra_tail(G, q_s, k_s, dx_s, dqg_s, dkg_s, accs, anchor, row_vec, scale, nt, dq_out):
    """``(dk, dG, sum-term)`` of one slab from the score backward's accumulators and the direct terms;
    dq goes to ``dq_out(dq)`` as soon as it is formed.

    The terms are ordered so that each [C, S] array dies as early as it can (at most ~6 live).
    """
    acc_q, acc_kr, acc_kc = accs
    C, S = G.shape
    load = lambda ref: plgpu.load(ref, layout=WGMMA).astype(F32)
    r = plgpu.broadcasted_iota(jnp.int32, (C, S), 0, layout=WGMMA)
    own = anchor(0)
    for s in range(1, nt):
        own = _wg(jnp.where(r >= s * SUB, anchor(s), own))
    dk_c = acc_kc * jnp.exp(own - G)  # enters dG with a minus sign: its factor is e^{-G_j}
    e_own, eg = jnp.exp(G - own), jnp.exp(G)
    dq = e_own * acc_q + load(dqg_s) * (scale * row_vec(FRESH, S) * eg)
    dq_out(dq)
    dG = load(q_s) * dq
    dk_r = e_own * acc_kr
    dk_x = dk_r + load(dx_s) * (row_vec(BETA, S) * row_vec(FRESH, S) * eg)  # + dX X / k
    k = load(k_s)
    dG = dG + k * (dk_x - dk_c)
    kg_f = row_vec(TO_END, S) * jnp.exp(anchor(nt) - G)  # kg = k * kg_f
    dkg = load(dkg_s)
    dkg_kg = dkg * k * kg_f
    return dk_x + dk_c + dkg * kg_f, dG - dkg_kg, dkg_kg


def _intra_scratch(C, S):
    """Kernel B's shared memory, 102 KiB at K = 128 (two CTAs per SM): dA_qk (read before the score
    backward), the score backward's operands and the tail's inputs share one region; G and the
    halves of dG share another."""
    union = plgpu.RefUnion(
        (smem((C, C), F32, mma=False, **ONE),),
        (smem((C, C), **ONE), smem((C, C), **ONE), *(smem((C, S), **ONE) for _ in range(4))),
        (smem((C, S), F32, mma=False, **ONE), smem((C, S), F32, mma=False, **ONE), smem((C, C), **ONE)),
    )
    return [
        smem((C, S), **ONE), smem((C, S), **ONE),
        plgpu.RefUnion((smem((C, S), F32, mma=False, **ONE),), (smem((C, S), **ONE), smem((C, S), **ONE))),
        smem((8, S), F32, mma=False, **ONE), smem((5, C), F32, mma=False, **ONE),
        smem((C, C), **ONE), smem((C, S), **ONE), union,
        plgpu.Barrier(num_arrivals=8), plgpu.Barrier(num_arrivals=2),
    ]


# Jitted so that identical layers (and remat recomputes) share one traced jaxpr and one kernel.
@functools.partial(jax.jit, static_argnames=("scale", "interpret", "dtypes"))
def intra_bwd(q, k, G, anchors, vecs, daqk, mkk, dx, dqg, dkg, *, scale: float, interpret: bool, dtypes: tuple,
              dd_d=None):
    """Kernel B: ``(dq, dk, dg)`` token-major ``[B,Tp,H,K]`` (dg f32, without d's term unless ``dd_d``).

    ``dd_d`` ``[B*H,N,K]`` f32 (``dd * d``, d's term, the same for every row of a chunk) is added to
    dg here, after the other per-chunk term, as XLA would add it after the kernel (the same sums).

    q, k, G, anchors, vecs as :func:`kernel_gpu_prep.prep_fwd` takes them; daqk ``[B*H,Tp,C]``
    f32 and dqg, dkg ``[B*H,Tp,K]`` f32 (the scan's cotangents); mkk, dx from :func:`wy_bwd`.
    ``dtypes``: (dq, dk) dtypes.
    """
    B, Tp, H, K = q.shape
    C = CHUNK
    n, nt, S = Tp // C, C // SUB, min(SLAB, K)

    def kernel(q_g, k_g, G_g, anc_g, vec_g, daqk_g, mkk_g, dx_g, dqg_g, dkg_g, *rest):
        ddd_g, rest = (rest[0], rest[1:]) if dd_d is not None else (None, rest)
        dq_g, dk_g, dg_g, *rest = rest
        q_s, k_s, G_u, anc_s, vec_s, mkk_s, dx_s, union, bar, bar_tail = rest
        (daqk_s,), bwd_bufs, (dqg_s, dkg_s, up_s) = union
        (G_s,), halves = G_u
        p, c, bh = lax.axis_index("p"), lax.axis_index("c"), lax.axis_index("bh")
        b, h = int_ops.div(bh, H), int_ops.rem(bh, H)
        rows, cols = pl.ds(c * C, C), pl.ds(p * S, S)
        for src, dst in ((q_g.at[b, rows, h, cols], q_s), (k_g.at[b, rows, h, cols], k_s),
                         (G_g.at[b, rows, h, cols], G_s), (anc_g.at[b, pl.ds(c * 8, 8), h, cols], anc_s),
                         (vec_g.at[bh, :, rows], vec_s), (daqk_g.at[bh, rows], daqk_s),
                         (mkk_g.at[bh, rows], mkk_s), (dx_g.at[bh, rows, cols], dx_s)):
            plgpu.copy_gmem_to_smem(src, dst, bar)
        plgpu.barrier_wait(bar)
        col_vec, row_vec = _vec_loaders(vec_s, C)
        anchor = lambda t: col_vec(anc_s.at[t], S)
        _, _, _, causal = _masks(col_vec, row_vec, vec_s, C)
        m_qk = _wg(jnp.where(causal, scale * plgpu.load(daqk_s, layout=WGMMA), 0.0).astype(BF16))
        m_kk = plgpu.load(mkk_s, layout=WGMMA)
        plgpu.commit_smem()  # every thread has read dA_qk before the score backward reuses its memory
        accs = _scores_bwd(G_s, q_s, k_s, m_qk, m_kk, anchor, bwd_bufs)
        # dqg, dkg land in the score operands' memory, free now that the last wgmma is read.
        plgpu.copy_gmem_to_smem(dqg_g.at[bh, rows, cols], dqg_s, bar_tail)
        plgpu.copy_gmem_to_smem(dkg_g.at[bh, rows, cols], dkg_s, bar_tail)
        G = plgpu.load(G_s, layout=WGMMA)
        plgpu.barrier_wait(bar_tail)

        def dq_out(dq):
            dq_g.at[b, rows, h, cols][...] = dq.astype(dtypes[0])

        dk, dG, dkg_kg = _intra_tail(G, q_s, k_s, dx_s, dqg_s, dkg_s, accs, anchor, row_vec, scale, nt, dq_out)
        dk_g.at[b, rows, h, cols][...] = dk.astype(dtypes[1])
        # G_last's term sum_i dkg_i kg_i reaches every row of the chunk.
        dg = _reverse_cumsum(dG, up_s, halves, C)
        dg = _wg(dg + lax.broadcast_in_dim(jnp.sum(dkg_kg, axis=0), (C, S), [1]))
        if ddd_g is not None:
            ddd = plgpu.load(ddd_g.at[bh, c, cols], layout=COL, optimized=False)  # [S], straight from HBM
            dg = _wg(dg + lax.broadcast_in_dim(ddd, (C, S), [1]))
        dg_g.at[b, rows, h, cols][...] = dg

    BH = B * H
    out_type = [jax.ShapeDtypeStruct((B, Tp, H, K), dtypes[0]), jax.ShapeDtypeStruct((B, Tp, H, K), dtypes[1]),
                jax.ShapeDtypeStruct((B, Tp, H, K), F32)]
    scratch = _intra_scratch(C, S)
    extra = {"interpret": plgpu.InterpretGPUParams()} if interpret else {}
    call = plgpu.kernel(
        kernel, out_type=out_type, scratch_types=scratch, grid=(K // S, n, BH), grid_names=("p", "c", "bh"),
        kernel_name="kda_prep_bwd_intra", compiler_params=APPROX, **extra,
    )
    return call(q, k, G, anchors, vecs, daqk, mkk, dx, dqg, dkg, *(() if dd_d is None else (dd_d,)))
