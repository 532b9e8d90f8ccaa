"""Backward of the KDA inter-chunk scan on Hopper (Mosaic GPU), one reverse pass per (head, V block).

Forward per chunk (entering state S, from the saved per-chunk states ``h``):
``v_new = U - W S``; ``o = qg S + A_qk v_new``; ``S' = d * S + kg^T v_new``.
With ``dS`` the gradient of ``S'`` and ``do`` that of ``o``, walking chunks last to first:

1. ``dv_new = A_qk^T do + kg dS``  (this is ``dU``; ``dW = -dv_new S^T``)
2. ``dA_qk = do v_new^T``, ``dqg = do S^T``, ``dkg = v_new dS^T``, ``dd = rowsum(dS * S)``
3. ``dS <- d * dS + qg^T do - W^T dv_new``

Default: one CTA per (head, V block). Step 2's products contract over V, so each V block writes
partial sums (summed in XLA). Outputs go straight from registers to global memory: no smem
staging, so two input slots still fit in smem.

``shared_v`` (as in the forward; the default at B·H >= 64): one CTA per head, one warpgroup per V block; warpgroup 0
loads ``W, qg, kg, A_qk, d`` once per chunk for all. Step 2 is summed inside the CTA by chaining
wgmmas: every operand of those products (``do, h, v_new, dS, -dv_new`` of each V block) already
sits in smem for step 1 or 3, so one warpgroup owns each whole product and accumulates all V
blocks' ``a_j @ b_j^T`` into one accumulator (``dqg, dA_qk, dd`` on warpgroup 0, ``dkg, dW`` on
warpgroup 1). Why not stage one warpgroup's fp32 partial in smem and add: a [C, K] fp32 partial is
32 KiB that the budget below does not have, and chaining costs no smem, no extra adds and no
extra pass. Only ``dd`` (a diagonal, no matmul) is staged: 512 B per warpgroup.

Smem at K = V = 128 (bf16, C = 64, two warpgroups; the limit is 227 KiB): per chunk W, qg, kg
48 KiB, A_qk 8, d 0.5, and per warpgroup u 8, h 16, do 8; plus per warpgroup dS 16 and -dv_new 8
(``v_new`` overwrites ``u`` in place). Two slots of every input would take 290 KiB, so when they do
not fit (:func:`shared_slotted`) the shared inputs and ``u`` get one slot while ``h`` and ``do``
(the per-V-block bytes) keep two: 225280 B by Mosaic GPU's estimate (the default kernel: 216064).
Of the one-slot inputs, kg, A_qk and d are refilled for the next chunk as soon as every
warpgroup has its dv_new and decay (mid-chunk); W, qg and u (48 KiB) once the chunk is done, so
their load is not overlapped. At K = 64 every input keeps two slots (200704 B).
The warpgroups meet twice per chunk: after writing ``v_new, dS, -dv_new`` (so the owners may read
them) and at the chunk's end (so nobody overwrites what another still reads).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import int_ops
from pallas_kernels.kda.kernel_gpu_util import (
    SLOTS, Stream, T, mma, mma2, mma_sum, pipelined_chunks, pipelined_chunks_lockstep,
)
from pallas_kernels.kda.kernel_gpu_util import smem as _smem

BF16 = jnp.bfloat16
F32 = jnp.float32
WGMMA = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)
CTA_SMEM_BYTES = 227 * 1024  # the most dynamic shared memory one CTA may take on an H100/H200


# Jitted so that every call with the same shapes reuses one traced jaxpr, which JAX lowers once per
# module: identical layers (and their remat recomputes) then share one Mosaic GPU kernel, compiled once.
@functools.partial(jax.jit, static_argnames=("bv", "interpret", "shared_v", "wu_dtype"))
def scan_bwd(w, qg, kg, u, aqk, d, h, do, dsT, *, bv: int, interpret: bool, shared_v: bool = False,
             wu_dtype=F32):
    """Gradients of the scan: ``(dw, du, dqg, dkg, daqk, dd, ds0)``, fp32, same shapes as inputs.

    ``wu_dtype``: dw and du's dtype (bf16 when W and U entered the scan as bf16: the shared kernel
    then rounds them as it stores them, instead of XLA converting its fp32 stores). ``do`` may also
    come token-major ``[B,Tp,H,V]`` (as the scan wrote o): the shared kernel reads it so by TMA,
    the other is given a head-major copy.

    w, qg, kg ``[BH,Tp,K]``, u and do ``[BH,Tp,V]``, aqk ``[BH,Tp,C]`` (bf16); d ``[BH,N,K]``,
    h ``[BH,N*K,V]`` (bf16 entering states), dsT ``[BH,K,V]`` (fp32). ``shared_v``: one CTA per
    head (at most two V blocks), the V sums taken in the kernel.
    """
    BH, Tp, K = w.shape
    V = u.shape[-1]
    C = aqk.shape[-1]
    n, nv = Tp // C, V // bv
    if do.ndim == 4 and not shared_v:
        do = jnp.swapaxes(do, 1, 2).reshape(BH, Tp, V)
    if shared_v:
        if nv > 2:
            raise ValueError(f"bv must be at least V/2={V // 2} with shared_v, got {bv}")
        return _scan_bwd_shared(w, qg, kg, u, aqk, d, h, do, dsT, bv=bv, interpret=interpret, wu_dtype=wu_dtype)

    def kernel(w_g, qg_g, kg_g, u_g, aqk_g, d_g, h_g, do_g, dsT_g,
               du_g, dw_g, dqg_g, dkg_g, daqk_g, dd_g, ds0_g,
               w_b, qg_b, kg_b, u_b, aqk_b, d_b, h_b, do_b, vn_buf, ds_buf, ndvn_buf, bar):
        vi, bh = lax.axis_index("v"), lax.axis_index("bh")
        vs = pl.ds(vi * bv, bv)
        streams = [
            Stream(w_g.at[bh], C, w_b), Stream(qg_g.at[bh], C, qg_b), Stream(kg_g.at[bh], C, kg_b),
            Stream(u_g.at[bh, :, vs], C, u_b), Stream(aqk_g.at[bh], C, aqk_b),
            Stream(d_g.at[bh], 1, d_b), Stream(h_g.at[bh, :, vs], K, h_b),
            Stream(do_g.at[bh, :, vs], C, do_b),
        ]

        def body(c, slot, bufs, dS):
            w_s, qg_s, kg_s, u_s, aqk_s, d_s, h_s, do_s = bufs
            rows = pl.ds(c * C, C)
            v_new = plgpu.load(u_s, layout=WGMMA).astype(F32) - mma(w_s, h_s, (C, bv))
            vn_buf[...] = v_new.astype(BF16)
            ds_buf[...] = dS.astype(BF16)
            plgpu.commit_smem()
            dvn = mma2(T(aqk_s), do_s, kg_s, ds_buf, (C, bv))
            du_g.at[bh, rows, vs][...] = dvn
            ndvn_buf[...] = (-dvn).astype(BF16)
            plgpu.commit_smem()
            daqk_g.at[vi, bh, rows][...] = mma(do_s, T(vn_buf), (C, C))
            dqg_g.at[vi, bh, rows][...] = mma(do_s, T(h_s), (C, K))
            dkg_g.at[vi, bh, rows][...] = mma(vn_buf, T(ds_buf), (C, K))
            dw_g.at[vi, bh, rows][...] = mma(ndvn_buf, T(h_s), (C, K))
            s_prev = plgpu.load(h_s, layout=WGMMA).astype(F32)
            dd_g.at[vi, bh, c][...] = jnp.sum(dS * s_prev, axis=1)
            decay = lax.broadcast_in_dim(plgpu.load(d_s.at[0], layout=ROW), (K, bv), [0])
            return dS * decay + mma2(T(qg_s), do_s, T(w_s), ndvn_buf, (K, bv))

        ds_init = plgpu.load(dsT_g.at[bh, :, vs], layout=WGMMA, optimized=False)
        dS = pipelined_chunks(n, streams, bar, body, ds_init, reverse=True)
        ds0_g.at[bh, :, vs][...] = dS

    part = lambda cols: jax.ShapeDtypeStruct((nv, BH, Tp, cols), F32)
    out_type = [
        jax.ShapeDtypeStruct((BH, Tp, V), F32), part(K), part(K), part(K), part(C),
        jax.ShapeDtypeStruct((nv, BH, n, K), F32), jax.ShapeDtypeStruct((BH, K, V), F32),
    ]
    smem = functools.partial(_smem, swizzle=min(128, 2 * bv))  # one swizzle for all wgmma operands
    scratch = [
        smem((C, K)), smem((C, K)), smem((C, K)), smem((C, bv)), smem((C, C)),
        smem((1, K), F32, mma=False), smem((K, bv)), smem((C, bv)),
        smem((C, bv), slots=None), smem((K, bv), slots=None), smem((C, bv), slots=None),
        plgpu.Barrier(num_arrivals=8, num_barriers=SLOTS),
    ]
    extra = {"interpret": plgpu.InterpretGPUParams()} if interpret else {}
    call = plgpu.kernel(
        kernel, out_type=out_type, scratch_types=scratch, grid=(nv, BH), grid_names=("v", "bh"),
        kernel_name="kda_scan_bwd", **extra,
    )
    du, dw, dqg, dkg, daqk, dd, ds0 = call(w, qg, kg, u, aqk, d, h, do, dsT)
    total = lambda x: jnp.sum(x, axis=0)
    return total(dw).astype(wu_dtype), du.astype(wu_dtype), total(dqg), total(dkg), total(daqk), total(dd), ds0


def shared_slotted(C: int, K: int, V: int, bv: int) -> bool:
    """Whether every input of the ``shared_v`` backward fits two slots in one CTA's smem (bf16 operands)."""
    nv = V // bv
    shared = 3 * C * K * 2 + C * C * 2 + K * 4
    own = nv * (2 * C * bv + K * bv) * 2
    scratch = nv * ((K * bv + C * bv) * 2 + K * 4)
    return SLOTS * (shared + own) + scratch + 1024 <= CTA_SMEM_BYTES  # 1 KiB for barriers and alignment


