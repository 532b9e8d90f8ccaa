"""Grouped matmuls for Hopper in Pallas Mosaic GPU (``plgpu``): ``gmm`` and ``tgmm``.

``gmm``   out[rows of group e] = lhs[rows of e] @ rhs[e]       (forward, and dlhs with rhsᵀ)
``tgmm``  out[e] = lhs[rows of e]ᵀ @ dout[rows of e]            (drhs; zero for empty groups)

Both are persistent kernels (one CTA per SM looping over output tiles) with a
warp-specialised pipeline: one memory warpgroup streams TMA copies into a ring of shared
memory slots, two compute warpgroups issue ``wgmma`` into float32 register accumulators,
each owning half of the CTA tile along N.

Algorithm of ``gmm``:
1. In XLA, cut the rows into work tiles: every ``tile_m`` row block, once per group that
   owns a row of it (a block straddling a group boundary is computed once per group).
   Rows past ``sum(group_sizes)`` form one extra pseudo-group whose tiles store zeros.
2. The kernel walks (work tile, N tile) pairs; a tile streams its row block and its group's
   weight panel over K, and stores only its group's rows: a TMA store box has a static row
   count, so a dynamic count ``c`` is written as the sum of its power-of-two parts.
Algorithm of ``tgmm``: per (group, K tile, N tile) stream the group's row blocks; the
compute warpgroup zeroes the ``dout`` rows of a boundary block that belong to other groups
before its ``wgmma`` (TMA already zero-fills rows past M). With ``group_chunk = C > 0`` one
pipeline instead streams the row blocks of C consecutive groups for a (K tile, N tile), so
the pipeline ramp is paid once per C groups (small groups: a few row blocks each). The
accumulator runs over the whole chunk and a group's tile is the running sum minus the sum at
its start, kept in registers (the GPU interpreter cannot overwrite an accumulator; this costs
~f32 eps x the chunk's earlier sums, far below the bf16 output rounding, and a second
accumulator-sized register tile: use tile_k x tile_n <= 64 x 128). ``reset_acc`` instead
zeroes the accumulator after each group's store (no second tile, any output tile; compiled
kernels only, so checked on the GPU). An empty group is one fully masked block.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe.schedule import BLOCK, COUNT, GROUP, LO, aligned_tile_schedule, tile_schedule

_COMPUTE_WGS = 2
_LAST = 5  # row of the chunked tgmm schedule after schedule.tile_schedule's five
_DETECT_RACES = False


@dataclasses.dataclass(frozen=True)
class GpuTiling:
    """Tile sizes; the CTA tile is ``tile_m × 2·tile_n`` with ``stages`` shared-memory slots.

    In ``gmm`` ``tile_k`` is the contraction step; in ``tgmm`` the contraction runs over
    rows in steps of ``tile_m`` and ``tile_k`` is the output-row tile. ``group_chunk``
    (tgmm only): 0 runs one pipeline per (group, output tile); C > 0 one per C groups.
    ``overlap_wgmma`` (tgmm only): a step waits for the previous step's wgmma, not its own;
    its slot is released one step later, and the memory warpgroup waits for the compute
    warpgroups' last wgmma before it refills the slots for the next pipeline.
    """

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    stages: int = 3
    grid_tile_width: int = 8
    aligned: bool = True  # gmm tiles start at group starts (schedule.aligned_tile_schedule)
    group_chunk: int = 0
    overlap_wgmma: bool = False  # tgmm only: keep one wgmma in flight (slots released a step late)
    reset_acc: bool = False  # chunked tgmm, compiled only: zero the accumulator at group ends

    def cta_n(self) -> int:
        return _COMPUTE_WGS * self.tile_n


GMM_TILING = GpuTiling()
TGMM_TILING = GpuTiling(tile_m=64, tile_n=128, tile_k=128, stages=3)
# tgmm tilings the benchmark times per shape (each fits the H200's 227 KiB of shared memory;
# chunked ones keep tile_k x tile_n <= 64 x 128 for their second register tile)
TGMM_CANDIDATES = (
    TGMM_TILING,
    dataclasses.replace(TGMM_TILING, overlap_wgmma=True),
    GpuTiling(tile_m=128, tile_n=128, tile_k=64, stages=2, overlap_wgmma=True),
    GpuTiling(tile_m=64, tile_n=128, tile_k=64, stages=4, group_chunk=4),
    GpuTiling(tile_m=64, tile_n=128, tile_k=64, stages=4, group_chunk=4, overlap_wgmma=True),
    GpuTiling(tile_m=64, tile_n=128, tile_k=64, stages=4, group_chunk=8, overlap_wgmma=True),
    GpuTiling(tile_m=64, tile_n=128, tile_k=64, stages=4, group_chunk=16, overlap_wgmma=True),
    GpuTiling(tile_m=128, tile_n=128, tile_k=64, stages=2, group_chunk=8, overlap_wgmma=True),
    GpuTiling(tile_m=64, tile_n=64, tile_k=128, stages=4, group_chunk=8, overlap_wgmma=True),
    # compiled only: checked against the default tiling on the GPU before it may be picked
    dataclasses.replace(TGMM_TILING, group_chunk=8, reset_acc=True),
    dataclasses.replace(TGMM_TILING, group_chunk=4, overlap_wgmma=True, reset_acc=True),
    dataclasses.replace(TGMM_TILING, group_chunk=8, overlap_wgmma=True, reset_acc=True),
    # 128 rows per step at 224 KiB of shared memory
    GpuTiling(tile_m=128, tile_n=64, tile_k=128, stages=3, overlap_wgmma=True),
    GpuTiling(tile_m=128, tile_n=64, tile_k=128, stages=3, group_chunk=8, overlap_wgmma=True, reset_acc=True),
)


def required_multiple() -> int:
    """K and N must be multiples of this (K, N swap roles between gmm, dlhs and tgmm)."""
    g, t = GMM_TILING, TGMM_TILING
    return math.lcm(g.tile_k, g.cta_n(), t.tile_k, t.cta_n())


def _num_sms(interpret: bool) -> int:
    return 2 if interpret else jax.devices()[0].core_count


def _swizzled(minor_elems: int, dtype):
    swizzle = plgpu.find_swizzle(minor_elems * jnp.dtype(dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def _compiler_params(interpret: bool):
    del interpret
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


def _interpret_arg(interpret: bool):
    return plgpu.InterpretGPUParams(detect_races=_DETECT_RACES) if interpret else None


def m_tile_schedule(group_sizes: jax.Array, m: int, tile_m: int) -> jax.Array:
    """Work tiles of ``gmm`` (see ``schedule.tile_schedule``); group ``E`` is the zero tail."""
    return tile_schedule(group_sizes, m, tile_m, tail=True, empty_tiles=False)


def _zeros_wgmma(shape, dtype):
    return plgpu.layout_cast(jnp.zeros(shape, dtype), plgpu.Layout.WGMMA)


def _store_rows(o_smem, o_gmem, row0, lo, count, n_slice, max_rows: int):
    """TMA-store rows ``[lo, lo + count)`` of ``o_smem`` to ``o_gmem[row0 + lo + …]``."""
    offset = lo
    size = 1 << (max_rows.bit_length() - 1)
    while size >= 1:
        part = count & size

        @pl.when(part != 0)
        def _():
            plgpu.copy_smem_to_gmem(
                o_smem.at[pl.ds(offset, size)], o_gmem.at[pl.ds(row0 + offset, size), n_slice]
            )

        offset = offset + part
        size //= 2


def _b_alloc_view(rhs_gmem, cta_n, transpose_rhs):
    cols = pl.ds(0, cta_n)
    return rhs_gmem.at[0, cols] if transpose_rhs else rhs_gmem.at[0, :, cols]


def _gmm_pipeline(cfg, k, dtype, transpose_rhs, body, compute_context, block=0):
    """K-loop of one gmm tile; aligned tiles pass a per-tile lhs view and block 0."""
    tm, tk, cta_n = cfg.tile_m, cfg.tile_k, cfg.cta_n()
    b_block = (cta_n, tk) if transpose_rhs else (tk, cta_n)
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(k // tk,),
        memory_registers=40,
        in_specs=[
            # block-indexed over the whole lhs (unaligned mode): TMA zero-fills rows past M
            plgpu.BlockSpec((tm, tk), lambda kk: (block, kk), transforms=_swizzled(tk, dtype)),
            plgpu.BlockSpec(
                b_block,
                (lambda kk: (0, kk)) if transpose_rhs else (lambda kk: (kk, 0)),
                transforms=_swizzled(b_block[1], dtype),
            ),
        ],
        wg_axis="wg",
        num_compute_wgs=_COMPUTE_WGS,
        max_concurrent_steps=cfg.stages,
        compute_context=compute_context,
    )


def _gmm_epilogue(acc, o_smem, out_gmem, is_tail, row0, lo, count, n_slice, max_rows):
    """Stage one warpgroup's tile in SMEM (zeros for the tail group) and store its rows."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when(is_tail)
    def _():
        o_smem[...] = _zeros_wgmma(o_smem.shape, out_gmem.dtype)

    @pl.when(~is_tail)
    def _():
        o_smem[...] = acc[...].astype(out_gmem.dtype)

    plgpu.commit_smem()
    _store_rows(o_smem, out_gmem, row0, lo, count, n_slice, max_rows)


