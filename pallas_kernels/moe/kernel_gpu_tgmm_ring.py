"""The per-group ``tgmm`` as one hand-written producer/consumer ring per CTA (``GpuTiling.ring``).

``kernel_gpu_tgmm``'s per-group kernel runs one ``emit_pipeline_warp_specialized`` per output
tile (group, K tile, N tile): each fills its ring of ``stages`` shared-memory slots from empty and
drains it before the tile's store, so at E = 128 (a group is 2-8 row blocks) much of every tile is
ramp. Here both sides walk the CTA's tiles over one ``slot_ring`` that persists across tiles: a
tile of ``n`` row blocks that starts at step ``s`` ends at ``s + n``. The compute warpgroups zero a
block's rows of other groups in their half of ``dout`` before its wgmma, keep one wgmma in flight,
and store a tile while the memory warpgroup already loads the next tile's blocks. ``store_rows``
stages the output tile in parts of that many rows, which frees shared memory for a fourth slot at
64 × 128 × 128. The row blocks and their masks are those of the per-group kernel (``tgmm_rows``).
"""

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import int_ops
from pallas_kernels.moe import slot_ring
from pallas_kernels.moe.kernel_gpu_base import _COMPUTE_WGS, _swizzled, _zeros_wgmma
from pallas_kernels.moe.tgmm_rows import block_rows, mask_rows, wgmma_rows


def tgmm_ring_body(rows, lhs_gmem, dout_gmem, out_gmem, *, cfg, m, k, n):
    """Kernel body: ``rows`` int32 ``[3, E]`` (start row, end row, row blocks) per group
    (``tgmm_rows.group_rows``); ``lhs`` and ``dout`` have ``m`` rows (padded for aligned blocks)."""
    tm, tn, tk, stages = cfg.tile_m, cfg.tile_n, cfg.tile_k, cfg.stages
    cta_n, dtype = cfg.cta_n(), lhs_gmem.dtype
    grid_k, grid_n = k // tk, n // cta_n
    e, run = out_gmem.shape[0], cfg.group_run
    o_rows = cfg.store_rows or tk  # rows of the output staging tile

    def for_each_tile(per_tile):
        """``per_tile(g, ki, ni, step)`` over this CTA's tiles in order; ``step``: the ring steps of
        the CTA's earlier tiles. Returns the steps of all of them."""

        @plgpu.nd_loop((int_ops.cdiv(e, run), grid_k * grid_n, run), collective_axes="sm", init_carry=jnp.int32(0))
        def _tiles(info, carry):  # carry: the ring steps so far
            g = info.index[0] * run + info.index[2]
            ki, ni = plgpu.planar_snake(info.index[1], (grid_k, grid_n), 1, cfg.grid_tile_width)
            g_in = jnp.minimum(g, e - 1)
            blocks = jnp.where(g < e, rows[2, g_in], 0)  # a partial last run of groups: no rows
            pl.when(g < e)(lambda: per_tile(g_in, ki, ni, carry, blocks))
            return carry + blocks

        return _tiles

    @slot_ring.scoped(
        stages,
        a_smem=plgpu.SMEM((stages, tm, tk), dtype, transforms=_swizzled(tk, dtype, cfg.swizzle_bytes)),
        b_smem=plgpu.SMEM((stages, tm, cta_n), dtype, transforms=_swizzled(cta_n, dtype, cfg.swizzle_bytes)),
        o_smem=plgpu.SMEM((_COMPUTE_WGS, o_rows, tn), out_gmem.dtype, transforms=_swizzled(tn, out_gmem.dtype)),
    )
    def _scope(ring, a_smem, b_smem, o_smem):
        def memory():
            def per_tile(g, ki, ni, step0, blocks):
                @pl.loop(0, blocks)
                def _(i):
                    row0 = block_rows(cfg, m, i, rows[0, g])[0]
                    ring.load(step0 + i, [(lhs_gmem.at[pl.ds(row0, tm), pl.ds(ki * tk, tk)], a_smem),
                                          (dout_gmem.at[pl.ds(row0, tm), pl.ds(ni * cta_n, cta_n)], b_smem)])

            ring.drain(for_each_tile(per_tile))

        def compute(wg):
            def store(out_tile, val):
                for r in range(0, tk, o_rows):  # through the staging tile, o_rows rows at a time
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    o_smem[wg] = val[r:r + o_rows].astype(out_gmem.dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(o_smem.at[wg], out_tile.at[pl.ds(r, o_rows)])

            def per_tile(g, ki, ni, step0, blocks):
                start, end = rows[0, g], rows[1, g]
                out_tile = out_gmem.at[g, pl.ds(ki * tk, tk), pl.ds(ni * cta_n + wg * tn, tn)]

                def step_body(acc, i):
                    slot = ring.take(step0 + i)
                    row0, own = block_rows(cfg, m, i, start)
                    lo, hi = own - row0, end - row0
                    b = b_smem.at[slot, :, pl.ds(wg * tn, tn)]
                    pl.when((lo > 0) | (hi < tm))(lambda: mask_rows(b, lo, hi))
                    wgmma_rows(cfg, acc, a_smem.at[slot], b, lo, hi)
                    ring.release_previous(step0 + i, i == 0)

                @pl.when(blocks > 0)
                def _():
                    @functools.partial(pl.run_scoped, acc=plgpu.ACC((tk, tn), jnp.float32))
                    def _acc(acc):
                        pl.loop(0, blocks)(functools.partial(step_body, acc))
                        total = acc[...]  # waits for the tile's last wgmma
                        ring.release(step0 + blocks - 1)
                        store(out_tile, total)

                pl.when(blocks == 0)(lambda: store(out_tile, _zeros_wgmma((tk, tn), jnp.float32)))

            for_each_tile(per_tile)

        slot_ring.split_warpgroups(memory, compute)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
