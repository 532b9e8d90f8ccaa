"""Chunked Kimi Delta Attention on Hopper: intra-chunk prep + a Mosaic GPU inter-chunk scan.

Kimi Linear (arXiv:2510.26692) Eq. 6-9 in the chunkwise form of SPEC §2, split in two:

1. Intra-chunk prep, parallel over all chunks: the lower-bounded gate lets each 16-token
   sub-tile use one causal anchor at its first row, so ``A_kk``/``A_qk`` are dense matmuls; then
   the WY solve gives ``W, U`` and the decayed ``qg, kg, d``. ``prep="fused"`` (default,
   :mod:`kernel_gpu_prep`: one Mosaic GPU kernel per chunk when not differentiated, the XLA prep
   and its autodiff under ``jax.grad``) or ``prep="xla"`` (:mod:`kernel_gpu_intra` always).
   Why fused by default (H200, B,T,H,D = 4,8192,32,128, bf16): the forward is 3.16 ms against
   9.34 ms with the XLA prep (prep kernel 1.9 ms, scan 0.6 ms, no XLA pre- or post-processing);
   with the split Mosaic GPU prep backward (``chunk_kda``'s default) fwd+bwd is 13.7 ms against
   27.9 ms with the XLA prep's autodiff (benchmarks/RESULTS.md).
2. ``kda_scan_fwd`` (this module, Pallas Mosaic GPU): one warpgroup per (head, V block) walks the
   chunks in order with the fp32 state in registers and a bf16 copy in smem as the wgmma operand:
   ``v_new = U - W S``; ``o = qg S + A_qk v_new``; ``S <- d * S + kg^T v_new``. TMA brings chunk
   c+1 in while chunk c computes; ``o`` goes token-major ``[B, T, H, V]`` straight from smem by TMA
   (no transpose after). For training it also stores each chunk's entering state (bf16,
   exactly the operand the forward used) for ``kda_scan_bwd`` (:mod:`kernel_gpu_bwd`).
   ``shared_v`` (default when B·H >= ``SHARED_V_MIN_HEADS`` and V = 128): one CTA per head, one
   warpgroup per V block, the per-chunk loads shared in smem.

Gradients: ``jax.custom_vjp`` on the scan (Pallas backward kernel), JAX autodiff for step 1
(``prep_bwd="xla"``) or its Mosaic GPU backward (``prep_bwd="split"``, two kernels,
:mod:`kernel_gpu_prep_bwd_split`; ``chunk_kda``'s default).

Backend choice: Mosaic GPU (``plgpu``) rather than Pallas-Triton. Triton-on-Pallas is deprecated
since JAX 0.11; Mosaic GPU exposes wgmma (with transposed smem operands, needed for ``kg^T``,
``qg^T``, ``W^T``) and TMA directly, lowers fully on the CPU host (so layout errors are caught
before the GPU) and runs under the CPU interpreter for the default tests. Only the Mosaic GPU path
was written; the earlier H200 measurements (benchmarks/RESULTS.md) are of ``prep="xla"``, whose
XLA prep dominates the time.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels import int_ops
from pallas_kernels.kda.kernel_gpu_bwd import scan_bwd
from pallas_kernels.kda.kernel_gpu_intra import prepare
from pallas_kernels.kda.kernel_gpu_prep import prepare_fused
from pallas_kernels.kda.kernel_gpu_prep_bwd_split import prepare_split
from pallas_kernels.kda.reference import segment_index
from pallas_kernels.kda.kernel_gpu_util import SLOTS, Stream, T, mma, mma2, pipelined_chunks, pipelined_chunks_shared
from pallas_kernels.kda.kernel_gpu_util import smem as _smem

BF16 = jnp.bfloat16
F32 = jnp.float32
WGMMA = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)
PREP_BWDS = ("xla", "split")
CHUNK = 64  # one wgmma M tile: the chunk is also the warpgroup's row block


@dataclasses.dataclass(frozen=True)
class ScanConfig:
    """Static knobs of the scan kernels: V block per warpgroup, the CPU interpreter, and
    ``shared_v``: one CTA per head whose ``V // bv`` warpgroups (one per V block) share one copy
    of the per-chunk ``W, qg, kg, A_qk, d`` in smem, instead of one CTA per (head, V block)
    that each read them from HBM; in the backward scan too, which then sums over V in the kernel."""

    bv: int = 64
    interpret: bool = False
    shared_v: bool = False


# Jitted so that every call with the same shapes reuses one traced jaxpr, which JAX lowers once per
# module: identical layers (and their remat recomputes) then share one Mosaic GPU kernel, compiled once.
@functools.partial(jax.jit, static_argnames=("cfg", "store_states", "out_dtype", "heads"))
def scan_fwd(w, qg, kg, u, aqk, d, s0, *, cfg: ScanConfig, store_states: bool, out_dtype, heads: int):
    """``(o [B,Tp,H,V] token-major, S_final [BH,K,V] fp32, h [BH,N*K,V] bf16 or None)``; operands
    bf16 head-major ``[BH, Tp, .]`` with ``BH = B * heads``."""
    BH, Tp, K = w.shape
    V = u.shape[-1]
    C = aqk.shape[-1]
    n, nv, bv = Tp // C, V // cfg.bv, cfg.bv
    if cfg.shared_v and nv > 2:  # two warpgroups' buffers already fill the SM's smem
        raise ValueError(f"cfg.bv must be at least V/2={V // 2} with shared_v, got {bv}")
    groups = nv if cfg.shared_v else None

    def kernel(w_g, qg_g, kg_g, u_g, aqk_g, d_g, s0_g, o_g, sT_g, *rest):
        h_g = rest[0] if store_states else None
        w_b, qg_b, kg_b, aqk_b, d_b, u_b, o_buf, s_buf, vn_buf, *bars = rest[int(store_states):]
        if cfg.shared_v:
            vi, bh = lax.axis_index("wg"), lax.axis_index("bh")
            o_buf, s_buf, vn_buf, u_b = (x.at[vi] for x in (o_buf, s_buf, vn_buf, u_b))
        else:
            vi, bh = lax.axis_index("v"), lax.axis_index("bh")
        vs = pl.ds(vi * bv, bv)
        shared = [Stream(w_g.at[bh], C, w_b), Stream(qg_g.at[bh], C, qg_b), Stream(kg_g.at[bh], C, kg_b),
                  Stream(aqk_g.at[bh], C, aqk_b), Stream(d_g.at[bh], 1, d_b)]
        own = [Stream(u_g.at[bh, :, vs], C, u_b)]
        o_rows = lambda c: o_g.at[int_ops.div(bh, heads), pl.ds(c * C, C), int_ops.rem(bh, heads), vs]
        h_rows = (lambda c: h_g.at[bh, pl.ds(c * K, K), vs]) if store_states else None
        bufs = (o_buf, s_buf, vn_buf)
        step = functools.partial(_chunk_step, bufs, o_rows, h_rows, K=K, out_dtype=out_dtype,
                                 slotted=not cfg.shared_v)
        s0 = plgpu.load(s0_g.at[bh, :, vs], layout=WGMMA, optimized=False)  # once: no TMA needed
        if cfg.shared_v:
            S = pipelined_chunks_shared(n, shared, own, *bars, step, s0, wg=vi)
        else:
            S = pipelined_chunks(n, shared + own, *bars, step, s0)
        sT_g.at[bh, :, vs][...] = S
        plgpu.wait_smem_to_gmem(0)

    out_type = [jax.ShapeDtypeStruct((BH // heads, Tp, heads, V), out_dtype), jax.ShapeDtypeStruct((BH, K, V), F32)]
    if store_states:
        out_type.append(jax.ShapeDtypeStruct((BH, n * K, V), BF16))
    extra = {"interpret": plgpu.InterpretGPUParams()} if cfg.interpret else {}
    if cfg.shared_v:
        grid = dict(grid=(BH,), grid_names=("bh",), num_threads=nv, thread_name="wg")
    else:
        grid = dict(grid=(nv, BH), grid_names=("v", "bh"))
    scratch = _scan_scratch(C, K, bv, out_dtype, store_states, groups)
    call = plgpu.kernel(kernel, out_type=out_type, scratch_types=scratch, kernel_name="kda_scan_fwd", **grid, **extra)
    outs = call(w, qg, kg, u, aqk, d, s0)
    return outs[0], outs[1], (outs[2] if store_states else None)


def _scan_scratch(C, K, bv, out_dtype, store_states, groups):
    """Slotted input buffers (``u`` per warpgroup with ``groups``), then the output staging.

    One CTA per V block keeps two slots of ``o`` (and of ``S`` when storing states) so a chunk
    never waits on the previous chunk's stores; with ``groups`` warpgroups there is smem for one.
    """
    smem = functools.partial(_smem, swizzle=min(128, 2 * bv))  # one swizzle for all wgmma operands
    out_slots = None if groups else SLOTS
    return [
        smem((C, K)), smem((C, K)), smem((C, K)), smem((C, C)), smem((1, K), F32, mma=False),
        smem((C, bv), groups=groups),
        smem((C, bv), out_dtype, mma=jnp.dtype(out_dtype) == BF16, slots=out_slots, groups=groups),
        smem((K, bv), slots=out_slots if store_states else None, groups=groups),
        smem((C, bv), slots=None, groups=groups),
        plgpu.Barrier(num_arrivals=5 + (groups or 1), num_barriers=SLOTS),
        *([plgpu.Barrier(num_arrivals=groups, num_barriers=SLOTS)] if groups else []),
    ]


def _chunk_step(bufs, o_rows, h_rows, c, slot, ins, S, *, K, out_dtype, slotted):
    """One chunk of one V block: ``v_new = U - W S``; ``o = qg S + A_qk v_new``;
    ``S <- d * S + kg^T v_new``; ``o`` (and the entering ``S`` when ``h_rows``) stored by TMA."""
    o_buf, s_buf, vn_buf = bufs
    w_s, qg_s, kg_s, aqk_s, d_s, u_s = ins
    C, bv = u_s.shape
    store = h_rows is not None
    ob = o_buf.at[slot] if slotted else o_buf
    sb = s_buf.at[slot] if slotted and store else s_buf
    # Slotted: the stores that read this slot two chunks ago must be done. One slot: the previous
    # chunk's S store must be done (its o store, issued after it, may still be reading).
    if slotted or store:
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
    sb[...] = S.astype(BF16)
    plgpu.commit_smem()
    if store and not slotted:
        plgpu.copy_smem_to_gmem(sb, h_rows(c))
    v_new = plgpu.load(u_s, layout=WGMMA).astype(F32) - mma(w_s, sb, (C, bv))
    vn_buf[...] = v_new.astype(BF16)
    plgpu.commit_smem()
    o = mma2(qg_s, sb, aqk_s, vn_buf, (C, bv))
    if not slotted:  # one slot: the previous chunk's o store must be done (this chunk's S store may not)
        plgpu.wait_smem_to_gmem(int(store), wait_read_only=True)
    ob[...] = o.astype(out_dtype)
    decay = lax.broadcast_in_dim(plgpu.load(d_s.at[0], layout=ROW), (K, bv), [0])
    S = S * decay + mma(T(kg_s), vn_buf, (K, bv))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(ob, o_rows(c), commit_group=not (slotted and store))
    if store and slotted:
        plgpu.copy_smem_to_gmem(sb, h_rows(c))
    return S


def _bf16_operands(w, u, qg, kg, aqk):
    return tuple(x.astype(BF16) for x in (w, u, qg, kg, aqk))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _scan(w, u, qg, kg, aqk, d, s0, cfg: ScanConfig, out_dtype, heads: int):
    w, u, qg, kg, aqk = _bf16_operands(w, u, qg, kg, aqk)
    o, S, _ = scan_fwd(w, qg, kg, u, aqk, d, s0, cfg=cfg, store_states=False, out_dtype=out_dtype, heads=heads)
    return o, S


def _scan_vjp_fwd(w, u, qg, kg, aqk, d, s0, cfg, out_dtype, heads):
    if w.dtype != u.dtype:
        raise ValueError(f"w and u must share a dtype, got {w.dtype} and {u.dtype}")
    wu_dtype = jnp.zeros((0,), w.dtype)  # dw, du come back in it (bf16 from the fused preps)
    w, u, qg, kg, aqk = _bf16_operands(w, u, qg, kg, aqk)
    o, S, h = scan_fwd(w, qg, kg, u, aqk, d, s0, cfg=cfg, store_states=True, out_dtype=out_dtype, heads=heads)
    return (o, S), (w, u, qg, kg, aqk, d, h, wu_dtype)


def _scan_vjp_bwd(cfg, out_dtype, heads, res, cts):
    w, u, qg, kg, aqk, d, h, wu_dtype = res
    do, dS = cts
    do = do.astype(BF16)  # token-major [B, Tp, H, V]: the shared backward reads it so, the other transposes it
    dw, du, dqg, dkg, daqk, dd, ds0 = scan_bwd(
        w, qg, kg, u, aqk, d, h, do, dS.astype(F32), bv=cfg.bv, interpret=cfg.interpret, shared_v=cfg.shared_v,
        wu_dtype=jnp.dtype(wu_dtype.dtype),
    )
    return dw, du, dqg, dkg, daqk, dd, ds0


_scan.defvjp(_scan_vjp_fwd, _scan_vjp_bwd)


def _block_v(V: int, programs: int) -> int:
    """64-wide V blocks, or 32 when that still leaves SMs idle (few heads, long sequences)."""
    if V % 64 or programs * (V // 64) < 132:
        return 32
    return 64


# Fewest B·H for which ``shared_v=None`` picks the shared scans. On the H200 (benchmarks/RESULTS.md,
# stop 14) they cut fwd+bwd by 13-14 % at B·H = 96 and 128 and cost 19 % at B·H = 16, where one CTA
# per head leaves most SMs idle.
SHARED_V_MIN_HEADS = 64


def _resolve_shared_v(shared_v: bool | None, V: int, heads: int, interpret: bool) -> bool:
    """``None``: shared on the compiled path when V = 128 (two 64-wide warpgroups) and heads are many."""
    if shared_v is None:
        return not interpret and V == 128 and heads >= SHARED_V_MIN_HEADS
    return bool(shared_v)


def _scan_config(V: int, heads: int, block_v: int | None, shared_v: bool, interpret: bool) -> ScanConfig:
    """``shared_v`` runs one CTA per head whatever ``block_v``, so it defaults to 64-wide blocks."""
    bv = (64 if shared_v else _block_v(V, heads)) if block_v is None else block_v
    if V % bv or bv % 32 or (shared_v and V // bv > 2):
        raise ValueError(f"block_v must be a multiple of 32 dividing V={V} (at least V/2 with shared_v), got {bv}")
    return ScanConfig(bv=bv, interpret=bool(interpret), shared_v=shared_v)


def supports(q, k, v, g, beta, *, scale=None, initial_state=None, segment_ids=None,
             chunk_size=CHUNK, interpret=False) -> bool:
    """Static check: chunk 64, K and V in {64, 128} (the tested tile shapes), no float64."""
    K, V = k.shape[-1], v.shape[-1]
    dtypes = [x.dtype for x in (q, k, v, g, beta) + (() if initial_state is None else (initial_state,))]
    tiles_ok = chunk_size == CHUNK and K in (64, 128) and V in (64, 128)
    return tiles_ok and all(dt != jnp.float64 for dt in dtypes)


def chunk_kda_pallas(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T H V"],
    g: Float[Array, "B T H K"],
    beta: Float[Array, "B T H"],
    *,
    scale: float,
    initial_state: Float[Array, "B H K V"] | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
    chunk_size: int = CHUNK,
    interpret: bool = False,
    block_v: int | None = None,
    prep: str = "fused",
    prep_precision: str = "tf32",
    prep_bwd: str = "xla",
    shared_v: bool | None = None,
) -> tuple[Float[Array, "B T H V"], Float[Array, "B H K V"]]:
    """KDA forward (differentiable) on Hopper; ``o`` has ``v.dtype``, the final state is fp32.

    ``block_v`` (None = by occupancy) is the V width of one scan program. ``prep`` picks the
    intra-chunk step: ``"fused"`` (default: the Mosaic GPU kernel of :mod:`kernel_gpu_prep` when
    not differentiated, the XLA prep under ``jax.grad``) or ``"xla"`` (:func:`kernel_gpu_intra.prepare`).
    ``prep_precision`` is the XLA prep's matmul precision, ``"tf32"`` (default: on the H200 the
    prep alone is 15 % faster than ``"highest"`` with the same error against the fp32 reference,
    benchmarks/RESULTS.md) or ``"highest"``. ``prep_bwd`` (``prep="fused"`` only) is the prep's
    backward under ``jax.grad``: ``"xla"`` (default, XLA autodiff) or ``"split"`` (the kernel
    forward with the two-kernel Mosaic GPU backward of :mod:`kernel_gpu_prep_bwd_split`).
    ``shared_v`` runs the forward and backward scans as one CTA per head, one warpgroup per V
    block, sharing the chunk loads (:class:`ScanConfig`); ``None`` (default) picks it when
    compiled, V = 128 and ``B·H >= SHARED_V_MIN_HEADS``.
    """
    if prep not in ("xla", "fused"):
        raise ValueError(f"prep must be 'xla' or 'fused', got {prep!r}")
    if prep_bwd not in PREP_BWDS or (prep_bwd != "xla" and prep != "fused"):
        raise ValueError(f"prep_bwd must be 'xla', or 'split' with prep='fused'; got {prep_bwd!r}, prep={prep!r}")
    if not supports(q, k, v, g, beta, initial_state=initial_state, chunk_size=chunk_size):
        raise ValueError(
            f"chunk_kda_pallas needs chunk_size={CHUNK}, K and V in (64, 128) and no float64; "
            f"got chunk_size={chunk_size}, K={k.shape[-1]}, V={v.shape[-1]}"
        )
    B, T_len, H, K = k.shape
    V = v.shape[-1]
    cfg = _scan_config(V, B * H, block_v, _resolve_shared_v(shared_v, V, B * H, interpret), interpret)
    if prep == "fused":
        sidx = segment_index(segment_ids, B, T_len).astype(F32)
        if prep_bwd == "split":
            w, u, qg, kg, aqk, d = prepare_split(q, k, v, g, beta, sidx, scale, bool(interpret))
        else:
            w, u, qg, kg, aqk, d = prepare_fused(q, k, v, g, beta, sidx, scale, bool(interpret), prep_precision)
    else:
        w, u, qg, kg, aqk, d = prepare(q, k, v, g, beta, scale=scale, segment_ids=segment_ids, chunk=CHUNK,
                                       precision=prep_precision)
    s0 = jnp.zeros((B * H, K, V), F32) if initial_state is None else initial_state.astype(F32)
    out_dtype = BF16 if v.dtype == BF16 else F32
    o, S = _scan(w, u, qg, kg, aqk, d, s0.reshape(B * H, K, V), cfg, out_dtype, H)
    return o[:, :T_len].astype(v.dtype), S.reshape(B, H, K, V)
