"""``tgmm`` for Hopper in Pallas Mosaic GPU: ``out[e] = lhs[rows of e]ᵀ @ dout[rows of e]`` (the
weight gradient of the grouped matmul; zero for empty groups). A persistent, warp-specialised
kernel like ``kernel_gpu.gmm`` (see its docstring).

Algorithm of ``tgmm``: per (group, K tile, N tile) stream the group's row blocks; the
compute warpgroup zeroes the ``dout`` rows of a boundary block that belong to other groups
before its ``wgmma`` (TMA already zero-fills rows past M). With ``aligned`` (the default) a
group's blocks start at its first row rounded down to 8 (a TMA row offset must be a multiple of
the 8-row SMEM tiling; the last block is clamped to end at M), so a group of ``s`` rows takes
``ceil((s + start % 8) / tile_m)`` steps; otherwise blocks start at multiples of ``tile_m`` and a
group spans up to one more. At the benchmark's E = 128 shape that is 8 % fewer steps.
The default (``ring``) streams a CTA's tiles through one hand-written slot ring
(``kernel_gpu_tgmm_ring``); otherwise each output tile runs its own pipeline (below).
With ``group_chunk = C > 0`` one pipeline instead streams the row blocks of C consecutive groups
for a (K tile, N tile), so the pipeline ramp is paid once per C groups (small groups: a few row
blocks each). The
accumulator runs over the whole chunk and a group's tile is the running sum minus the sum at
its start, kept in registers (the GPU interpreter cannot overwrite an accumulator; this costs
~f32 eps x the chunk's earlier sums, far below the bf16 output rounding, and a second
accumulator-sized register tile: use tile_k x tile_n <= 64 x 128). ``reset_acc`` instead
zeroes the accumulator after each group's store (no second tile, any output tile; compiled
kernels only, so checked on the GPU). An empty group is one fully masked block.
``trim_rows``: a partial row block contracts only over the wgmma K groups holding its group's
rows; Mosaic GPU issues a wgmma's K in whole swizzle widths (64 bf16 rows at 128 bytes), so
finer trimming needs the narrower ``swizzle_bytes=32`` (16 rows).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import int_ops
from pallas_kernels.moe import kernel_gpu_base
from pallas_kernels.moe.kernel_gpu_base import (
    _COMPUTE_WGS, GpuTiling, _swizzled, _zeros_wgmma,
)
from pallas_kernels.moe.kernel_gpu_tgmm_ring import tgmm_ring_body
from pallas_kernels.moe.schedule import BLOCK, COUNT, GROUP, LO, tile_schedule
from pallas_kernels.moe.tgmm_rows import block_rows, group_rows, k_group_rows, mask_rows, wgmma_rows

_LAST = 5  # row of the chunked tgmm schedule after schedule.tile_schedule's five
# one pipeline per output tile (the default until the slot ring; most candidates vary it)
TGMM_PIPELINED = GpuTiling(tile_m=64, tile_n=128, tile_k=128, stages=3)
TGMM_TILING = dataclasses.replace(TGMM_PIPELINED, ring=True)  # 0.35 against 0.43 ms at E = 128 (RESULTS.md)
# tgmm tilings the benchmark times per shape (each fits the H200's 227 KiB of shared memory;
# chunked ones keep tile_k x tile_n <= 64 x 128 for their second register tile)
TGMM_CANDIDATES = (
    TGMM_TILING,
    dataclasses.replace(TGMM_PIPELINED, overlap_wgmma=True),
    GpuTiling(tile_m=128, tile_n=128, tile_k=64, stages=2, overlap_wgmma=True),
    GpuTiling(tile_m=64, tile_n=128, tile_k=64, stages=4, group_chunk=4),
    GpuTiling(tile_m=64, tile_n=128, tile_k=64, stages=4, group_chunk=4, overlap_wgmma=True),
    GpuTiling(tile_m=64, tile_n=128, tile_k=64, stages=4, group_chunk=8, overlap_wgmma=True),
    GpuTiling(tile_m=64, tile_n=128, tile_k=64, stages=4, group_chunk=16, overlap_wgmma=True),
    GpuTiling(tile_m=128, tile_n=128, tile_k=64, stages=2, group_chunk=8, overlap_wgmma=True),
    GpuTiling(tile_m=64, tile_n=64, tile_k=128, stages=4, group_chunk=8, overlap_wgmma=True),
    # compiled only: checked against the default tiling on the GPU before it may be picked
    dataclasses.replace(TGMM_PIPELINED, group_chunk=8, reset_acc=True),
    dataclasses.replace(TGMM_PIPELINED, group_chunk=4, overlap_wgmma=True, reset_acc=True),
    dataclasses.replace(TGMM_PIPELINED, group_chunk=8, overlap_wgmma=True, reset_acc=True),
    # 128 rows per step at 224 KiB of shared memory
    GpuTiling(tile_m=128, tile_n=64, tile_k=128, stages=3, overlap_wgmma=True),
    GpuTiling(tile_m=128, tile_n=64, tile_k=128, stages=3, group_chunk=8, overlap_wgmma=True, reset_acc=True),
    # 128-row steps whose partial blocks contract over 64 rows where their rows fit (trim_rows)
    GpuTiling(tile_m=128, tile_n=128, tile_k=64, stages=2, overlap_wgmma=True, trim_rows=True),
    GpuTiling(tile_m=128, tile_n=128, tile_k=64, stages=2, group_chunk=8, overlap_wgmma=True, trim_rows=True),
    GpuTiling(tile_m=128, tile_n=64, tile_k=128, stages=3, overlap_wgmma=True, trim_rows=True),
    GpuTiling(tile_m=128, tile_n=64, tile_k=128, stages=3, group_chunk=8, overlap_wgmma=True, reset_acc=True,
              trim_rows=True),
    # 32-byte swizzle: partial blocks contract over 16-row K groups (narrower TMA boxes)
    dataclasses.replace(TGMM_PIPELINED, swizzle_bytes=32, trim_rows=True),
    dataclasses.replace(TGMM_PIPELINED, overlap_wgmma=True, swizzle_bytes=32, trim_rows=True),
    GpuTiling(tile_m=128, tile_n=128, tile_k=64, stages=2, overlap_wgmma=True, swizzle_bytes=32, trim_rows=True),
    GpuTiling(tile_m=64, tile_n=128, tile_k=64, stages=4, group_chunk=8, overlap_wgmma=True, swizzle_bytes=32,
              trim_rows=True),
    # 2-CTA clusters sharing each dout block by multicast (a third less L2-to-SM traffic a step)
    dataclasses.replace(TGMM_PIPELINED, cluster_k=True),
    dataclasses.replace(TGMM_PIPELINED, overlap_wgmma=True, cluster_k=True),
    GpuTiling(tile_m=128, tile_n=128, tile_k=64, stages=2, overlap_wgmma=True, cluster_k=True),
    # row blocks at multiples of tile_m (the default before aligned blocks)
    dataclasses.replace(TGMM_PIPELINED, aligned=False),
    # CTAs running at the same time on different groups' rows
    dataclasses.replace(TGMM_PIPELINED, group_run=4),
    dataclasses.replace(TGMM_PIPELINED, group_run=8),
    dataclasses.replace(TGMM_PIPELINED, group_run=16),
    dataclasses.replace(TGMM_PIPELINED, group_run=8, cluster_k=True),
    # the per-tile pipeline (the default before the slot ring), then more slot rings (kernel_gpu_tgmm_ring)
    TGMM_PIPELINED,
    dataclasses.replace(TGMM_TILING, group_run=4),
    GpuTiling(tile_m=64, tile_n=128, tile_k=64, stages=4, ring=True),
    GpuTiling(tile_m=128, tile_n=128, tile_k=64, stages=2, ring=True),
    dataclasses.replace(TGMM_TILING, swizzle_bytes=32, trim_rows=True),
    dataclasses.replace(TGMM_TILING, stages=2),
    dataclasses.replace(TGMM_TILING, stages=4, store_rows=64),  # 4 slots: the output staged 64 rows at a time
)


def _tgmm_pipeline(cfg, dtype, body, compute_context, row_of=lambda i: i, num_steps=None):
    """Row-block loop of one tgmm tile; step ``i`` reads the ``tile_m`` rows from row ``row_of(i)``
    (any row: the row dim is a ``pl.Element`` block). The allocation-only call leaves ``num_steps``
    None: a static grid of ``stages`` steps, so every slot gets allocated."""
    tm, tk, cta_n = cfg.tile_m, cfg.tile_k, cfg.cta_n()
    delay = int(cfg.overlap_wgmma)
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(cfg.stages if num_steps is None else num_steps,),
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec((pl.Element(shape[0]), shape[1]), lambda i: (row_of(i), 0), delay_release=delay,
                            transforms=_swizzled(shape[1], dtype, cfg.swizzle_bytes), collective_axes=axes)
            for shape, axes in (((tm, tk), ()), ((tm, cta_n), ("cluster",) if cfg.cluster_k else ()))
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


def _tgmm_scope(cfg, lhs_gmem, dout_gmem, out_gmem):
    """``(pipeline, scoped)``: the row-block pipeline of one output tile, and a decorator running its
    body with the pipeline's slots, the output staging tiles and (overlap) the drain barrier."""
    pipeline = functools.partial(_tgmm_pipeline, cfg, lhs_gmem.dtype)
    ignore = lambda *_, **__: None
    alloc_views = (lhs_gmem.at[:, pl.ds(0, cfg.tile_k)], dout_gmem.at[:, pl.ds(0, cfg.cta_n())])
    scoped = functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(*alloc_views),
        o_smem=plgpu.SMEM((_COMPUTE_WGS, cfg.tile_k, cfg.tile_n), out_gmem.dtype,
                          transforms=_swizzled(cfg.tile_n, out_gmem.dtype)),
        **_drained_alloc(cfg),
        collective_axes="wg",
    )
    return pipeline, scoped


