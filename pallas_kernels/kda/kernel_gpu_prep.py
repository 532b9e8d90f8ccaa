"""KDA intra-chunk prep as one Mosaic GPU kernel per chunk (the forward of ``kernel_gpu_intra``).

Same outputs as :func:`kernel_gpu_intra.prepare` (``W, U, qg, kg, A_qk``; ``d`` stays in XLA),
computed on the tensor cores per chunk of C = 64 tokens by one warpgroup:

1. Scores with one causal anchor per 16-token tile (its first row): for tile t,
   ``Q_t = q e^{G - a_t}`` on the tile's rows, ``K_t = k e^{a_t - G}`` on rows up to the tile's
   end (exponent masked before ``exp``), ``A_qk += Q_t K_t^T``, ``A_kk += (k e^{G-a_t})_t K_t^T``;
   bf16 operands (|exponents| <= 75 thanks to the -5 gate bound), fp32 accumulation.
2. ``T = (I + L)^{-1} = prod_{k<6} (I + P^{2^k})`` with ``P = -L`` (L strictly lower, so
   ``L^64 = 0``): 5 squarings and 5 products, each as three bf16 wgmmas on a hi/lo split of the
   fp32 factors (``x ~ hi + lo``), which keeps the inverse near fp32 precision.
3. ``W = T (beta k e^G)``, ``U = T (beta v)`` (T split hi/lo, right-hand sides in bf16);
   ``qg = scale q e^G``, ``kg = k e^{G_last - G}``; document masks as in the XLA version.

The backward is JAX autodiff of the XLA version (``kernel_gpu.py`` wires it with custom_vjp).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.kernel_gpu_intra import SUB as _XLA_SUB
from pallas_kernels.kda.kernel_gpu_intra import document_masks, prepare_from_index
from pallas_kernels.kda.kernel_gpu_util import T, mma2, smem

BF16 = jnp.bfloat16
F32 = jnp.float32
WGMMA = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)
COL = plgpu.Layout.WGMMA.reduce(0)
SUB = _XLA_SUB
CHUNK = 64
# Rows of the per-chunk vector block: beta, fresh (row still sees the entering state), to_end
# (row's write survives to the chunk end), document index (as f32) twice: loading one smem row
# in both the row and the column layout sends Mosaic's layout inference into an endless search.
BETA, FRESH, TO_END, SEG, SEG_T = range(5)


def _wg(x):
    """Pin the WGMMA register layout: leaving it to inference makes its search blow up here."""
    return plgpu.layout_cast(x, WGMMA)


def _split(x):
    hi = _wg(x.astype(BF16))
    return hi, _wg((x - hi.astype(F32)).astype(BF16))


def _mma_split(a_hi, a_lo, b_hi, b_lo, shape):
    """``a @ b`` from hi/lo bf16 halves: hi*hi + hi*lo + lo*hi (the lo*lo term is below fp32)."""

    def scope(acc):
        plgpu.wgmma(acc, a_hi, b_hi)
        plgpu.wgmma(acc, a_hi, b_lo)
        plgpu.wgmma(acc, a_lo, b_hi)
        return acc[...]

    return pl.run_scoped(scope, plgpu.ACC(shape, F32))


def _anchored_scores(q, k, G, anc_s, ops, col_vec):
    """Unmasked ``(sum_c q_i k_j e^{G_i-G_j}, same with k_i)`` [C, C], one causal anchor per tile."""
    C, K = G.shape
    opa, opb, opc = ops
    r = plgpu.broadcasted_iota(jnp.int32, (C, K), 0, layout=WGMMA)

    def scope(acc_qk, acc_kk):
        for t in range(C // SUB):
            a = col_vec(anc_s.at[t])
            in_t = (r >= t * SUB) & (r < (t + 1) * SUB)
            ec = jnp.exp(jnp.where(r < (t + 1) * SUB, a - G, -jnp.inf))  # masked before exp
            er = jnp.exp(jnp.where(in_t, G - a, 0.0))
            opa[...] = _wg(jnp.where(in_t, q * er, 0.0).astype(BF16))
            opb[...] = _wg(jnp.where(in_t, k * er, 0.0).astype(BF16))
            opc[...] = _wg((k * ec).astype(BF16))
            plgpu.commit_smem()
            plgpu.wgmma(acc_qk, opa, T(opc))
            plgpu.wgmma(acc_kk, opb, T(opc))
            plgpu.wgmma_wait(0)  # the next tile overwrites the operands
        return acc_qk[...], acc_kk[...]

    return pl.run_scoped(scope, plgpu.ACC((C, C), F32), plgpu.ACC((C, C), F32))


def _unit_lower_inverse(p, ri, cj, bufs):
    """``(I - P)^{-1} = prod_{k<6} (I + P^{2^k})`` for strictly lower P [64, 64] (P^64 = 0)."""
    xh, xl, ph, pl_ = bufs
    C = p.shape[0]
    x = _wg(jnp.where(ri == cj, 1.0, 0.0) + p)
    for _ in range(C.bit_length() - 2):  # square P, then X <- X + X P
        ph[...], pl_[...] = _split(p)
        xh[...], xl[...] = _split(p)  # wgmma cannot read one ref as both operands
        plgpu.commit_smem()
        p = _wg(_mma_split(xh, xl, ph, pl_, (C, C)))
        xh[...], xl[...] = _split(x)
        ph[...], pl_[...] = _split(p)
        plgpu.commit_smem()
        x = _wg(x + _mma_split(xh, xl, ph, pl_, (C, C)))
    return x


# Jitted so that every call with the same shapes reuses one traced jaxpr, which JAX lowers once per
# module: identical layers (and their remat recomputes) then share one Mosaic GPU kernel, compiled once.
@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def prep_fwd(q, k, v, G, anchors, vecs, *, scale: float, interpret: bool):
    """``(w, u, qg, kg, aqk)`` bf16, head-major like :func:`kernel_gpu_intra.prepare`.

    q, k ``[BH,Tp,K]`` and v ``[BH,Tp,V]`` bf16; G ``[BH,Tp,K]`` f32 chunk-local cumsum;
    anchors ``[BH,N*8,K]`` f32 (rows 0-3: G at each tile's first row, row 4: G at the chunk's
    last row); vecs ``[BH,5,Tp]`` f32 (rows BETA, FRESH, TO_END, SEG, SEG_T).
    """
    BH, Tp, K = q.shape
    V = v.shape[-1]
    C = 64
    n, nt = Tp // C, C // SUB

    def kernel(q_g, k_g, v_g, G_g, anc_g, vec_g, w_g, u_g, qg_g, kg_g, aqk_g,
               q_s, k_s, v_s, G_s, anc_s, vec_s, opa, opb, opc, xh, xl, ph, pl_, bar):
        c, bh = lax.axis_index("c"), lax.axis_index("bh")
        rows = pl.ds(c * C, C)
        for src, dst in ((q_g.at[bh, rows], q_s), (k_g.at[bh, rows], k_s), (v_g.at[bh, rows], v_s),
                         (G_g.at[bh, rows], G_s), (anc_g.at[bh, pl.ds(c * 8, 8)], anc_s),
                         (vec_g.at[bh, :, rows], vec_s)):
            plgpu.copy_gmem_to_smem(src, dst, bar)
        plgpu.barrier_wait(bar)

        G = plgpu.load(G_s, layout=WGMMA)
        q = plgpu.load(q_s, layout=WGMMA).astype(F32)
        k = plgpu.load(k_s, layout=WGMMA).astype(F32)

        def col_vec(ref, n_rows=C, n_cols=K):  # a [n_cols] smem row, repeated down the rows
            return _wg(lax.broadcast_in_dim(plgpu.load(ref, layout=COL), (n_rows, n_cols), [1]))

        def row_vec(i, n_cols):  # row i of the vector block, one value per token row
            return _wg(lax.broadcast_in_dim(plgpu.load(vec_s.at[i], layout=ROW), (C, n_cols), [0]))

        a_qk, a_kk = _anchored_scores(q, k, G, anc_s, (opa, opb, opc), col_vec)
        ri = plgpu.broadcasted_iota(jnp.int32, (C, C), 0, layout=WGMMA)
        cj = plgpu.broadcasted_iota(jnp.int32, (C, C), 1, layout=WGMMA)
        same = row_vec(SEG, C) == col_vec(vec_s.at[SEG_T], n_cols=C)
        aqk = _wg(jnp.where((cj <= ri) & same, scale * a_qk, 0.0))
        p = _wg(jnp.where((cj < ri) & same, -row_vec(BETA, C) * a_kk, 0.0))  # P = -L

        x = _unit_lower_inverse(p, ri, cj, (xh, xl, ph, pl_))

        xh[...], xl[...] = _split(x)
        expG = jnp.exp(G)
        opa[...] = _wg((row_vec(BETA, K) * row_vec(FRESH, K) * k * expG).astype(BF16))
        vb = row_vec(BETA, V) * plgpu.load(v_s, layout=WGMMA).astype(F32)
        v_s[...] = _wg(vb.astype(BF16))
        plgpu.commit_smem()
        w = mma2(xh, opa, xl, opa, (C, K))  # T rhs with T as hi + lo
        u = mma2(xh, v_s, xl, v_s, (C, V))

        opb[...] = _wg(w.astype(BF16))
        v_s[...] = _wg(u.astype(BF16))
        opc[...] = _wg((scale * row_vec(FRESH, K) * q * expG).astype(BF16))
        k_s[...] = _wg((row_vec(TO_END, K) * k * jnp.exp(col_vec(anc_s.at[nt]) - G)).astype(BF16))
        ph[...] = _wg(aqk.astype(BF16))
        plgpu.commit_smem()
        for src, dst in ((opb, w_g), (v_s, u_g), (opc, qg_g), (k_s, kg_g), (ph, aqk_g)):
            plgpu.copy_smem_to_gmem(src, dst.at[bh, rows])
        plgpu.wait_smem_to_gmem(0)

    out_type = [jax.ShapeDtypeStruct((BH, Tp, K), BF16), jax.ShapeDtypeStruct((BH, Tp, V), BF16),
                jax.ShapeDtypeStruct((BH, Tp, K), BF16), jax.ShapeDtypeStruct((BH, Tp, K), BF16),
                jax.ShapeDtypeStruct((BH, Tp, C), BF16)]
    one = dict(slots=None)
    scratch = [
        smem((C, K), **one), smem((C, K), **one), smem((C, V), **one), smem((C, K), F32, **one),
        smem((8, K), F32, mma=False, **one), smem((5, C), F32, mma=False, **one),
        smem((C, K), **one), smem((C, K), **one), smem((C, K), **one),
        smem((C, C), **one), smem((C, C), **one), smem((C, C), **one), smem((C, C), **one),
        plgpu.Barrier(num_arrivals=6),
    ]
    extra = {"interpret": plgpu.InterpretGPUParams()} if interpret else {}
    call = plgpu.kernel(
        kernel, out_type=out_type, scratch_types=scratch, grid=(n, BH), grid_names=("c", "bh"),
        kernel_name="kda_prep_fwd", **extra,
    )
    return call(q, k, v, G, anchors, vecs)


def _kernel_inputs(q, k, v, g, beta, sidx):
    """Head-major bf16 q/k/v, the chunk-local cumsum G, per-chunk anchors and row vectors, and d."""
    B, T, H, K = k.shape
    C = CHUNK
    n = -(-T // C)
    pad = n * C - T
    padded = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    heads = lambda x: jnp.moveaxis(padded(x), 2, 1).reshape(B * H, n * C, *x.shape[3:])
    q, k, v = (heads(x).astype(BF16) for x in (q, k, v))
    G = jnp.cumsum(heads(g.astype(F32)).reshape(B * H, n, C, K), axis=2)  # [BH,N,C,K]
    anchors = jnp.concatenate(
        [G[:, :, ::SUB], G[:, :, -1:], jnp.zeros((B * H, n, 8 - C // SUB - 1, K), F32)], axis=2
    )
    seg, fresh, to_end = document_masks(sidx, C)  # [B,N,C]
    per_head = lambda x: jnp.broadcast_to(x.reshape(B, 1, n * C), (B, H, n * C)).astype(F32)
    b = jnp.moveaxis(padded(beta.astype(F32)), 2, 1)  # [B,H,Tp]
    vecs = jnp.stack([b, per_head(fresh), per_head(to_end), per_head(seg), per_head(seg)], axis=2)
    d = jnp.where(fresh[:, None, :, -1:], jnp.exp(G[:, :, -1].reshape(B, H, n, K)), 0.0)
    return q, k, v, G.reshape(B * H, n * C, K), anchors.reshape(B * H, n * 8, K), \
        vecs.reshape(B * H, 5, n * C), d.reshape(B * H, n, K)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def prepare_fused(q, k, v, g, beta, sidx_f, scale: float, interpret: bool):
    """:func:`kernel_gpu_intra.prepare_from_index` with the forward in one Mosaic GPU kernel.

    ``sidx_f`` is the running document index as f32 (a float so it can sit in a custom_vjp).
    Outputs are upcast to f32 to match the XLA version (the scan casts them back for free).
    """
    qh, kh, vh, G, anchors, vecs, d = _kernel_inputs(q, k, v, g, beta, sidx_f.astype(jnp.int32))
    outs = prep_fwd(qh, kh, vh, G, anchors, vecs, scale=scale, interpret=interpret)
    return (*(x.astype(F32) for x in outs), d)


def _fused_fwd(q, k, v, g, beta, sidx_f, scale, interpret):
    return prepare_fused(q, k, v, g, beta, sidx_f, scale, interpret), (q, k, v, g, beta, sidx_f)


def _fused_bwd(scale, interpret, res, cts):
    q, k, v, g, beta, sidx_f = res
    xla = lambda *a: prepare_from_index(*a, sidx_f.astype(jnp.int32), scale=scale, chunk=CHUNK)
    _, vjp = jax.vjp(xla, q, k, v, g, beta)
    return (*vjp(tuple(cts)), jnp.zeros_like(sidx_f))


prepare_fused.defvjp(_fused_fwd, _fused_bwd)
