"""Grouped matmuls for Hopper in Pallas Mosaic GPU (``plgpu``): ``gmm`` here, ``tgmm`` in :mod:`kernel_gpu_tgmm`.

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
3. ``half_tiles``: a tile whose rows all lie in its first ``tile_m / 2`` (most groups' last tile
   is partial) issues its wgmmas on a half-height slice of the SMEM tile and accumulator; at the
   benchmark's E=128 shape that cuts the issued rows of a gmm by ~10 % (see ``schedule.issued_rows``).
4. ``ring``: the same tiles through one hand-written slot ring per CTA (``kernel_gpu_gmm_ring``)
   instead of a pipeline per tile: the forward's default where a tile has at most 8 K steps
   (``GpuTiling.ring_k_steps``, small()'s K = 512), slower at 32 K steps and more.

``gmm_sum`` runs ``Σ_p lhs_p @ rhs_p`` (the split gate/up input gradient ``dg·W1ᵀ + du·W3ᵀ``) through
the ring, whose memory warpgroup switches operand pair between K steps: one accumulator, the K
steps of the product of the concatenated operands in their order, no concatenated copy.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe import kernel_gpu_base, kernel_gpu_tgmm
from pallas_kernels.moe.gmm_tiles import gmm_epilogue, half_or_full_wgmma
from pallas_kernels.moe.kernel_gpu_gmm_ring import gmm_ring_body
from pallas_kernels.moe.kernel_gpu_base import (  # noqa: F401  (GpuTiling: the public tiling type)
    _COMPUTE_WGS, GpuTiling, _swizzled,
)
from pallas_kernels.moe.kernel_gpu_tgmm import TGMM_CANDIDATES, tgmm  # noqa: F401  (one module per backend for ops.py)
from pallas_kernels.moe.schedule import aligned_tile_schedule, fits_half, tile_schedule

_STATE = plgpu.PipelinePipeline

# a tile of 8 K steps or fewer (small()'s routed experts: K = 512) through the slot ring: gate/up
# 0.490 against 0.541 ms, down 0.270 against 0.288 under a fresh router's groups, the train step
# 1.7397 against 1.7462 s; at 32 K steps (E = 128) the per-tile pipeline is faster, 0.293 against
# 0.315 ms (benchmarks/RESULTS.md, MoE run 21 and stop 44)
GMM_TILING = GpuTiling(ring_k_steps=8)
# the input gradient (``transpose_rhs``) contracts over N and writes K: its own tiling
GMM_TILING_T = GpuTiling()
# ``gmm_sum`` (the split gate/up input gradient ``dg·W1ᵀ + du·W3ᵀ``): the slot ring, whose memory
# warpgroup switches operand pairs between K steps (the per-tile pipeline streams one pair); half
# tiles: 8.88 against 9.06 ms at K3's dlhs shape (benchmarks/RESULTS.md "Stop 37", bench_gmm_sum.py)
GMM_SUM_TILING = GpuTiling(ring=True, half_tiles=True)


def required_multiple() -> int:
    """K and N must be multiples of this (K, N swap roles between gmm, dlhs and tgmm)."""
    g, d, s, t = GMM_TILING, GMM_TILING_T, GMM_SUM_TILING, kernel_gpu_tgmm.TGMM_TILING
    return math.lcm(g.tile_k, g.cta_n(), d.tile_k, d.cta_n(), s.tile_k, s.cta_n(), t.tile_k, t.cta_n())


def m_tile_schedule(group_sizes: jax.Array, m: int, tile_m: int) -> jax.Array:
    """Work tiles of ``gmm`` (see ``schedule.tile_schedule``); group ``E`` is the zero tail."""
    return tile_schedule(group_sizes, m, tile_m, tail=True, empty_tiles=False)


def _b_alloc_view(rhs_gmem, cta_n, transpose_rhs):
    cols = pl.ds(0, cta_n)
    return rhs_gmem.at[0, cols] if transpose_rhs else rhs_gmem.at[0, :, cols]


def _gmm_pipeline(cfg, k, dtype, transpose_rhs, body, compute_context, block=0, state=None, delay_release=0):
    """K-loop of one gmm tile; aligned tiles pass a per-tile lhs view and block 0. With
    ``cluster_n`` the lhs block is multicast to the cluster's two CTAs (same rows, next N tiles).
    ``state``: this tile's ``PipelinePipeline`` place in a chain of tiles (``chain_tiles``).
    ``delay_release``: a step's slots are released that many steps late (``body`` then waits for
    all but that many wgmmas; not with ``state``; ``head_ce.kernel_gpu``'s ``overlap_wgmma``)."""
    tm, tk, cta_n = cfg.tile_m, cfg.tile_k, cfg.cta_n()
    b_block = (cta_n, tk) if transpose_rhs else (tk, cta_n)
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(k // tk,),
        memory_registers=40,
        in_specs=[
            # block-indexed over the whole lhs (unaligned mode): TMA zero-fills rows past M
            plgpu.BlockSpec((tm, tk), lambda kk: (block, kk), transforms=_swizzled(tk, dtype),
                            collective_axes=("cluster",) if cfg.cluster_n else (), delay_release=delay_release),
            plgpu.BlockSpec(
                b_block,
                (lambda kk: (0, kk)) if transpose_rhs else (lambda kk: (kk, 0)),
                transforms=_swizzled(b_block[1], dtype),
                delay_release=delay_release,
            ),
        ],
        wg_axis="wg",
        num_compute_wgs=_COMPUTE_WGS,
        max_concurrent_steps=cfg.stages,
        compute_context=compute_context,
        pipeline_state=state,
    )