def _scan_bwd_shared(w, qg, kg, u, aqk, d, h, do, dsT, *, bv, interpret, wu_dtype=F32):
    """``scan_bwd`` with one CTA per head whose warpgroups (one per V block) share the chunk loads
    and chain step 2's V sums in wgmma accumulators (module docstring)."""
    BH, Tp, K = w.shape
    V, C = u.shape[-1], aqk.shape[-1]
    n, nv = Tp // C, V // bv
    two = shared_slotted(C, K, V, bv)

    def kernel(w_g, qg_g, kg_g, u_g, aqk_g, d_g, h_g, do_g, dsT_g,
               du_g, dw_g, dqg_g, dkg_g, daqk_g, dd_g, ds0_g,
               w_b, qg_b, kg_b, aqk_b, d_b, u_b, h_b, do_b, ds_buf, ndvn_buf, dd_buf, bar, released, ready):
        vi, bh = lax.axis_index("wg"), lax.axis_index("bh")
        vs = pl.ds(vi * bv, bv)
        # kg, A_qk and d are done with once every warpgroup has dv_new and its decay: one slot,
        # refilled mid-chunk; W and qg are read until the chunk's end.
        shared = [Stream(g.at[bh], r, b, two, early=not two and early) for g, r, b, early in
                  ((w_g, C, w_b, False), (qg_g, C, qg_b, False), (kg_g, C, kg_b, True), (aqk_g, C, aqk_b, True),
                   (d_g, 1, d_b, True))]
        if len(do_g.shape) == 4:  # token-major [B, Tp, H, V]
            heads = do_g.shape[2]
            do_rows = do_g.at[int_ops.div(bh, heads), :, int_ops.rem(bh, heads), vs]
        else:
            do_rows = do_g.at[bh, :, vs]
        own = [Stream(u_g.at[bh, :, vs], C, u_b.at[vi], two), Stream(h_g.at[bh, :, vs], K, h_b.at[vi]),
               Stream(do_rows, C, do_b.at[vi])]
        bufs = dict(u=u_b, h=h_b, do=do_b, ds=ds_buf, ndvn=ndvn_buf, dd=dd_buf)
        step = functools.partial(_shared_step, bufs, (dw_g, dqg_g, dkg_g, daqk_g, dd_g), du_g, ready,
                                 bh=bh, vi=vi, nv=nv)
        ds_init = plgpu.load(dsT_g.at[bh, :, vs], layout=WGMMA, optimized=False)
        dS = pipelined_chunks_lockstep(n, shared, own, bar, released, step, ds_init, wg=vi, reverse=True)
        ds0_g.at[bh, :, vs][...] = dS

    out_type = [jax.ShapeDtypeStruct(s, dt) for s, dt in
                (((BH, Tp, V), wu_dtype), ((BH, Tp, K), wu_dtype), ((BH, Tp, K), F32), ((BH, Tp, K), F32),
                 ((BH, Tp, C), F32), ((BH, n, K), F32), ((BH, K, V), F32))]
    smem = functools.partial(_smem, swizzle=min(128, 2 * bv))  # one swizzle for all wgmma operands
    slots = SLOTS if two else None
    scratch = [
        smem((C, K), slots=slots), smem((C, K), slots=slots), smem((C, K), slots=slots), smem((C, C), slots=slots),
        smem((1, K), F32, mma=False, slots=slots),
        smem((C, bv), slots=slots, groups=nv), smem((K, bv), groups=nv), smem((C, bv), groups=nv),
        smem((K, bv), slots=None, groups=nv), smem((C, bv), slots=None, groups=nv),
        smem((1, K), F32, mma=False, slots=None, groups=nv),
        plgpu.Barrier(num_arrivals=5 + 3 * nv, num_barriers=SLOTS),
        plgpu.Barrier(num_arrivals=nv, num_barriers=SLOTS),
        plgpu.Barrier(num_arrivals=nv),
    ]
    extra = {"interpret": plgpu.InterpretGPUParams()} if interpret else {}
    call = plgpu.kernel(
        kernel, out_type=out_type, scratch_types=scratch, grid=(BH,), grid_names=("bh",), num_threads=nv,
        thread_name="wg", kernel_name="kda_scan_bwd_shared", **extra,
    )
    du, dw, dqg, dkg, daqk, dd, ds0 = call(w, qg, kg, u, aqk, d, h, do, dsT)
    return dw, du, dqg, dkg, daqk, dd, ds0


