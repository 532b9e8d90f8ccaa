"""The per-group ``tgmm`` as one hand-written producer/consumer ring per CTA (``GpuTiling.ring``).

``kernel_gpu_tgmm``'s per-group kernel runs one ``emit_pipeline_warp_specialized`` per output
tile (group, K tile, N tile): each fills its ring of ``stages`` shared-memory slots from empty and
drains it before the tile's store, so at E = 128 (a group is 2-8 row blocks) much of every tile is
ramp. Here the memory warpgroup and the compute warpgroups each walk the CTA's tiles in their own
loop over one ring that persists across tiles:

- step ``s`` (counted over all of the CTA's tiles) uses slot ``s % stages``; the memory warpgroup
  waits for the slot's ``consumed`` barrier (from step ``s - stages``), then copies the step's
  ``lhs`` and ``dout`` row blocks into it by TMA, arriving at its ``loaded`` barrier;
- the compute warpgroups wait for ``loaded``, zero the block's rows of other groups in their half
  of ``dout``, issue the wgmma and wait for the previous step's, then release that step's slot, so
  one wgmma stays in flight; at a tile's end they wait for its last wgmma, release its slot and
  store the tile while the memory warpgroup is already loading the next tile's blocks;
  ``store_rows`` stages the tile in parts of that many rows, which frees shared memory for a
  fourth slot at 64 × 128 × 128.

Each barrier tracks its own phase (Mosaic GPU flips a per-barrier parity bit at every wait), and
both sides see the same step sequence, so a step's slot needs no bookkeeping beyond the count:
a tile of ``n`` blocks that starts at step ``s`` ends at ``s + n``. The row blocks and their masks
are those of the per-group kernel (``tgmm_rows``).
"""

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe.kernel_gpu_base import _COMPUTE_WGS, _swizzled, _zeros_wgmma
from pallas_kernels.moe.tgmm_rows import block_rows, mask_rows, wgmma_rows

MEMORY_REGISTERS = 40
COMPUTE_REGISTERS = (512 - MEMORY_REGISTERS) // _COMPUTE_WGS // 8 * 8  # the rest of the SM's registers


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

        @plgpu.nd_loop((pl.cdiv(e, run), grid_k * grid_n, run), collective_axes="sm", init_carry=jnp.int32(0))
        def _tiles(info, carry):
            step = carry
            g = info.index[0] * run + info.index[2]
            ki, ni = plgpu.planar_snake(info.index[1], (grid_k, grid_n), 1, cfg.grid_tile_width)
            g_in = jnp.minimum(g, e - 1)
            blocks = jnp.where(g < e, rows[2, g_in], 0)  # a partial last run of groups: no rows
            pl.when(g < e)(lambda: per_tile(g_in, ki, ni, step, blocks))
            return step + blocks

        return _tiles

    @functools.partial(
        pl.run_scoped,
        a_smem=plgpu.SMEM((stages, tm, tk), dtype, transforms=_swizzled(tk, dtype, cfg.swizzle_bytes)),
        b_smem=plgpu.SMEM((stages, tm, cta_n), dtype, transforms=_swizzled(cta_n, dtype, cfg.swizzle_bytes)),
        o_smem=plgpu.SMEM((_COMPUTE_WGS, o_rows, tn), out_gmem.dtype, transforms=_swizzled(tn, out_gmem.dtype)),
        loaded=plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # one arrival per TMA copy
        consumed=plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),
        collective_axes="wg",
    )
    def _scope(a_smem, b_smem, o_smem, loaded, consumed):
        wg = lax.axis_index("wg")

        @pl.when(wg == _COMPUTE_WGS)
        def _memory():
            plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

            def per_tile(g, ki, ni, step0, blocks):
                @pl.loop(0, blocks)
                def _(i):
                    step = step0 + i
                    slot = lax.rem(step, stages)
                    pl.when(step >= stages)(lambda: plgpu.barrier_wait(consumed.at[slot]))
                    row0 = block_rows(cfg, m, i, rows[0, g])[0]
                    plgpu.copy_gmem_to_smem(lhs_gmem.at[pl.ds(row0, tm), pl.ds(ki * tk, tk)], a_smem.at[slot],
                                            loaded.at[slot])
                    plgpu.copy_gmem_to_smem(dout_gmem.at[pl.ds(row0, tm), pl.ds(ni * cta_n, cta_n)],
                                            b_smem.at[slot], loaded.at[slot])

            steps = for_each_tile(per_tile)

            @pl.loop(jnp.maximum(steps - stages, 0), steps)
            def _quiesce(step):  # the last slots' releases: leave no barrier phase pending
                plgpu.barrier_wait(consumed.at[lax.rem(step, stages)])

        @pl.when(wg < _COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

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
                    step = step0 + i
                    slot = lax.rem(step, stages)
                    plgpu.barrier_wait(loaded.at[slot])
                    row0, own = block_rows(cfg, m, i, start)
                    lo, hi = own - row0, end - row0
                    b = b_smem.at[slot, :, pl.ds(wg * tn, tn)]
                    pl.when((lo > 0) | (hi < tm))(lambda: mask_rows(b, lo, hi))
                    wgmma_rows(cfg, acc, a_smem.at[slot], b, lo, hi)
                    plgpu.wgmma_wait(1)  # the previous step's wgmma is done: release its slot
                    pl.when(i > 0)(lambda: plgpu.barrier_arrive(consumed.at[lax.rem(step - 1, stages)]))

                @pl.when(blocks > 0)
                def _():
                    @functools.partial(pl.run_scoped, acc=plgpu.ACC((tk, tn), jnp.float32))
                    def _acc(acc):
                        pl.loop(0, blocks)(functools.partial(step_body, acc))
                        total = acc[...]  # waits for the tile's last wgmma
                        plgpu.barrier_arrive(consumed.at[lax.rem(step0 + blocks - 1, stages)])
                        store(out_tile, total)

                pl.when(blocks == 0)(lambda: store(out_tile, _zeros_wgmma((tk, tn), jnp.float32)))

            for_each_tile(per_tile)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