def _chain_state(info):
    """A chained tile's pipeline state: START on a CTA's first tile, STOP on its last, else
    STEADY (a CTA with a single tile runs an unchained pipeline: see ``_gmm_body``)."""
    later = jnp.where(info.local_index == info.num_local_steps - 1, _STATE.STOP, _STATE.STEADY)
    return jnp.where(info.local_index == 0, _STATE.START, later)


def _gmm_body(meta, num_active, lhs_gmem, rhs_gmem, out_gmem, *, cfg, m, k, n, transpose_rhs):
    tm, tn = cfg.tile_m, cfg.tile_n
    cta_n = cfg.cta_n()
    pair = 2 if cfg.cluster_n else 1  # CTAs of a cluster: the same rows, adjacent N tiles
    # chained: the loop visits active work tiles only, so each CTA's last visit is a real tile
    n_work, grid_n = num_active[0] if cfg.chain_tiles else meta.shape[1], n // cta_n // pair
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
            if cfg.cluster_n:
                ni = pair * ni + lax.axis_index("cluster")
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
                    gmm_epilogue(acc, o_smem.at[wg], out_gmem, is_tail, row0, lo, count, out_cols, min(tm, m))

            def mma(_, a_smem, b_smem, acc):
                b = b_smem.at[wg_n].T if transpose_rhs else b_smem.at[:, wg_n]
                if cfg.half_tiles:
                    half_or_full_wgmma(acc, a_smem, b, fits_half(lo, count, tm))
                else:
                    plgpu.wgmma(acc, a_smem, b)
                # a slot is released when the body returns, and the warp-specialised pipeline
                # does not guard a delayed release across calls: finish the wgmma here (the
                # other compute warpgroup keeps the tensor cores busy meanwhile)
                plgpu.wgmma_wait(0)
                return acc

            n_cols = pl.ds(ni * cta_n, cta_n)
            b_view = rhs_gmem.at[g, n_cols] if transpose_rhs else rhs_gmem.at[g, :, n_cols]

            def run(state):
                if cfg.aligned:
                    pipeline(mma, compute_context, state=state)(
                        lhs_gmem.at[pl.ds(row0, tm)], b_view, allocations=allocs)
                else:
                    pipeline(mma, compute_context, block, state=state)(lhs_gmem, b_view, allocations=allocs)

            if cfg.chain_tiles:
                pl.when(info.num_local_steps == 1)(lambda: run(None))
                pl.when(info.num_local_steps > 1)(lambda: run(_chain_state(info)))
            else:
                pl.when(grp >= 0)(lambda: run(None))

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _check_tiling(cfg: GpuTiling, k: int, n: int) -> None:
    if k % cfg.tile_k or n % cfg.cta_n():
        raise ValueError(f"K={k} must divide by tile_k={cfg.tile_k} and N={n} by {cfg.cta_n()}")
    if cfg.half_tiles and cfg.tile_m % 128:  # wgmma issues rows in groups of 64
        raise ValueError(f"tiling.tile_m must be a multiple of 128 with half_tiles, got {cfg.tile_m}")
    if cfg.chain_tiles and (k // cfg.tile_k) % cfg.stages:
        raise ValueError(f"tiling.chain_tiles needs K/tile_k a multiple of stages, got {k}/{cfg.tile_k} "
                         f"and stages={cfg.stages}")
    if cfg.ring and (cfg.chain_tiles or cfg.cluster_n or cfg.stages < 2):
        raise ValueError(f"tiling.ring needs chain_tiles=False, cluster_n=False and stages >= 2, got "
                         f"chain_tiles={cfg.chain_tiles}, cluster_n={cfg.cluster_n}, stages={cfg.stages}")
    if cfg.cluster_n and (n // cfg.cta_n()) % 2:
        raise ValueError(f"tiling.cluster_n needs an even number of N tiles, got N/{cfg.cta_n()}={n // cfg.cta_n()}")


def _run(body, cfg, group_sizes, lhss, rhss, n, name, interpret, **static):
    """``body`` over ``gmm``'s work tiles of ``lhss[0]``'s rows, given ``lhs_0, rhs_0, lhs_1, ...``."""
    m = m_run = lhss[0].shape[0]
    if cfg.aligned:  # tiles start at multiples of 8 and never run past the (padded) rows
        m_run, *lhss = kernel_gpu_base.pad_rows_for_aligned(cfg.tile_m, *lhss)
        meta = aligned_tile_schedule(group_sizes, m_run, cfg.tile_m)
    else:
        meta = m_tile_schedule(group_sizes, m, cfg.tile_m)
    out = kernel_gpu_base.persistent_kernel(
        functools.partial(body, cfg=cfg, m=m_run, n=n, **static), jax.ShapeDtypeStruct((m_run, n), lhss[0].dtype),
        interpret=interpret, name=name, cluster=2 if cfg.cluster_n else 1,
    )(meta, jnp.sum(meta[0] >= 0, dtype=jnp.int32)[None], *(x for pair in zip(lhss, rhss) for x in pair))
    return out[:m] if m_run != m else out


# Jitted so that every call with the same shapes reuses one traced jaxpr, which JAX lowers once per
# module: identical layers (and their remat recomputes) then share one Mosaic GPU kernel, compiled once.
@functools.partial(jax.jit, static_argnames=("transpose_rhs", "tiling", "interpret"))
def gmm(lhs, rhs, group_sizes, *, transpose_rhs=False, tiling=None, interpret=False):
    """``lhs [M,K]``, ``rhs [E,K,N]`` (``[E,N,K]`` read transposed when ``transpose_rhs``)."""
    k = lhs.shape[1]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    cfg = tiling or (GMM_TILING_T if transpose_rhs else GMM_TILING)
    if k // cfg.tile_k <= cfg.ring_k_steps:
        cfg = dataclasses.replace(cfg, ring=True)
    _check_tiling(cfg, k, n)
    name = ("moe_gmm_transposed" if transpose_rhs else "moe_gmm") + ("_ring" if cfg.ring else "")
    return _run(gmm_ring_body if cfg.ring else _gmm_body, cfg, group_sizes, [lhs], [rhs], n, name, interpret,
                k=k, transpose_rhs=transpose_rhs)


@functools.partial(jax.jit, static_argnames=("transpose_rhs", "tiling", "interpret"))
def gmm_sum(lhss, rhss, group_sizes, *, transpose_rhs=False, tiling=None, interpret=False):
    """``Σ_p gmm(lhss[p], rhss[p])`` in one float32 accumulator per tile, rounded once: a tile's K
    steps run over pair 0's K, then pair 1's, ..., so the result is ``gmm`` of the operands
    concatenated along K (``lhss`` on axis 1, ``rhss`` on their K axis) bit for bit, without the
    copies, where every pair's K divides by ``tile_k``. ``lhss[p] [M,K_p]``, ``rhss[p] [E,K_p,N]``
    (``[E,N,K_p]`` with ``transpose_rhs``); runs ``kernel_gpu_gmm_ring`` (``tiling.ring`` must be set)."""
    if not lhss or len(lhss) != len(rhss):
        raise ValueError(f"lhss and rhss must be equally long and nonempty, got {len(lhss)} and {len(rhss)}")
    cfg = tiling or GMM_SUM_TILING
    if not cfg.ring:
        raise ValueError(f"gmm_sum runs the slot-ring body: tiling.ring must be True, got {cfg}")
    k_axis, n_axis = (2, 1) if transpose_rhs else (1, 2)
    m, n, e = lhss[0].shape[0], rhss[0].shape[n_axis], rhss[0].shape[0]
    for p, (lhs, rhs) in enumerate(zip(lhss, rhss)):
        if lhs.shape[0] != m or lhs.dtype != lhss[0].dtype or rhs.dtype != lhss[0].dtype:
            raise ValueError(f"lhss[{p}] must have {m} rows and every operand dtype {lhss[0].dtype}, got "
                             f"{lhs.shape} {lhs.dtype} and rhss[{p}] {rhs.dtype}")
        if rhs.ndim != 3 or rhs.shape[0] != e or rhs.shape[n_axis] != n or rhs.shape[k_axis] != lhs.shape[1]:
            raise ValueError(f"rhss[{p}] must have {e} groups, N={n} and K=lhss[{p}].shape[1]={lhs.shape[1]} "
                             f"(transpose_rhs={transpose_rhs}), got {rhs.shape}")
        _check_tiling(cfg, lhs.shape[1], n)
    ks = tuple(lhs.shape[1] for lhs in lhss)
    name = "moe_gmm_sum_transposed" if transpose_rhs else "moe_gmm_sum"
    return _run(gmm_ring_body, cfg, group_sizes, list(lhss), list(rhss), n, name, interpret,
                k=ks, transpose_rhs=transpose_rhs)
