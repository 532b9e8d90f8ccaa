"""Backward of the KDA inter-chunk scan on Hopper (Mosaic GPU), one reverse pass per (head, V block).

Forward per chunk (entering state S, from the saved per-chunk states ``h``):
``v_new = U - W S``; ``o = qg S + A_qk v_new``; ``S' = d * S + kg^T v_new``.
With ``dS`` the gradient of ``S'`` and ``do`` that of ``o``, walking chunks last to first:

1. ``dv_new = A_qk^T do + kg dS``  (this is ``dU``; ``dW = -dv_new S^T``)
2. ``dA_qk = do v_new^T``, ``dqg = do S^T``, ``dkg = v_new dS^T``, ``dd = rowsum(dS * S)``
3. ``dS <- d * dS + qg^T do - W^T dv_new``

Step 2's products contract over V, so each V block writes partial sums (summed in XLA). Outputs go
straight from registers to global memory: no smem staging, so two input slots still fit in smem.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.kernel_gpu_util import SLOTS, Stream, T, mma, mma2, pipelined_chunks
from pallas_kernels.kda.kernel_gpu_util import smem as _smem

BF16 = jnp.bfloat16
F32 = jnp.float32
WGMMA = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)


# Jitted so that every call with the same shapes reuses one traced jaxpr, which JAX lowers once per
# module: identical layers (and their remat recomputes) then share one Mosaic GPU kernel, compiled once.
@functools.partial(jax.jit, static_argnames=("bv", "interpret"))
def scan_bwd(w, qg, kg, u, aqk, d, h, do, dsT, *, bv: int, interpret: bool):
    """Gradients of the scan: ``(dw, du, dqg, dkg, daqk, dd, ds0)``, fp32, same shapes as inputs.

    w, qg, kg ``[BH,Tp,K]``, u and do ``[BH,Tp,V]``, aqk ``[BH,Tp,C]`` (bf16); d ``[BH,N,K]``,
    h ``[BH,N*K,V]`` (bf16 entering states), dsT ``[BH,K,V]`` (fp32).
    """
    BH, Tp, K = w.shape
    V = u.shape[-1]
    C = aqk.shape[-1]
    n, nv = Tp // C, V // bv

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
    return total(dw), du, total(dqg), total(dkg), total(daqk), total(dd), ds0