def _shared_step(bufs, outs, du_g, ready, c, slot, ins, dS, refill, *, bh, vi, nv):
    """One chunk of one warpgroup: steps 1 and 3 on its V block; the step-2 products it owns over all."""
    dw_g, dqg_g, dkg_g, daqk_g, dd_g = outs
    w_s, qg_s, kg_s, aqk_s, d_s, u_s, h_s, do_s = ins
    C, bv = u_s.shape
    K = h_s.shape[0]
    rows = pl.ds(c * C, C)
    ds_s, ndvn_s = bufs["ds"].at[vi], bufs["ndvn"].at[vi]
    v_new = plgpu.load(u_s, layout=WGMMA).astype(F32) - mma(w_s, h_s, (C, bv))
    u_s[...] = v_new.astype(BF16)  # u is not read again: its slot holds v_new for every warpgroup
    ds_s[...] = dS.astype(BF16)
    plgpu.commit_smem()
    dvn = mma2(T(aqk_s), do_s, kg_s, ds_s, (C, bv))
    du_g.at[bh, rows, pl.ds(vi * bv, bv)][...] = dvn.astype(du_g.dtype)
    ndvn_s[...] = (-dvn).astype(BF16)
    s_prev = plgpu.load(h_s, layout=WGMMA).astype(F32)
    bufs["dd"].at[vi, 0][...] = jnp.sum(dS * s_prev, axis=1)
    # Plain smem loads come before the sync below: the interpreter's race detector orders them
    # against the next chunk's refill only through a sync event that follows them.
    d_row = plgpu.load(d_s.at[0], layout=ROW)  # [K]: a few registers, broadcast only at the end
    plgpu.commit_smem()
    plgpu.barrier_arrive(ready)
    plgpu.barrier_wait(ready)  # every V block's v_new, dS, -dv_new and dd partial are in smem
    refill()  # and nobody reads kg, A_qk, d again in this chunk

    def of(name, j):  # warpgroup j's buffer for this chunk
        buf = bufs[name].at[j]
        return buf.at[slot] if len(buf.shape) == 3 else buf

    vn, h, do, ds, ndvn = (functools.partial(of, name) for name in ("u", "h", "do", "ds", "ndvn"))
    products = [  # (gmem rows, a_j, b_j, cols): sum_j a_j @ b_j^T over the V blocks j
        (dqg_g.at[bh, rows], do, h, K), (dkg_g.at[bh, rows], vn, ds, K),
        (daqk_g.at[bh, rows], do, vn, C), (dw_g.at[bh, rows], ndvn, h, K),
    ]
    for p, (out, a, b, cols) in enumerate(products):
        @pl.when(vi == p % nv)
        def _own():
            out[...] = mma_sum([(a(j), T(b(j))) for j in range(nv)], (C, cols)).astype(out.dtype)

    @pl.when(vi == 0)
    def _dd():
        part = lambda j: plgpu.load(bufs["dd"].at[j, 0], layout=ROW)
        total = part(0)
        for j in range(1, nv):
            total = total + part(j)
        dd_g.at[bh, c][...] = total

    decay = lax.broadcast_in_dim(d_row, (K, bv), [0])
    return dS * decay + mma2(T(qg_s), do_s, T(w_s), ndvn_s, (K, bv))