def _gmm_body(meta, lhs_gmem, rhs_gmem, out_gmem, *, cfg, m, k, n, transpose_rhs):
    tm, tn = cfg.tile_m, cfg.tile_n
    cta_n = cfg.cta_n()
    n_work, grid_n = meta.shape[1], n // cta_n
    pipeline = functools.partial(_gmm_pipeline, cfg, k, lhs_gmem.dtype, transpose_rhs)
    ignore = lambda *_, **__: None

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(lhs_gmem, _b_alloc_view(rhs_gmem, cta_n, transpose_rhs)),
        o_smem=plgpu.SMEM((_COMPUTE_WGS, tm, tn), out_gmem.dtype),
        collective_axes="wg",
    )
    def _scope(allocs, o_smem):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((n_work * grid_n,), collective_axes="sm")
        def _tiles(info):
            wi, ni = plgpu.planar_snake(info.index[0], (n_work, grid_n), 1, cfg.grid_tile_width)
            grp, block, lo, count, g = (meta[r, wi] for r in range(5))
            # aligned: BLOCK holds the tile's first row (a multiple of 8)
            row0 = pl.multiple_of(block, 8) if cfg.aligned else block * tm
            wg_n = pl.ds(wg * tn, tn)

            def compute_context(run):
                @functools.partial(pl.run_scoped, acc=plgpu.ACC((tm, tn), jnp.float32))
                def _acc(acc):
                    run(acc)
                    out_cols = pl.ds(ni * cta_n + wg * tn, tn)
                    is_tail = grp == rhs_gmem.shape[0]
                    _gmm_epilogue(acc, o_smem.at[wg], out_gmem, is_tail, row0, lo, count, out_cols, min(tm, m))

            def mma(_, a_smem, b_smem, acc):
                b = b_smem.at[wg_n].T if transpose_rhs else b_smem.at[:, wg_n]
                plgpu.wgmma(acc, a_smem, b)
                # a slot is released when the body returns, and the warp-specialised pipeline
                # does not guard a delayed release across calls: finish the wgmma here (the
                # other compute warpgroup keeps the tensor cores busy meanwhile)
                plgpu.wgmma_wait(0)
                return acc

            n_cols = pl.ds(ni * cta_n, cta_n)
            b_view = rhs_gmem.at[g, n_cols] if transpose_rhs else rhs_gmem.at[g, :, n_cols]

            @pl.when(grp >= 0)
            def _():
                if cfg.aligned:
                    pipeline(mma, compute_context)(lhs_gmem.at[pl.ds(row0, tm)], b_view, allocations=allocs)
                else:
                    pipeline(mma, compute_context, block)(lhs_gmem, b_view, allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


# Jitted so that every call with the same shapes reuses one traced jaxpr, which JAX lowers once per
# module: identical layers (and their remat recomputes) then share one Mosaic GPU kernel, compiled once.
@functools.partial(jax.jit, static_argnames=("transpose_rhs", "tiling", "interpret"))
def gmm(lhs, rhs, group_sizes, *, transpose_rhs=False, tiling=None, interpret=False):
    """``lhs [M,K]``, ``rhs [E,K,N]`` (``[E,N,K]`` read transposed when ``transpose_rhs``)."""
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    cfg = tiling or GMM_TILING
    if k % cfg.tile_k or n % cfg.cta_n():
        raise ValueError(f"K={k} must divide by tile_k={cfg.tile_k} and N={n} by {cfg.cta_n()}")
    m_run = m
    if cfg.aligned:  # tiles start at multiples of 8 and never run past the (padded) rows
        m_run = max(cfg.tile_m, m + (-m % 8))
        lhs = jnp.pad(lhs, ((0, m_run - m), (0, 0))) if m_run != m else lhs
        meta = aligned_tile_schedule(group_sizes, m_run, cfg.tile_m)
    else:
        meta = m_tile_schedule(group_sizes, m, cfg.tile_m)
    body = functools.partial(_gmm_body, cfg=cfg, m=m_run, k=k, n=n, transpose_rhs=transpose_rhs)
    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m_run, n), lhs.dtype),
        grid=(_num_sms(interpret),),
        grid_names=("sm",),
        num_threads=_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=_compiler_params(interpret),
        interpret=_interpret_arg(interpret),
        kernel_name="moe_gmm_transposed" if transpose_rhs else "moe_gmm",
    )(meta, lhs, rhs)
    return out[:m] if m_run != m else out