def _tgmm_body(rows, lhs_gmem, dout_gmem, out_gmem, *, cfg, m, k, n):
    tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k  # tm: contraction (rows), tk: out rows
    cta_n = cfg.cta_n()
    pair = 2 if cfg.cluster_k else 1  # CTAs of a cluster: adjacent output-row tiles, one dout stream
    grid_k, grid_n = k // tk // pair, n // cta_n
    pipeline, scoped = _tgmm_scope(cfg, lhs_gmem, dout_gmem, out_gmem)

    @scoped
    def _scope(allocs, o_smem, drained=None):
        wg = lax.axis_index("wg")

        def _tile(g, kn):
            ki, ni = plgpu.planar_snake(kn, (grid_k, grid_n), 1, cfg.grid_tile_width)
            if cfg.cluster_k:
                ki = pair * ki + lax.axis_index("cluster")
            start, end, num_blocks = rows[0, g], rows[1, g], rows[2, g]

            rows_of = functools.partial(block_rows, cfg, m, start=start)

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
                row0, own = rows_of(idx[0])
                lo, hi = own - row0, end - row0
                b = b_smem.at[:, wg_n]

                @pl.when((lo > 0) | (hi < tm))
                def _():
                    mask_rows(b, lo, hi)

                wgmma_rows(cfg, acc, a_smem, b, lo, hi)
                _wgmma_step_wait(cfg)
                return acc

            @pl.when(num_blocks > 0)
            def _():
                views = (lhs_gmem.at[:, pl.ds(ki * tk, tk)], dout_gmem.at[:, pl.ds(ni * cta_n, cta_n)])
                pipeline(mma, compute_context, lambda i: rows_of(i)[0], num_blocks)(*views, allocations=allocs)
                _drained_wait(cfg, drained, wg)

            @pl.when((num_blocks == 0) & (wg < _COMPUTE_WGS))
            def _():
                store(_zeros_wgmma((tk, tn), jnp.float32))

        e, group_run = out_gmem.shape[0], cfg.group_run

        @plgpu.nd_loop((int_ops.cdiv(e, group_run), grid_k * grid_n, group_run), collective_axes="sm")
        def _tiles(info):
            g = info.index[0] * group_run + info.index[2]
            if e % group_run:
                pl.when(g < e)(lambda: _tile(g, info.index[1]))
            else:
                _tile(g, info.index[1])

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _chunk_schedule(group_sizes: jax.Array, m: int, tile_m: int, chunk: int):
    """Work tiles of the chunked tgmm: ``schedule.tile_schedule`` rows (an empty group keeps one
    tile with no rows, so its zeros get stored) plus row LAST (1 on a group's last tile), and
    int32 ``[n_chunks + 1]`` first tile of each chunk of ``chunk`` groups (then the total)."""
    e = group_sizes.shape[0]
    meta = tile_schedule(group_sizes, m, tile_m, tail=False, empty_tiles=True)
    grp = jnp.where(meta[GROUP] >= 0, meta[GROUP], e)  # inactive tiles sort after every group
    last = (grp < e) & (grp != jnp.concatenate([grp[1:], jnp.full((1,), e, grp.dtype)]))
    bounds = jnp.minimum(jnp.arange(int_ops.cdiv(e, chunk) + 1, dtype=jnp.int32) * chunk, e)
    firsts = jnp.sum(grp[None, :] < bounds[:, None], axis=1)
    return jnp.concatenate([meta, last[None].astype(jnp.int32)]), firsts.astype(jnp.int32)


