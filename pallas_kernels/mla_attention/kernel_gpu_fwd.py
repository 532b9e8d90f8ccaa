"""Causal MLA flash attention forward with document masks in Pallas Mosaic GPU (wgmma, TMA).

The same op as :func:`kernel_gpu.flash_forward` (masks, query offsets, skipped blocks, returned
``lse`` and row max: see there), on Hopper's warp-specialised FlashAttention-3 plan
(arXiv:2407.08608): a CTA owns ``2 × block_q`` query rows of one (row, head); two compute
warpgroups each hold ``block_q`` of them, and a third (memory) warpgroup streams the key blocks —
``k_nope``, the shared ``k_rope``, ``v`` and the key segment ids — through ``stages`` shared-memory
slots by TMA. The logits are two wgmmas into one accumulator (``q_nope·k_nopeᵀ + q_rope·k_ropeᵀ``;
the rope key, one for all heads, reaches most heads' CTAs from L2), the probabilities stay in
registers as the left operand of ``p·v``, and the two compute warpgroups take turns on the tensor
cores (a "schedule" barrier: one's softmax overlaps the other's products).

Loop of one compute warpgroup: from the CTA's first key block that can share a document with its
rows (:func:`kernel_gpu.document_bounds` on ``2 × block_q`` rows) to its own causal bound, masked
steps around the run of wholly visible tiles (:func:`kernel_gpu.full_runs` on its ``block_q`` rows),
which skip the compares; then it only releases the slots its partner still needs. Unlike the
Triton kernel, splitting the loop costs no pipeline restart here: the memory warpgroup streams the
CTA's key blocks once, whatever the compute warpgroups do with them. Logits are kept in log2 units
(``scale · log2 e`` folded into one multiply), masked ones set to a finite ``MASK`` so a row whose
first tiles are all masked never forms ``inf − inf``.

The output is written in the inputs' dtype through the query's shared-memory tile, or in float32
(context parallel's partial results) through a tile of its own, which leaves room for two slots of
64 keys (:data:`F32_OUTPUT_BLOCKS`). Under the CPU interpreter the probabilities go through shared memory and
each ``p·v`` into a fresh accumulator (the interpreter's wgmma reads both operands from shared
memory and has no carried accumulator); compiled, they are the register operand of a wgmma that
accumulates into ``acc`` — the same products, summed in another order.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import int_ops
from pallas_kernels.kda.kernel_gpu_util import T, mma_transforms
from pallas_kernels.mla_attention.kernel_gpu import document_blocks, document_bounds, full_runs

LOG2E = math.log2(math.e)
MASK = -1e30  # finite: exp2(MASK - MASK) = 1 is wiped by the first visible key's rescale
WGMMA = plgpu.Layout.WGMMA
ROW, COL = WGMMA.reduce(1), WGMMA.reduce(0)
COMPUTE_WGS = 2


@dataclasses.dataclass(frozen=True)
class ForwardBlocks:
    """Rows per compute warpgroup (the wgmma M tile), keys per loop step, key slots in flight."""

    block_q: int = 64
    block_k: int = 128
    stages: int = 2

    @property
    def rows(self) -> int:
        """Query rows of one CTA."""
        return COMPUTE_WGS * self.block_q


# A float32 output tile (context parallel's partial results) leaves room for two slots of 64 keys only.
F32_OUTPUT_BLOCKS = ForwardBlocks(block_k=64, stages=2)


def default_blocks(out_dtype) -> ForwardBlocks:
    """The tiles for an output in ``out_dtype``: 128 keys a step for 16-bit outputs (H200, K3 width:
    3.46 ms against 4.22 at 64 keys and 3 slots), two slots of 64 keys for float32 outputs."""
    return F32_OUTPUT_BLOCKS if jnp.dtype(out_dtype) == jnp.float32 else ForwardBlocks()


def accepts(T: int, S: int, N: int, R: int, V: int, dtype, out_dtype, blocks: ForwardBlocks | None = None) -> bool:
    """Whether this kernel takes the call (else the Triton forward runs): whole CTAs of query rows and
    key blocks, head widths the wgmma tiles take, 16-bit inputs, the output in their dtype or float32."""
    dtype, out_dtype = jnp.dtype(dtype), jnp.dtype(out_dtype)
    blocks = blocks or default_blocks(out_dtype)
    return (dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and out_dtype in (dtype, jnp.float32)
            and T % blocks.rows == 0 and S % blocks.block_k == 0 and S >= blocks.block_k
            and all(d in (16, 32, 64, 128, 256) for d in (N, R, V)))


def _kernel(off_ref, first_ref, runs_ref, qn_ref, qr_ref, kn_ref, kr_ref, v_ref, qseg_ref, kseg_ref,
            o_ref, lse_ref, mx_ref, scoped, *, scale: float, blocks: ForwardBlocks, num_pairs: int,
            num_k_blocks: int, interpret: bool):
    (qn_s, qr_s, o_s, qseg_s, kn_s, kr_s, v_s, kseg_s, stat_s, p_s), bars = scoped
    q_bar, k_bar, v_bar, k_free, v_free, turn = bars
    bq, bk, stages = blocks.block_q, blocks.block_k, blocks.stages
    h, b = lax.axis_index("heads"), lax.axis_index("batch")
    pair = num_pairs - 1 - lax.axis_index("q_seq")  # longest rows first: a shorter tail
    wg = lax.axis_index("wg")
    off = off_ref[b]
    # The CTA's key blocks: from the first that can share a document with its rows to the causal
    # bound of its last row (both as kernel_gpu's forward: a block of padded rows still gets one visit).
    last = jnp.minimum(int_ops.div(off + (pair + 1) * blocks.rows - 1 + bk, bk), num_k_blocks)
    start = jnp.minimum(first_ref[b, pair], jnp.maximum(last - 1, 0))
    slot_of = lambda j: int_ops.rem(j, stages)

    def take_turn():
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        blk = pair * COMPUTE_WGS + wg  # this warpgroup's block of block_q rows
        rows = pl.ds(blk * bq, bq)
        q_n, q_r, q_seg_s = qn_s.at[wg], qr_s.at[wg], qseg_s.at[wg]
        plgpu.copy_gmem_to_smem(qn_ref.at[b, rows, h], q_n, q_bar.at[wg])
        plgpu.copy_gmem_to_smem(qr_ref.at[b, rows, h], q_r, q_bar.at[wg])
        plgpu.copy_gmem_to_smem(qseg_ref.at[b, rows], q_seg_s, q_bar.at[wg])
        q0 = off + blk * bq
        end = jnp.maximum(jnp.minimum(int_ops.div(q0 + bq - 1 + bk, bk), num_k_blocks), start)
        lo = jnp.clip(runs_ref[b, 0, blk], start, end)
        hi = jnp.clip(runs_ref[b, 1, blk], lo, end)
        plgpu.barrier_wait(q_bar.at[wg])
        q_seg = lax.broadcast_in_dim(plgpu.load(q_seg_s, layout=ROW), (bq, bk), [0])
        q_pos = q0 + plgpu.broadcasted_iota(jnp.int32, (bq, bk), 0, layout=WGMMA)
        k_iota = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=WGMMA)

        def step(masked: bool):
            def body(j, carry):
                acc, m, l = carry
                slot = slot_of(j)

                def logits(acc_ref):
                    plgpu.wgmma(acc_ref, q_n, T(kn_s.at[slot]))
                    plgpu.wgmma(acc_ref, q_r, T(kr_s.at[slot]))
                    take_turn()
                    return acc_ref[...]

                s = pl.run_scoped(logits, plgpu.ACC((bq, bk), jnp.float32)) * (scale * LOG2E)
                if masked:
                    k_seg = lax.broadcast_in_dim(plgpu.load(kseg_s.at[slot], layout=COL), (bq, bk), [1])
                    s = jnp.where((q_pos >= j * bk + k_iota) & (q_seg == k_seg), s, MASK)
                plgpu.barrier_arrive(k_free.at[slot])
                m_new = jnp.maximum(m, s.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l = l * alpha + p.sum(axis=1)
                p16 = p.astype(v_s.dtype)
                acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
                plgpu.barrier_arrive(turn)  # softmax done
                plgpu.barrier_wait(v_bar.at[slot])
                plgpu.barrier_wait(turn)  # the tensor cores are ours
                acc = _pv(acc, p16, v_s.at[slot], None if p_s is None else p_s.at[wg], interpret,
                          then=lambda: _wait_next(k_bar, slot_of, j + 1, end))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l
            return body

        def release(j, _):  # a key block only the partner computes: free its slot, keep the turns
            slot = slot_of(j)
            for landed, free in ((k_bar, k_free), (v_bar, v_free)):
                plgpu.barrier_wait(landed.at[slot])  # every phase observed (the interpreter checks)
                plgpu.barrier_arrive(free.at[slot])
            take_turn()
            take_turn()

        carry = (plgpu.layout_cast(jnp.zeros((bq, o_s.shape[-1]), jnp.float32), WGMMA),
                 plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), ROW),
                 plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), ROW))
        pl.when(start < end)(lambda: plgpu.barrier_wait(k_bar.at[slot_of(start)]))
        pl.when(wg == 1)(take_turn)
        carry = lax.fori_loop(start, lo, step(True), carry)
        carry = lax.fori_loop(lo, hi, step(False), carry)
        acc, m, l = lax.fori_loop(hi, end, step(True), carry)
        lax.fori_loop(end, last, release, None)
        pl.when(wg == 0)(take_turn)

        o_s.at[wg][...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(o_s.dtype)
        stat_s.at[0, wg][...] = (m + jnp.log2(l)) * (1 / LOG2E)  # natural units, as the backward reads them
        stat_s.at[1, wg][...] = m * (1 / LOG2E)  # the row max of the scaled logits
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s.at[wg], o_ref.at[b, rows, h])
        plgpu.copy_smem_to_gmem(stat_s.at[0, wg], lse_ref.at[b, h, rows])
        plgpu.copy_smem_to_gmem(stat_s.at[1, wg], mx_ref.at[b, h, rows])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def fetch(j):
            keys, slot = pl.ds(j * bk, bk), slot_of(j)
            plgpu.copy_gmem_to_smem(kn_ref.at[b, keys, h], kn_s.at[slot], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(kr_ref.at[b, keys], kr_s.at[slot], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(kseg_ref.at[b, keys], kseg_s.at[slot], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[b, keys, h], v_s.at[slot], v_bar.at[slot])

        for i in range(stages):
            pl.when(start + i < last)(functools.partial(fetch, start + i))

        def released(j):
            plgpu.barrier_wait(k_free.at[slot_of(j)])
            plgpu.barrier_wait(v_free.at[slot_of(j)])

        refilled = jnp.maximum(last - stages, start)

        @pl.loop(start, refilled)
        def _refill(j):
            released(j)
            fetch(j + stages)

        pl.loop(refilled, last)(released)  # the last releases too: every phase observed


def _wait_next(k_bar, slot_of, j, end):
    """Wait for key block ``j``'s logits operands (while the last ``p·v`` runs), if this warpgroup
    computes it."""
    @pl.when(j < end)
    def _():
        plgpu.barrier_wait(k_bar.at[slot_of(j)])


def _pv(acc, p16, v, p_s, interpret: bool, then):
    """``acc + p16 · v``; ``then()`` runs while the product is in flight."""
    if interpret:
        p_s[...] = p16
        plgpu.commit_smem()

        def scoped(acc_ref):
            plgpu.wgmma(acc_ref, p_s, v)
            then()
            return acc_ref[...]

        return acc + pl.run_scoped(scoped, plgpu.ACC(acc.shape, jnp.float32))

    def accumulate(acc_ref):
        plgpu.wgmma(acc_ref, p16, v)
        then()

    return pl.run_state(accumulate)(plgpu.ACC.init(acc))


# Jitted so that every call with the same shapes reuses one traced jaxpr: the layers' calls (and their
# remat recomputes) then lower to one Mosaic GPU module, compiled once (tests/k3jax/train/test_compile.py).
@functools.partial(jax.jit, static_argnames=("scale", "blocks", "interpret", "out_dtype"))
def flash_forward(qn, qr, kn, kr, v, q_seg, k_seg, q_start, *, scale: float, blocks: ForwardBlocks | None = None,
                  interpret: bool = False, out_dtype=None):
    """``(o [B,T,H,V] in out_dtype, lse [B,H,T], row max [B,H,T])`` as :func:`kernel_gpu.flash_forward`
    (whose argument shapes it takes); ``out_dtype`` qn's (the default) or float32; ``blocks`` default
    :func:`default_blocks`; the call must pass :func:`accepts`."""
    B, Tq, H, N = qn.shape
    S, R, V = kn.shape[1], qr.shape[-1], v.shape[-1]
    out_dtype = jnp.dtype(out_dtype or qn.dtype)
    blocks = blocks or default_blocks(out_dtype)
    if not accepts(Tq, S, N, R, V, qn.dtype, out_dtype, blocks):
        raise ValueError(f"the Mosaic GPU forward needs T % {blocks.rows} == 0, S % {blocks.block_k} == 0, "
                         f"16-bit inputs, out_dtype theirs or float32 and head widths that are powers of two "
                         f"from 16 to 256; got T={Tq}, S={S}, N={N}, R={R}, V={V}, dtype={qn.dtype}, "
                         f"out_dtype={out_dtype}")
    bq, bk, stages = blocks.block_q, blocks.block_k, blocks.stages
    qdoc, kdoc = document_blocks(q_seg, bq), document_blocks(k_seg, bk)
    first = document_bounds(document_blocks(q_seg, blocks.rows), kdoc)[0]
    runs = full_runs(qdoc, kdoc, q_start, bq, bk)
    dtype = qn.dtype
    smem = lambda shape, width, dt=dtype: plgpu.SMEM(shape, dt, transforms=mma_transforms(width, dt))
    p_smem = smem((COMPUTE_WGS, bq, bk), bk) if interpret else None
    scratch = [
        smem((COMPUTE_WGS, bq, N), N), smem((COMPUTE_WGS, bq, R), R),
        None if (V, out_dtype) == (N, dtype) else smem((COMPUTE_WGS, bq, V), V, out_dtype),
        plgpu.SMEM((COMPUTE_WGS, bq), jnp.int32),
        smem((stages, bk, N), N), smem((stages, bk, R), R), smem((stages, bk, V), V),
        plgpu.SMEM((stages, bk), jnp.int32), plgpu.SMEM((2, COMPUTE_WGS, bq), jnp.float32), p_smem,
    ]
    barriers = (
        plgpu.Barrier(num_arrivals=3, num_barriers=COMPUTE_WGS),  # q tiles and segment ids
        plgpu.Barrier(num_arrivals=3, num_barriers=stages),  # k_nope, k_rope, key segment ids
        plgpu.Barrier(num_barriers=stages),  # v
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),  # slots released
        plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
        plgpu.Barrier(num_arrivals=COMPUTE_WGS),  # the compute warpgroups' turns
    )

    def entry(*refs):
        def scoped(buffers, bars):
            buffers = list(buffers)
            if buffers[2] is None:
                buffers[2] = buffers[0]  # o through the q_nope tile (equal widths and dtypes)
            _kernel(*refs, (buffers, bars), scale=scale, blocks=blocks, num_pairs=Tq // blocks.rows,
                    num_k_blocks=S // bk, interpret=interpret)

        pl.run_scoped(scoped, scratch, barriers, collective_axes="wg")

    rows = jax.ShapeDtypeStruct((B, H, Tq), jnp.float32)
    extra = {"interpret": plgpu.InterpretGPUParams()} if interpret else {}
    return plgpu.kernel(
        entry, out_type=(jax.ShapeDtypeStruct((B, Tq, H, V), out_dtype), rows, rows),
        grid=(H, Tq // blocks.rows, B), grid_names=("heads", "q_seq", "batch"),
        num_threads=COMPUTE_WGS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True), kernel_name="mla_flash_fwd_mgpu", **extra,
    )(q_start, first, runs, qn, qr, kn, kr, v, q_seg, k_seg)