def _group_rows(group_sizes: jax.Array, tile_m: int) -> jax.Array:
    """Per group: int32 ``[3, E]`` rows = (start row, end row, number of row blocks)."""
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    blocks = jnp.where(group_sizes > 0, (ends - 1) // tile_m - starts // tile_m + 1, 0)
    return jnp.stack([starts, ends, blocks]).astype(jnp.int32)


def _mask_rows(ref, lo, hi):
    """Zero the rows of a ``[rows, cols]`` shared-memory tile outside ``[lo, hi)``."""
    rows = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, ref.shape, 0), plgpu.Layout.WGMMA)
    keep = (rows >= lo) & (rows < hi)
    ref[...] = jnp.where(keep, ref[...], jnp.zeros((), ref.dtype))
    plgpu.commit_smem()


def _tgmm_pipeline(cfg, dtype, body, compute_context, block_of=lambda i: i, num_steps=None):
    """Row-block loop of one tgmm tile; step ``i`` reads row block ``block_of(i)``. The
    allocation-only call leaves ``num_steps`` None: a static grid of ``stages`` steps, so every
    slot gets allocated."""
    tm, tk, cta_n = cfg.tile_m, cfg.tile_k, cfg.cta_n()
    delay = int(cfg.overlap_wgmma)
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(cfg.stages if num_steps is None else num_steps,),
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec((tm, tk), lambda i: (block_of(i), 0), transforms=_swizzled(tk, dtype), delay_release=delay),
            plgpu.BlockSpec(
                (tm, cta_n), lambda i: (block_of(i), 0), transforms=_swizzled(cta_n, dtype), delay_release=delay
            ),
        ],
        wg_axis="wg",
        num_compute_wgs=_COMPUTE_WGS,
        max_concurrent_steps=cfg.stages,
        compute_context=compute_context,
    )


