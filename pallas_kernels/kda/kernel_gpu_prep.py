"""KDA intra-chunk prep as one Mosaic GPU kernel per chunk (the forward of ``kernel_gpu_intra``).

Same outputs as :func:`kernel_gpu_intra.prepare` (``W, U, qg, kg, A_qk, d``), computed on the
tensor cores per chunk of C = 64 tokens by one warpgroup; q, k, v, g are read token-major by TMA
(``[B,T,H,.]`` sliced per head, no transposes), the outputs are head-major for the scan.

0. ``G = tril(1) @ g`` (g split into three bf16 parts: the chunk cumsum to fp32 accuracy), so XLA
   builds neither G nor the anchors for the forward.
1. Scores with one anchor per 16-token column tile s (its first row, ``b_s``): per tile,
   ``(q|k)_i e^{G_i - b_s}`` on rows ``i >= 16 s`` (exponent masked before ``exp``) times
   ``k_j e^{b_s - G_j}`` on the tile's rows j (other rows zero), accumulated full width; bf16
   operands (|exponents| <= 75 thanks to the -5 gate bound). The right operand is formed once for
   all rows, each with its own tile's anchor, and masked per tile.
2. ``T = (I + L)^{-1} = sum_{m<64} P^m`` (``P = -L`` strictly lower) by doubling,
   ``S <- S + S Q``, ``Q <- Q^2``: both products of a round are issued together (6 dependent
   steps), each as three bf16 wgmmas on a hi/lo split of the fp32 factors (near fp32 precision).
3. ``W = T (beta k e^G)``, ``U = T (beta v)`` (T split hi/lo, right-hand sides in bf16; v is
   loaded by TMA during the inverse, both products under one wait); ``qg = scale q e^G``,
   ``kg = k e^{G_last - G}``, ``d = e^{G_last}``; document masks as in the XLA version.
   ``exp`` is ``ex2.approx`` (``approx_math``). Left wgmma operands come from registers.

Shared memory is ~109 KB (K = V = 128: g/G, the score operands and the inverse's operands with v
share one region by lifetime) so two CTAs share an SM. The score tiles and the inverse's rounds
are ``lax.fori_loop``s, not Python loops: unrolled, the kernel was bound by instruction fetch
(Nsight Compute on the H200: 61 % of its stall cycles, 5.05 ms at B,T,H,D = 4,8192,32,128); as
loops with ``ex2.approx`` it took 1.9 ms, and the whole forward 3.16 ms with this in-kernel
cumsum (benchmarks/RESULTS.md). Under differentiation :func:`prepare_fused` runs the XLA prep
instead, with its own autodiff; ``prep_bwd="split"`` (:mod:`kernel_gpu_prep_bwd_split`) runs this
kernel with the two Mosaic GPU backward kernels, which take G and its anchors from it (``save_g``).
Operands from registers and the right operand formed once (:mod:`kernel_gpu_prep_operands`) and
the saved G cut it to 2.37 ms (fwd) / 9.86 ms (fwd+bwd) at 4,8192,32,128 (stop 36; jla 2.86 /
12.02 in the same call).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import int_ops
from pallas_kernels.kda.kernel_gpu_intra import SUB as _XLA_SUB
from pallas_kernels.kda.kernel_gpu_intra import PRECISIONS, prepare_from_index
from pallas_kernels.kda.kernel_gpu_prep_operands import lhs, row_anchors
from pallas_kernels.kda.kernel_gpu_prep_inputs import (  # noqa: F401 (re-exported)
    CHUNK, _bwd_inputs, _cumsum_anchors, _kernel_inputs, _masked_decay)
from pallas_kernels.kda.kernel_gpu_util import T, smem

BF16 = jnp.bfloat16
F32 = jnp.float32
WGMMA = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)
COL = plgpu.Layout.WGMMA.reduce(0)
SUB = _XLA_SUB
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


def _pair(ops1, ops2, shapes):
    """Two independent wgmma chains issued back to back (one wait): ``(sum a@b over ops1, ops2)``."""

    def scope(acc1, acc2):
        for a, b in ops1:
            plgpu.wgmma(acc1, a, b)
        for a, b in ops2:
            plgpu.wgmma(acc2, a, b)
        return acc1[...], acc2[...]

    return pl.run_scoped(scope, *(plgpu.ACC(shape, F32) for shape in shapes))


def _hilo(a_hi, a_lo, b_hi, b_lo):
    """``a @ b`` from hi/lo bf16 halves: hi*hi + hi*lo + lo*hi (the lo*lo term is below fp32)."""
    return [(a_hi, b_hi), (a_hi, b_lo), (a_lo, b_hi)]


def _anchored_scores(G, q_s, k_s, anchor, ky, bufs, *, interpret=False):
    """Unmasked ``(sum_c q_i k_j e^{G_i-G_j}, same with k_i)`` [C, C] for j in tiles up to i's.

    Column tile s is anchored at its first row ``b_s``: ``(q|k)_i e^{G_i - b_s}`` for rows
    ``i >= 16 s`` (masked before exp) times ``k_j e^{b_s - G_j}`` for the rows j of tile s (the
    other rows zero), accumulated full width over the tiles. The tiles are a real loop, not an
    unrolled one: the kernel is bound by instruction fetch (Nsight Compute: ~60 % of its stall
    cycles were instruction-cache misses of the unrolled straight-line code), and the 4x larger
    wgmmas of the full-width form are still a small share of the time.
    ``ky``: a smem ref holding ``k_j e^{b_{j // 16} - G_j}`` (bf16) for every row, masked per tile;
    ``anchor(s)`` broadcasts ``b_s`` down the rows. Left operands come from registers.
    """
    C, K = G.shape
    kc_s, qa_s, ka_s = bufs
    r = plgpu.broadcasted_iota(jnp.int32, (C, K), 0, layout=WGMMA)
    left = functools.partial(lhs, regs=True, interpret=interpret)

    def scope(acc_qk, acc_kk):
        def tile(s, carry):
            x = jnp.exp(jnp.where(r >= s * SUB, G - anchor(s), -jnp.inf))
            # the right operand before k and q are loaded: the fewest registers live (ptxas spills less)
            kc_s[...] = _wg(jnp.where(int_ops.div(r, SUB) == s, plgpu.load(ky, layout=WGMMA), 0).astype(BF16))
            k = plgpu.load(k_s, layout=WGMMA).astype(F32)
            qa = left(_wg((plgpu.load(q_s, layout=WGMMA).astype(F32) * x).astype(BF16)), qa_s)
            ka = left(_wg((k * x).astype(BF16)), ka_s)
            plgpu.commit_smem()
            plgpu.wgmma(acc_qk, qa, T(kc_s))
            plgpu.wgmma(acc_kk, ka, T(kc_s))
            plgpu.wgmma_wait(0)  # the next tile overwrites the operands
            return carry

        lax.fori_loop(0, C // SUB, tile, 0)
        return acc_qk[...], acc_kk[...]

    return pl.run_scoped(scope, plgpu.ACC((C, C), F32), plgpu.ACC((C, C), F32))


def _unit_lower_inverse(p, ri, cj, bufs, *, regs=False, interpret=False):
    """``(I - P)^{-1} = sum_{m<64} P^m`` for strictly lower P [64, 64] (P^64 = 0), by doubling.

    ``S <- S + S Q`` and ``Q <- Q^2`` with ``S = sum_{m<2^j} P^m``, ``Q = P^{2^j}``: both use only
    the old S and Q (which commute), so each round issues its two products together and waits
    once: 6 dependent steps instead of 10. Q is stored twice (wgmma cannot read one ref as both
    operands), unless ``regs`` (the forward kernel): then the left operands (S and Q, hi and lo)
    come from registers and only Q's halves are stored, as the right operand. The backward kernels,
    whose inverse was timed with smem operands, keep ``regs=False``.
    """
    sh, sl, qh, ql, qah, qal = bufs
    C = p.shape[0]
    left = functools.partial(lhs, regs=regs, interpret=interpret)

    def stage(s, qq):  # stores the operands of S Q and Q Q; returns the left ones
        q_hi, q_lo = _split(qq)
        qh[...], ql[...] = q_hi, q_lo
        ops = (left(q_hi, qah), left(q_lo, qal))
        if s is not None:
            ops = (*(left(x, buf) for x, buf in zip(_split(s), (sh, sl))), *ops)
        plgpu.commit_smem()
        return ops

    s = _wg(jnp.where(ri == cj, 1.0, 0.0) + p)
    qa_hi, qa_lo = stage(None, p)
    qq = _wg(pl.run_scoped(lambda acc: _chain(acc, _hilo(qa_hi, qa_lo, qh, ql)), plgpu.ACC((C, C), F32)))

    def round_(_, carry):  # S_1 = I + P, Q_1 = P^2, ..., S_5, Q_5 (a loop: see _anchored_scores)
        s, qq = carry
        s_hi, s_lo, qa_hi, qa_lo = stage(s, qq)
        sq, qq = _pair(_hilo(s_hi, s_lo, qh, ql), _hilo(qa_hi, qa_lo, qh, ql), ((C, C), (C, C)))
        return _wg(s + sq), _wg(qq)

    s, qq = lax.fori_loop(0, C.bit_length() - 3, round_, (s, qq))
    s_hi, s_lo = (left(x, buf) for x, buf in zip(_split(s), (sh, sl)))  # then S_6 = S_5 + S_5 Q_5
    qh[...], ql[...] = _split(qq)
    plgpu.commit_smem()
    sq = pl.run_scoped(lambda acc: _chain(acc, _hilo(s_hi, s_lo, qh, ql)), plgpu.ACC((C, C), F32))
    return _wg(s + sq)


def _chain(acc, ops):
    for a, b in ops:
        plgpu.wgmma(acc, a, b)
    return acc[...]


def _chunk_cumsum(g_s, parts, tri_s):
    """``G = tril(1) @ g`` on the tensor cores, g split into three bf16 parts (exact to fp32)."""
    C, K = g_s.shape
    g = plgpu.load(g_s, layout=WGMMA)
    plgpu.commit_smem()  # every thread has read g before the parts overwrite its memory
    ri = plgpu.broadcasted_iota(jnp.int32, (C, C), 0, layout=WGMMA)
    cj = plgpu.broadcasted_iota(jnp.int32, (C, C), 1, layout=WGMMA)
    tri_s[...] = _wg(jnp.where(cj <= ri, 1.0, 0.0).astype(BF16))
    for part in parts:
        hi = _wg(g.astype(BF16))
        part[...] = hi
        g = _wg(g - hi.astype(F32))
    plgpu.commit_smem()
    return pl.run_scoped(lambda acc: _chain(acc, [(tri_s, part) for part in parts]), plgpu.ACC((C, K), F32))


# Jitted so that every call with the same shapes reuses one traced jaxpr, which JAX lowers once per
# module: identical layers (and their remat recomputes) then share one Mosaic GPU kernel, compiled once.
@functools.partial(jax.jit, static_argnames=("scale", "interpret", "save_g"))
def prep_fwd(q, k, v, g, vecs, *, scale: float, interpret: bool, save_g: bool = False):
    """``(w, u, qg, kg, aqk, e^{G_last})``: bf16 head-major ``[B*H, Tp, .]`` like
    :func:`kernel_gpu_intra.prepare`, and the fp32 chunk decay ``[B*H, N, K]`` before its mask.

    ``save_g`` also returns G ``[B,Tp,H,K]`` f32 and its anchors ``[B,N*8,H,K]`` (rows 0-3: G at
    each tile's first row, row 4: G_last; rows 5-7 unspecified, never read), as the backward
    kernels take them from :func:`_cumsum_anchors`.

    Token-major inputs, read in place by TMA (no transposes): q, k ``[B,Tp,H,K]`` and v
    ``[B,Tp,H,V]`` bf16; g ``[B,Tp,H,K]`` f32 (its chunk-local cumsum G is taken here); vecs
    ``[B*H,5,Tp]`` f32 (rows BETA, FRESH, TO_END, SEG, SEG_T).
    """
    B, Tp, H, K = q.shape
    V = v.shape[-1]
    C = CHUNK
    n, nt = Tp // C, C // SUB
    left = functools.partial(lhs, regs=True, interpret=interpret)

    def kernel(q_g, k_g, v_g, g_g, vec_g, w_g, u_g, qg_g, kg_g, aqk_g, dl_g, *rest):
        G_g, anc_g = rest[:2] if save_g else (None, None)
        q_s, k_s, anc_s, vec_s, aqk_s, union, bar, bar_v = rest[2 * save_g:]
        (g_s,), (G_s,), score_bufs, (inv_bufs, v_s) = union
        c, bh = lax.axis_index("c"), lax.axis_index("bh")
        b, h = int_ops.div(bh, H), int_ops.rem(bh, H)
        rows = pl.ds(c * C, C)
        for src, dst in ((q_g.at[b, rows, h], q_s), (k_g.at[b, rows, h], k_s), (g_g.at[b, rows, h], g_s),
                         (vec_g.at[bh, :, rows], vec_s)):
            plgpu.copy_gmem_to_smem(src, dst, bar)
        plgpu.barrier_wait(bar)
        G = _chunk_cumsum(g_s, score_bufs[:3], aqk_s)
        # The parts are read (the wgmma is done). G goes to its own ref: loading one ref both
        # whole (WGMMA layout) and by rows (COL) sends Mosaic's layout inference into an endless search.
        G_s[...] = G
        plgpu.commit_smem()
        for t, row in enumerate([SUB * i for i in range(nt)] + [C - 1]):  # anchors, then G_last
            anc_s.at[t][...] = plgpu.load(G_s.at[row], layout=COL)
        anc_s.at[nt + 1][...] = jnp.exp(plgpu.load(G_s.at[C - 1], layout=COL))
        plgpu.commit_smem()  # anchors visible; G_s is read before the score operands reuse it
        plgpu.copy_smem_to_gmem(anc_s.at[pl.ds(nt + 1, 1)], dl_g.at[bh, pl.ds(c, 1)])
        if save_g:
            plgpu.copy_smem_to_gmem(anc_s.at[pl.ds(0, nt + 1)], anc_g.at[b, pl.ds(c * 8, nt + 1), h])
            plgpu.copy_smem_to_gmem(G_s, G_g.at[b, rows, h])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # G_s is read before the score operands reuse it

        def col_vec(ref, n_cols=K):  # a [n_cols] smem row, repeated down the rows
            return _wg(lax.broadcast_in_dim(plgpu.load(ref, layout=COL), (C, n_cols), [1]))

        def row_vec(i, n_cols, times=None):  # row i of the vector block (times a factor), one value per token row
            x = plgpu.load(vec_s.at[i], layout=ROW)
            x = x if times is None else times * x  # on the [C] vector, before the broadcast
            return _wg(lax.broadcast_in_dim(x, (C, n_cols), [0]))

        ky = score_bufs[3]
        r = plgpu.broadcasted_iota(jnp.int32, (C, K), 0, layout=WGMMA)
        b_rows = row_anchors(col_vec, anc_s, r, sub=SUB)
        ky[...] = _wg((plgpu.load(k_s, layout=WGMMA).astype(F32) * jnp.exp(b_rows - G)).astype(BF16))
        a_qk, a_kk = _anchored_scores(G, q_s, k_s, lambda t: col_vec(anc_s.at[t]), ky, score_bufs[:3],
                                      interpret=interpret)
        ri = plgpu.broadcasted_iota(jnp.int32, (C, C), 0, layout=WGMMA)
        cj = plgpu.broadcasted_iota(jnp.int32, (C, C), 1, layout=WGMMA)
        same = row_vec(SEG, C) == col_vec(vec_s.at[SEG_T], n_cols=C)
        aqk_s[...] = _wg(jnp.where((cj <= ri) & same, scale * a_qk, 0.0).astype(BF16))
        p = _wg(jnp.where((cj < ri) & same, -row_vec(BETA, C) * a_kk, 0.0))  # P = -L

        # Outputs that need G, computed before the inverse so G dies early; kg is staged in a
        # score buffer (its store must finish reading before the inverse reuses that memory).
        kg_s = score_bufs[1]
        # The row factors are multiplied as [C] vectors, then broadcast (the same products).
        q_s[...] = _wg((row_vec(FRESH, K, scale) * plgpu.load(q_s, layout=WGMMA).astype(F32) * jnp.exp(G)).astype(BF16))
        k = plgpu.load(k_s, layout=WGMMA).astype(F32)
        kg_s[...] = _wg((row_vec(TO_END, K) * k * jnp.exp(col_vec(anc_s.at[nt]) - G)).astype(BF16))
        beta_fresh = plgpu.load(vec_s.at[BETA], layout=ROW)
        k_s[...] = _wg((row_vec(FRESH, K, beta_fresh) * k * jnp.exp(G)).astype(BF16))  # W's right side
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(kg_s, kg_g.at[bh, rows])
        plgpu.copy_smem_to_gmem(q_s, qg_g.at[bh, rows])
        plgpu.copy_smem_to_gmem(aqk_s, aqk_g.at[bh, rows])
        plgpu.wait_smem_to_gmem(2, wait_read_only=True)  # the kg store has read its buffer
        plgpu.copy_gmem_to_smem(v_g.at[b, rows, h], v_s, bar_v)  # lands during the inverse

        x = _unit_lower_inverse(p, ri, cj, inv_bufs, regs=True, interpret=interpret)
        xh, xl = inv_bufs[:2]
        x_hi, x_lo = _split(x)
        xh, xl = left(x_hi, xh), left(x_lo, xl)
        plgpu.barrier_wait(bar_v)
        v_s[...] = _wg((row_vec(BETA, V) * plgpu.load(v_s, layout=WGMMA).astype(F32)).astype(BF16))
        plgpu.commit_smem()
        w, u = _pair([(xh, k_s), (xl, k_s)], [(xh, v_s), (xl, v_s)], ((C, K), (C, V)))
        k_s[...] = _wg(w.astype(BF16))
        v_s[...] = _wg(u.astype(BF16))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_s, w_g.at[bh, rows])
        plgpu.copy_smem_to_gmem(v_s, u_g.at[bh, rows])
        plgpu.wait_smem_to_gmem(0)

    BH = B * H
    out_type = [jax.ShapeDtypeStruct((BH, Tp, K), BF16), jax.ShapeDtypeStruct((BH, Tp, V), BF16),
                jax.ShapeDtypeStruct((BH, Tp, K), BF16), jax.ShapeDtypeStruct((BH, Tp, K), BF16),
                jax.ShapeDtypeStruct((BH, Tp, C), BF16), jax.ShapeDtypeStruct((BH, n, K), F32),
                *[jax.ShapeDtypeStruct((B, Tp, H, K), F32), jax.ShapeDtypeStruct((B, n * 8, H, K), F32)] * save_g]
    one = dict(slots=None)
    # ~109 KB with K = V = 128, so two CTAs (two warpgroups) share an SM and hide each other's
    # TMA, exp and wgmma latency. g/G, the score operands (first the parts of g) and the
    # inverse's operands with v have disjoint lifetimes and share one region.
    union = plgpu.RefUnion(
        (smem((C, K), F32, mma=False, **one),),
        (smem((C, K), F32, mma=False, **one),),
        tuple(smem((C, K), **one) for _ in range(4)),  # the score operands and ky: 64 KB, as the next member
        (tuple(smem((C, C), **one) for _ in range(6)), smem((C, V), **one)),
    )
    scratch = [
        smem((C, K), **one), smem((C, K), **one), smem((8, K), F32, mma=False, **one),
        smem((5, C), F32, mma=False, **one), smem((C, C), **one),
        union, plgpu.Barrier(num_arrivals=4), plgpu.Barrier(num_arrivals=1),
    ]
    # approx_math: exp as ex2.approx of x log2(e). Rounding that product costs a relative error of
    # about |x| 2^-24 (4.5e-6 at |x| = 75; ex2.approx adds ~2^-22), far below bf16's 2^-8.
    extra = {"interpret": plgpu.InterpretGPUParams()} if interpret else {}
    call = plgpu.kernel(
        kernel, out_type=out_type, scratch_types=scratch, grid=(n, BH), grid_names=("c", "bh"),
        kernel_name="kda_prep_fwd", compiler_params=plgpu.CompilerParams(approx_math=True), **extra,
    )
    return call(q, k, v, g, vecs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def prepare_fused(q, k, v, g, beta, sidx_f, scale: float, interpret: bool, precision: str = "tf32"):
    """:func:`kernel_gpu_intra.prepare_from_index` with the forward in one Mosaic GPU kernel.

    The kernel runs when the prep is not differentiated (inference). Under ``jax.grad`` the XLA
    prep's forward and its autodiff run (matmul ``precision``), so training costs what
    ``prep="xla"`` does (``prep_bwd="xla"``; the kernel backward is :mod:`kernel_gpu_prep_bwd_split`).
    ``sidx_f`` is the running document index as f32 (a float so it can sit in a custom_vjp).
    Outputs are upcast to f32 to match the XLA version (the scan casts them back for free).
    """
    if precision not in PRECISIONS:  # only the differentiated path uses it, but fail the same way
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    *ins, fresh_last = _kernel_inputs(q, k, v, g, beta, sidx_f.astype(jnp.int32))
    *outs, decay = prep_fwd(*ins, scale=scale, interpret=interpret)
    return (*(x.astype(F32) for x in outs), _masked_decay(decay, fresh_last))


def _fused_fwd(q, k, v, g, beta, sidx_f, scale, interpret, precision):
    # Differentiated, the forward is the XLA prep itself (as ``prep="xla"``) and keeps its
    # autodiff residuals: taking the kernel's outputs would leave the backward to recompute the XLA
    # forward (fwd+bwd 35.2 ms against 27.9 ms for ``prep="xla"`` on the H200 at 4,8192,32,128).
    xla = lambda *a: prepare_from_index(*a, sidx_f.astype(jnp.int32), scale=scale, chunk=CHUNK, precision=precision)
    outs, vjp = jax.vjp(xla, q, k, v, g, beta)
    return outs, (vjp, sidx_f)


def _fused_bwd(scale, interpret, precision, res, cts):
    vjp, sidx_f = res  # the XLA vjp and sidx_f
    return (*vjp(tuple(cts)), jnp.zeros_like(sidx_f))


prepare_fused.defvjp(_fused_fwd, _fused_bwd)