def _tgmm_chunked_body(meta, firsts, lhs_gmem, dout_gmem, out_gmem, *, cfg, k, n):
    tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k
    cta_n = cfg.cta_n()
    grid_k, grid_n = k // tk, n // cta_n
    pipeline, scoped = _tgmm_scope(cfg, lhs_gmem, dout_gmem, out_gmem)

    @scoped
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
                    mask_rows(b, lo, lo + count)  # an empty group's tile keeps no row

                wgmma_rows(cfg, acc, a_smem, b, lo, lo + count)
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
            row_of = lambda i: meta[BLOCK, t0 + i] * tm
            pipeline(mma, compute_context, row_of, firsts[c + 1] - t0)(*views, allocations=allocs)
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
    if cfg.group_run < 1 or (cfg.group_run > 1 and cfg.group_chunk):
        raise ValueError(f"tiling.group_run must be >= 1, and 1 with group_chunk > 0, got group_run={cfg.group_run}, "
                         f"group_chunk={cfg.group_chunk}")
    if cfg.overlap_wgmma and cfg.stages < 2:
        raise ValueError(f"tiling.stages must be >= 2 with overlap_wgmma, got {cfg.stages}")
    if cfg.reset_acc and (interpret or not cfg.group_chunk):
        raise ValueError("tiling.reset_acc needs group_chunk > 0 and a compiled kernel (interpret=False): "
                         "the GPU interpreter cannot overwrite a wgmma accumulator")
    if cfg.swizzle_bytes not in (0, 32, 64, 128):
        raise ValueError(f"tiling.swizzle_bytes must be 0, 32, 64 or 128, got {cfg.swizzle_bytes}")
    if cfg.cluster_k and (cfg.group_chunk or (k // cfg.tile_k) % 2):
        raise ValueError(f"tiling.cluster_k needs group_chunk=0 and an even number of K tiles, got "
                         f"group_chunk={cfg.group_chunk}, K/tile_k={k // cfg.tile_k}")
    if cfg.trim_rows and cfg.tile_m < 2 * k_group_rows(cfg, lhs.dtype):
        raise ValueError(f"tiling.tile_m must be >= {2 * k_group_rows(cfg, lhs.dtype)} (two wgmma K groups) "
                         f"with trim_rows, got {cfg.tile_m}")
    if cfg.ring and (cfg.group_chunk or cfg.cluster_k or cfg.stages < 2):
        raise ValueError(f"tiling.ring needs group_chunk=0, cluster_k=False and stages >= 2, got "
                         f"group_chunk={cfg.group_chunk}, cluster_k={cfg.cluster_k}, stages={cfg.stages}")
    if cfg.store_rows and (not cfg.ring or cfg.store_rows % 64 or cfg.tile_k % cfg.store_rows):
        raise ValueError(f"tiling.store_rows needs ring=True and a multiple of 64 dividing tile_k={cfg.tile_k}, "
                         f"got ring={cfg.ring}, store_rows={cfg.store_rows}")
    if cfg.group_chunk:
        args = _chunk_schedule(group_sizes, m, cfg.tile_m, cfg.group_chunk)
        body = functools.partial(_tgmm_chunked_body, cfg=cfg, k=k, n=n)
    else:
        if cfg.aligned:  # blocks start at multiples of 8 and lie inside the (padded) rows
            m, lhs, dout = kernel_gpu_base.pad_rows_for_aligned(cfg.tile_m, lhs, dout)
        args = (group_rows(group_sizes, cfg.tile_m, cfg.aligned),)
        body = functools.partial(tgmm_ring_body if cfg.ring else _tgmm_body, cfg=cfg, m=m, k=k, n=n)
    return kernel_gpu_base.persistent_kernel(
        body, jax.ShapeDtypeStruct((num_groups, k, n), lhs.dtype), interpret=interpret,
        name="moe_tgmm_chunked" if cfg.group_chunk else "moe_tgmm_ring" if cfg.ring else "moe_tgmm", cluster=2 if cfg.cluster_k else 1,
    )(*args, lhs, dout)