def _wgmma_step_wait(cfg):
    """After issuing a step's wgmma: with ``overlap_wgmma`` only the previous step's must be
    done (its slot is released after this body returns), else this one's."""
    plgpu.wgmma_wait(1 if cfg.overlap_wgmma else 0)


def _drained_alloc(cfg):
    return dict(drained=plgpu.Barrier(num_arrivals=_COMPUTE_WGS)) if cfg.overlap_wgmma else {}


def _drained_arrive(cfg, drained):
    """Compute side, once per pipeline after its last wgmma completed: with delayed release the
    pipeline's quiesce does not wait for the last slot, so the memory warpgroup waits here."""
    if cfg.overlap_wgmma:
        plgpu.barrier_arrive(drained)


def _drained_wait(cfg, drained, wg):
    if cfg.overlap_wgmma:

        @pl.when(wg == _COMPUTE_WGS)
        def _():
            plgpu.barrier_wait(drained)


def _tgmm_body(rows, lhs_gmem, dout_gmem, out_gmem, *, cfg, k, n):
    tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k  # tm: contraction (rows), tk: out rows
    cta_n = cfg.cta_n()
    grid_k, grid_n = k // tk, n // cta_n
    pipeline = functools.partial(_tgmm_pipeline, cfg, lhs_gmem.dtype)
    ignore = lambda *_, **__: None
    alloc_views = (lhs_gmem.at[:, pl.ds(0, tk)], dout_gmem.at[:, pl.ds(0, cta_n)])

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(*alloc_views),
        o_smem=plgpu.SMEM((_COMPUTE_WGS, tk, tn), out_gmem.dtype, transforms=_swizzled(tn, out_gmem.dtype)),
        **_drained_alloc(cfg),
        collective_axes="wg",
    )
    def _scope(allocs, o_smem, drained=None):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((out_gmem.shape[0], grid_k * grid_n), collective_axes="sm")
        def _tiles(info):
            g = info.index[0]
            ki, ni = plgpu.planar_snake(info.index[1], (grid_k, grid_n), 1, cfg.grid_tile_width)
            start, end, num_blocks = rows[0, g], rows[1, g], rows[2, g]
            first = start // tm
            wg_n = pl.ds(wg * tn, tn)
            out_tile = out_gmem.at[g, pl.ds(ki * tk, tk), pl.ds(ni * cta_n + wg * tn, tn)]

            def store(val):
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                o_smem[wg] = val.astype(out_gmem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[wg], out_tile)

            def compute_context(run):
                @functools.partial(pl.run_scoped, acc=plgpu.ACC((tk, tn), jnp.float32))
                def _acc(acc):
                    run(acc)
                    total = acc[...]  # waits for every wgmma
                    _drained_arrive(cfg, drained)
                    store(total)

            def mma(idx, a_smem, b_smem, acc):
                row0 = (first + idx[0]) * tm
                lo, hi = start - row0, end - row0
                b = b_smem.at[:, wg_n]

                @pl.when((lo > 0) | (hi < tm))
                def _():
                    _mask_rows(b, lo, hi)

                plgpu.wgmma(acc, a_smem.T, b)
                _wgmma_step_wait(cfg)
                return acc

            @pl.when(num_blocks > 0)
            def _():
                views = (lhs_gmem.at[:, pl.ds(ki * tk, tk)], dout_gmem.at[:, pl.ds(ni * cta_n, cta_n)])
                pipeline(mma, compute_context, lambda i: first + i, num_blocks)(*views, allocations=allocs)
                _drained_wait(cfg, drained, wg)

            @pl.when((num_blocks == 0) & (wg < _COMPUTE_WGS))
            def _():
                store(_zeros_wgmma((tk, tn), jnp.float32))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _chunk_schedule(group_sizes: jax.Array, m: int, tile_m: int, chunk: int):
    """Work tiles of the chunked tgmm: ``schedule.tile_schedule`` rows (an empty group keeps one
    tile with no rows, so its zeros get stored) plus row LAST (1 on a group's last tile), and
    int32 ``[n_chunks + 1]`` first tile of each chunk of ``chunk`` groups (then the total)."""
    e = group_sizes.shape[0]
    meta = tile_schedule(group_sizes, m, tile_m, tail=False, empty_tiles=True)
    grp = jnp.where(meta[GROUP] >= 0, meta[GROUP], e)  # inactive tiles sort after every group
    last = (grp < e) & (grp != jnp.concatenate([grp[1:], jnp.full((1,), e, grp.dtype)]))
    bounds = jnp.minimum(jnp.arange(pl.cdiv(e, chunk) + 1, dtype=jnp.int32) * chunk, e)
    firsts = jnp.sum(grp[None, :] < bounds[:, None], axis=1)
    return jnp.concatenate([meta, last[None].astype(jnp.int32)]), firsts.astype(jnp.int32)


