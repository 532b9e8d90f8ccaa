"""``gmm`` as one hand-written producer/consumer ring per CTA (``GpuTiling.ring``), as
``kernel_gpu_tgmm_ring`` does for the weight gradient.

``kernel_gpu.gmm`` runs one ``emit_pipeline_warp_specialized`` per (work tile, N tile), which fills
and drains its slots around every tile and waits for each step's wgmma before releasing the step's
slot. Here both sides walk the CTA's tiles over one ``slot_ring`` that persists across tiles: every
tile takes ``K / tile_k`` steps, so the CTA's ``t``-th tile starts at step ``t · K / tile_k``. One
wgmma stays in flight, and the memory warpgroup loads the next tile's first blocks while the compute
warpgroups finish a tile and store it. Work tiles, their rows and stores are ``kernel_gpu.gmm``'s.

Several ``(lhs, rhs)`` pairs (``kernel_gpu.gmm_sum``) share one accumulator: a tile's steps run over
pair 0's K, then pair 1's, ..., the memory warpgroup switching source between them, so the compute
side sees the K steps of the product of the concatenated operands, in the same order.
"""

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe import slot_ring
from pallas_kernels.moe.gmm_tiles import gmm_epilogue, half_or_full_wgmma
from pallas_kernels.moe.kernel_gpu_base import _COMPUTE_WGS, _swizzled
from pallas_kernels.moe.schedule import fits_half


def gmm_ring_body(meta, num_active, *refs, cfg, m, k, n, transpose_rhs):
    """Kernel body over ``meta`` (``schedule.tile_schedule`` rows: group, block, lo, count, weight
    group; the ``num_active[0]`` active tiles first), as ``kernel_gpu._gmm_body``. ``refs``:
    ``lhs_0, rhs_0, lhs_1, rhs_1, ..., out``; ``k``: each pair's contraction length (int or tuple)."""
    *in_refs, out_gmem = refs
    pairs = list(zip(in_refs[0::2], in_refs[1::2]))
    ks = k if isinstance(k, tuple) else (k,) * len(pairs)
    lhs_gmem, rhs_gmem = pairs[0]
    tm, tn, tk, stages = cfg.tile_m, cfg.tile_n, cfg.tile_k, cfg.stages
    cta_n, dtype, ksteps = cfg.cta_n(), lhs_gmem.dtype, sum(ks) // cfg.tile_k
    grid_n = n // cta_n
    b_block = (cta_n, tk) if transpose_rhs else (tk, cta_n)

    def for_each_tile(per_tile):
        """``per_tile(step0, row0, grp, lo, count, g, ni)`` over this CTA's active tiles, ``step0``
        the ring steps of its earlier tiles; returns the steps of all of them."""

        @plgpu.nd_loop((num_active[0] * grid_n,), collective_axes="sm", init_carry=jnp.int32(0))
        def _tiles(info, carry):
            wi, ni = plgpu.planar_snake(info.index[0], (num_active[0], grid_n), 1, cfg.grid_tile_width)
            grp, block, lo, count, g = (meta[r, wi] for r in range(5))
            row0 = pl.multiple_of(block, 8) if cfg.aligned else block * tm  # aligned: BLOCK is the first row
            per_tile(carry, row0, grp, lo, count, g, ni)
            return carry + ksteps

        return _tiles

    @slot_ring.scoped(
        stages,
        a_smem=plgpu.SMEM((stages, tm, tk), dtype, transforms=_swizzled(tk, dtype)),
        b_smem=plgpu.SMEM((stages, *b_block), dtype, transforms=_swizzled(b_block[1], dtype)),
        o_smem=plgpu.SMEM((_COMPUTE_WGS, tm, tn), out_gmem.dtype),
    )
    def _scope(ring, a_smem, b_smem, o_smem):
        def load_pair(step0, lhs, rhs, row0, g, cols, steps):
            @pl.loop(0, steps)
            def _(kk):
                kcols = pl.ds(kk * tk, tk)
                b_src = rhs.at[g, cols, kcols] if transpose_rhs else rhs.at[g, kcols, cols]
                # unaligned tiles may run past M: TMA zero-fills those rows
                ring.load(step0 + kk, [(lhs.at[pl.ds(row0, tm), kcols], a_smem), (b_src, b_smem)])

        def memory():
            def per_tile(step0, row0, grp, lo, count, g, ni):
                del grp, lo, count
                cols = pl.ds(ni * cta_n, cta_n)
                first = step0
                for (lhs, rhs), k_pair in zip(pairs, ks):
                    load_pair(first, lhs, rhs, row0, g, cols, k_pair // tk)
                    first = first + k_pair // tk

            ring.drain(for_each_tile(per_tile))

        def compute(wg):
            wg_n = pl.ds(wg * tn, tn)

            def per_tile(step0, row0, grp, lo, count, g, ni):
                del g
                half = fits_half(lo, count, tm) if cfg.half_tiles else None

                def step_body(acc, kk):
                    slot = ring.take(step0 + kk)
                    b = b_smem.at[slot, wg_n].T if transpose_rhs else b_smem.at[slot, :, wg_n]
                    if cfg.half_tiles:
                        half_or_full_wgmma(acc, a_smem.at[slot], b, half)
                    else:
                        plgpu.wgmma(acc, a_smem.at[slot], b)
                    ring.release_previous(step0 + kk, kk == 0)

                @functools.partial(pl.run_scoped, acc=plgpu.ACC((tm, tn), jnp.float32))
                def _acc(acc):
                    pl.loop(0, ksteps)(functools.partial(step_body, acc))
                    plgpu.wgmma_wait(0)
                    ring.release(step0 + ksteps - 1)
                    out_cols = pl.ds(ni * cta_n + wg * tn, tn)
                    is_tail = grp == rhs_gmem.shape[0]
                    gmm_epilogue(acc, o_smem.at[wg], out_gmem, is_tail, row0, lo, count, out_cols, min(tm, m))

            for_each_tile(per_tile)

        slot_ring.split_warpgroups(memory, compute)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
