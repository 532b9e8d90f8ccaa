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

``ping_pong``: the compute warpgroups take the CTA's tiles in turn, each tile whole, and each has a
ring of its own (a warpgroup must wait on every step of a ring it waits on: ``slot_ring``); the
memory warpgroup fills them alternately, so one warpgroup's epilogue overlaps the other's wgmmas.
"""

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import int_ops
from pallas_kernels.moe import slot_ring
from pallas_kernels.moe.gmm_tiles import glu_epilogue, gmm_epilogue, half_or_full_wgmma
from pallas_kernels.moe.kernel_gpu_base import _COMPUTE_WGS, _swizzled
from pallas_kernels.moe.schedule import fits_half


def gmm_ring_body(meta, num_active, *refs, cfg, m, k, n, transpose_rhs, glu=None):
    """Kernel body over ``meta`` (``schedule.tile_schedule`` rows: group, block, lo, count, weight
    group; the ``num_active[0]`` active tiles first), as ``kernel_gpu._gmm_body``. ``refs``:
    ``lhs_0, rhs_0, lhs_1, rhs_1, ..., out``; ``k``: each pair's contraction length (int or tuple).
    ``glu`` (``kernel_gpu.gmm_glu``, ping-pong only): the outputs are ``a, d`` from ``glu_epilogue``."""
    *in_refs, out_gmem, d_gmem = refs if glu is not None else (*refs, None)
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

    # ping-pong: each compute warpgroup takes every other tile whole (all cta_n columns), from a ring
    # of its own, so one warpgroup's epilogue runs under the other's wgmmas
    rings, acc_n = (2, cta_n) if cfg.ping_pong else (1, tn)

    @slot_ring.scoped(
        stages,
        rings=rings,
        a_smem=plgpu.SMEM((rings * stages, tm, tk), dtype, transforms=_swizzled(tk, dtype)),
        b_smem=plgpu.SMEM((rings * stages, *b_block), dtype, transforms=_swizzled(b_block[1], dtype)),
        # gmm_glu: a staging tile of half the accumulator's width for each of its three outputs
        o_smem=plgpu.SMEM((_COMPUTE_WGS, tm, acc_n) if glu is None else (_COMPUTE_WGS, 3, tm, acc_n // 2),
                          out_gmem.dtype),
    )
    def _scope(ring, a_smem, b_smem, o_smem):
        def tile_ring(step0):
            """(the ring of the tile starting at CTA step ``step0``, its first step in that ring)."""
            if not cfg.ping_pong:
                return ring, step0
            t = int_ops.div(step0, ksteps)  # the CTA's t-th tile
            return ring.part(int_ops.rem(t, 2)), int_ops.div(t, 2) * ksteps

        def load_pair(r, step0, lhs, rhs, row0, g, cols, steps):
            @pl.loop(0, steps)
            def _(kk):
                kcols = pl.ds(kk * tk, tk)
                b_src = rhs.at[g, cols, kcols] if transpose_rhs else rhs.at[g, kcols, cols]
                # unaligned tiles may run past M: TMA zero-fills those rows
                r.load(step0 + kk, [(lhs.at[pl.ds(row0, tm), kcols], a_smem), (b_src, b_smem)])

        def memory():
            def per_tile(step0, row0, grp, lo, count, g, ni):
                del grp, lo, count
                cols = pl.ds(ni * cta_n, cta_n)
                r, first = tile_ring(step0)
                for (lhs, rhs), k_pair in zip(pairs, ks):
                    load_pair(r, first, lhs, rhs, row0, g, cols, k_pair // tk)
                    first = first + k_pair // tk

            steps = for_each_tile(per_tile)
            if cfg.ping_pong:  # ring 0 took the even tiles, ring 1 the odd ones
                tiles = int_ops.div(steps, ksteps)
                ring.part(0).drain(int_ops.div(tiles + 1, 2) * ksteps)
                ring.part(1).drain(int_ops.div(tiles, 2) * ksteps)
            else:
                ring.drain(steps)

        def compute(wg):
            wg_n = pl.ds(0, cta_n) if cfg.ping_pong else pl.ds(wg * tn, tn)

            def tile(r, step0, row0, grp, lo, count, ni):
                half = fits_half(lo, count, tm) if cfg.half_tiles else None

                def step_body(acc, kk):
                    slot = r.take(step0 + kk)
                    b = b_smem.at[slot, wg_n].T if transpose_rhs else b_smem.at[slot, :, wg_n]
                    if cfg.half_tiles:
                        half_or_full_wgmma(acc, a_smem.at[slot], b, half)
                    else:
                        plgpu.wgmma(acc, a_smem.at[slot], b)
                    r.release_previous(step0 + kk, kk == 0)

                @functools.partial(pl.run_scoped, acc=plgpu.ACC((tm, acc_n), jnp.float32))
                def _acc(acc):
                    pl.loop(0, ksteps)(functools.partial(step_body, acc))
                    plgpu.wgmma_wait(0)
                    r.release(step0 + ksteps - 1)
                    col0, is_tail = ni * cta_n + (0 if cfg.ping_pong else wg * tn), grp == rhs_gmem.shape[0]
                    if glu is None:
                        gmm_epilogue(acc, o_smem.at[wg], out_gmem, is_tail, row0, lo, count, pl.ds(col0, acc_n),
                                     min(tm, m))
                    else:
                        glu_epilogue(acc, o_smem.at[wg], out_gmem, d_gmem, is_tail, row0, lo, count, col0, min(tm, m),
                                     glu)

            def per_tile(step0, row0, grp, lo, count, g, ni):
                del g
                r, first = tile_ring(step0)
                if cfg.ping_pong:  # this warpgroup's tiles only
                    mine = int_ops.rem(int_ops.div(step0, ksteps), 2) == wg
                    pl.when(mine)(lambda: tile(r, first, row0, grp, lo, count, ni))
                else:
                    tile(r, first, row0, grp, lo, count, ni)

            for_each_tile(per_tile)

        slot_ring.split_warpgroups(memory, compute)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