def _tgmm_chunked_body(meta, firsts, lhs_gmem, dout_gmem, out_gmem, *, cfg, k, n):
    tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k
    cta_n = cfg.cta_n()
    grid_k, grid_n = k // tk, n // cta_n
    pipeline = functools.partial(_tgmm_pipeline, cfg, lhs_gmem.dtype)
    ignore = lambda *_, **__: None
    alloc_views = (lhs_gmem.at[:, pl.ds(0, tk)], dout_gmem.at[:, pl.ds(0, cta_n)])

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(*alloc_views),
        o_smem=plgpu.SMEM((_COMPUTE_WGS, tk, tn), out_gmem.dtype, transforms=_swizzled(tn, out_gmem.dtype)),
        **_drained_alloc(cfg),
        collective_axes="wg",
    )
    def _scope(allocs, o_smem, drained=None):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((firsts.shape[0] - 1, grid_k * grid_n), collective_axes="sm")
        def _tiles(info):
            c = info.index[0]
            ki, ni = plgpu.planar_snake(info.index[1], (grid_k, grid_n), 1, cfg.grid_tile_width)
            t0, wg_n = firsts[c], pl.ds(wg * tn, tn)

            def compute_context(run):
                @functools.partial(pl.run_scoped, acc=plgpu.ACC((tk, tn), jnp.float32))
                def _acc(acc):
                    run((acc, None if cfg.reset_acc else _zeros_wgmma((tk, tn), jnp.float32)))
                    plgpu.wgmma_wait(0)
                    _drained_arrive(cfg, drained)

            def mma(idx, a_smem, b_smem, carry):
                acc, before = carry  # before: the running sum at the current group's start
                t = t0 + idx[0]
                lo, count, last = meta[LO, t], meta[COUNT, t], meta[_LAST, t] != 0
                b = b_smem.at[:, wg_n]

                @pl.when((lo > 0) | (lo + count < tm))
                def _():
                    _mask_rows(b, lo, lo + count)  # an empty group's tile keeps no row

                plgpu.wgmma(acc, a_smem.T, b)
                _wgmma_step_wait(cfg)

                def flush():  # the group's sum is complete; the accumulator keeps running
                    total = acc[...]  # waits for this step's wgmma
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    o_smem[wg] = (total if cfg.reset_acc else total - before).astype(out_gmem.dtype)
                    plgpu.commit_smem()
                    out_cols = pl.ds(ni * cta_n + wg * tn, tn)
                    plgpu.copy_smem_to_gmem(o_smem.at[wg], out_gmem.at[meta[GROUP, t], pl.ds(ki * tk, tk), out_cols])
                    if cfg.reset_acc:
                        acc[...] = _zeros_wgmma((tk, tn), jnp.float32)
                        return None
                    return total

                if cfg.reset_acc:
                    pl.when(last)(flush)
                    return acc, None
                return acc, lax.cond(last, flush, lambda: before)

            views = (lhs_gmem.at[:, pl.ds(ki * tk, tk)], dout_gmem.at[:, pl.ds(ni * cta_n, cta_n)])
            block_of = lambda i: meta[BLOCK, t0 + i]
            pipeline(mma, compute_context, block_of, firsts[c + 1] - t0)(*views, allocations=allocs)
            _drained_wait(cfg, drained, wg)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@functools.partial(jax.jit, static_argnames=("num_groups", "tiling", "interpret"))
def tgmm(lhs, dout, group_sizes, *, num_groups, tiling=None, interpret=False):
    """``out[e] = lhs[rows of e]ᵀ @ dout[rows of e]``: ``[M,K] × [M,N] -> [E,K,N]``, accumulated
    in float32 and stored in ``lhs.dtype`` (a float32 staging tile would not fit in SMEM)."""
    m, k = lhs.shape
    n = dout.shape[1]
    cfg = tiling or TGMM_TILING
    if k % cfg.tile_k or n % cfg.cta_n():
        raise ValueError(f"K={k} must divide by tile_k={cfg.tile_k} and N={n} by {cfg.cta_n()}")
    if group_sizes.shape != (num_groups,):
        raise ValueError(f"group_sizes must have shape ({num_groups},), got {group_sizes.shape}")
    if cfg.group_chunk < 0:
        raise ValueError(f"tiling.group_chunk must be >= 0, got {cfg.group_chunk}")
    if cfg.overlap_wgmma and cfg.stages < 2:
        raise ValueError(f"tiling.stages must be >= 2 with overlap_wgmma, got {cfg.stages}")
    if cfg.reset_acc and (interpret or not cfg.group_chunk):
        raise ValueError("tiling.reset_acc needs group_chunk > 0 and a compiled kernel (interpret=False): "
                         "the GPU interpreter cannot overwrite a wgmma accumulator")
    if cfg.group_chunk:
        args = _chunk_schedule(group_sizes, m, cfg.tile_m, cfg.group_chunk)
        body = functools.partial(_tgmm_chunked_body, cfg=cfg, k=k, n=n)
    else:
        args = (_group_rows(group_sizes, cfg.tile_m),)
        body = functools.partial(_tgmm_body, cfg=cfg, k=k, n=n)
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((num_groups, k, n), lhs.dtype),
        grid=(_num_sms(interpret),),
        grid_names=("sm",),
        num_threads=_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=_compiler_params(interpret),
        interpret=_interpret_arg(interpret),
        kernel_name="moe_tgmm_chunked" if cfg.group_chunk else "moe_tgmm",
    )(*args, lhs, dout)
