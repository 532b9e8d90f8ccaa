"""Greedy decoding's output head on Hopper in Pallas Mosaic GPU: TMA streams of ``W [D, V]`` into ``wgmma``,
each vocabulary tile's row max and its lowest id, no logits stored.

``kernel_gpu.greedy_head`` (Pallas-Triton) streams small()'s 335 MB head at ~2.4 TB/s on an H100 (139.8 µs at 64
rows; ``benchmarks/RESULTS.md``, stop 69), where the TMA ring kernels of the dense expert path stream their
weights at ~3.3 TB/s past ~6 µs of fixed cost (stop 65's ``bench_chain.py``: 8.4 µs for 8.4 MB, 15.9 for 33.6).
This kernel is that ring (``kernel_gpu_decode_dense_tma``'s pattern, ``moe.slot_ring``): a persistent CTA a
SM walks ``2·tile_n``-column tiles of the head; its memory warpgroup copies each step's ``[tile_k, 2·tile_n]``
head slab and the rows' ``[64, tile_k]`` slab (L2-resident) into a ring of ``stages`` slots; each compute
warpgroup accumulates ``tile_n`` columns in float32 and keeps of them each row's largest logit and that
logit's lowest column, TMA-stored as row ``tile`` of ``pmax`` / ``pidx`` ``[V / tile_n, 64]``.
``reference.combine_partials`` (one XLA reduction) picks each row's token.

The logits are the model's (16-bit products summed in float32); only the summation order differs from
XLA's GEMM. Rows are padded to 64 (one ``wgmma`` row group). Ids are carried as float32 in the kernel
(exact below 2^24; checked). ``interpret=True`` runs the GPU interpreter on the CPU.
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

from pallas_kernels.head_argmax.reference import combine_partials
from pallas_kernels.moe import slot_ring
from pallas_kernels.moe.kernel_gpu_base import _COMPUTE_WGS, _swizzled, persistent_kernel

TOKEN_ROWS = 64
_16BIT = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class TmaHeadTiles:
    """``tile_n`` vocabulary columns a compute warpgroup (a CTA tile is ``2·tile_n``), ``tile_k`` head rows a
    ring step, ``stages`` steps in flight."""

    tile_n: int = 64
    tile_k: int = 64
    stages: int = 8

    def cta_n(self) -> int:
        return _COMPUTE_WGS * self.tile_n


DEFAULT = TmaHeadTiles()
MIN_ROWS = 1  # A/B (stop 70): the rows from which decoding takes this kernel on a Hopper GPU


def pays(rows: int) -> bool:
    """Whether decoding takes this kernel for ``rows`` rows (``MIN_ROWS`` to ``TOKEN_ROWS``, on a Hopper GPU)."""
    return MIN_ROWS <= rows <= TOKEN_ROWS


def check_inputs(x, w, tiles: TmaHeadTiles = DEFAULT) -> None:
    """Raise ``ValueError`` naming the argument when the kernel cannot take these inputs."""
    if getattr(x, "ndim", 0) != 2 or not 1 <= x.shape[0] <= TOKEN_ROWS:
        raise ValueError(f"x must be [T, D] with 1 <= T <= {TOKEN_ROWS} rows, got shape {getattr(x, 'shape', None)}")
    D = x.shape[1]
    if getattr(w, "ndim", 0) != 2 or w.shape[0] != D:
        raise ValueError(f"w must be [D={D}, V] (the head as stored), got shape {getattr(w, 'shape', None)}")
    dtypes = {jnp.dtype(x.dtype), jnp.dtype(w.dtype)}
    if len(dtypes) != 1 or not dtypes <= set(_16BIT):
        raise ValueError(f"x and w must share one 16-bit float dtype, got {sorted(map(str, dtypes))}")
    if D % tiles.tile_k:
        raise ValueError(f"D={D} must be a multiple of tiles.tile_k={tiles.tile_k}")
    if w.shape[1] % tiles.cta_n() or w.shape[1] >= 1 << 24:
        raise ValueError(f"V={w.shape[1]} must be a multiple of 2·tiles.tile_n={tiles.cta_n()} and below 2^24")


def accepts(x, w, tiles: TmaHeadTiles = DEFAULT) -> bool:
    try:
        check_inputs(x, w, tiles)
    except ValueError:
        return False
    return True


def _row_best(acc, col0):
    """Each row's largest value of the ``[64, tn]`` accumulator and its lowest column (float32, + ``col0``)."""
    xr = acc[...]
    top = xr.max(axis=1)
    cols = plgpu.broadcasted_iota(jnp.int32, xr.shape, 1, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
    hit = xr == lax.broadcast_in_dim(top, xr.shape, [0])
    return top, col0 - jnp.where(hit, -cols, -float(1 << 24)).max(axis=1)


def _body(x_gmem, w_gmem, pmax_gmem, pidx_gmem, *, tiles: TmaHeadTiles):
    D, V = w_gmem.shape
    tn, tk, cta_n = tiles.tile_n, tiles.tile_k, tiles.cta_n()
    n_tiles, ksteps = V // cta_n, D // tk
    dtype = x_gmem.dtype

    def for_each_tile(per_tile):
        @plgpu.nd_loop((n_tiles,), collective_axes="sm", init_carry=jnp.int32(0))
        def _tiles(info, carry):
            per_tile(carry, info.index[0])
            return carry + ksteps

        return _tiles

    @slot_ring.scoped(tiles.stages, copies_per_step=2,
                      x_smem=plgpu.SMEM((tiles.stages, TOKEN_ROWS, tk), dtype, transforms=_swizzled(tk, dtype)),
                      w_smem=plgpu.SMEM((tiles.stages, tk, cta_n), dtype, transforms=_swizzled(cta_n, dtype)),
                      r_smem=plgpu.SMEM((_COMPUTE_WGS, 2, TOKEN_ROWS), jnp.float32))
    def _scope(ring, x_smem, w_smem, r_smem):
        def memory():
            def per_tile(step0, ni):
                @pl.loop(0, ksteps)
                def _(kk):
                    kcols = pl.ds(kk * tk, tk)
                    ring.load(step0 + kk, [(x_gmem.at[:, kcols], x_smem),
                                           (w_gmem.at[kcols, pl.ds(ni * cta_n, cta_n)], w_smem)])

            ring.drain(for_each_tile(per_tile))

        def compute(wg):
            def per_tile(step0, ni):
                def step(acc, kk):
                    slot = ring.take(step0 + kk)
                    plgpu.wgmma(acc, x_smem.at[slot], w_smem.at[slot, :, pl.ds(wg * tn, tn)])
                    ring.release_previous(step0 + kk, kk == 0)

                @functools.partial(pl.run_scoped, acc=plgpu.ACC((TOKEN_ROWS, tn), jnp.float32))
                def _acc(acc):
                    pl.loop(0, ksteps)(functools.partial(step, acc))
                    plgpu.wgmma_wait(0)
                    ring.release(step0 + ksteps - 1)
                    vt = ni * _COMPUTE_WGS + wg  # this warpgroup's vocabulary tile
                    top, idx = _row_best(acc, (vt * tn).astype(jnp.float32))
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's stores have read r_smem
                    r_smem[wg, 0] = top
                    r_smem[wg, 1] = idx
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(r_smem.at[wg, 0], pmax_gmem.at[vt])
                    plgpu.copy_smem_to_gmem(r_smem.at[wg, 1], pidx_gmem.at[vt])

            for_each_tile(per_tile)

        slot_ring.split_warpgroups(memory, compute)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def greedy_head(x: Float[Array, "T D"], w: Float[Array, "D V"], *, tiles: TmaHeadTiles = DEFAULT,
                interpret: bool = False) -> Int[Array, "T"]:
    """Each row's ``argmax_v (x · W)[v]`` (lowest id on ties), int32 ``[T]`` (``kernel_gpu.greedy_head``'s)."""
    check_inputs(x, w, tiles)
    T = x.shape[0]
    blocks = w.shape[1] // tiles.tile_n
    xp = jnp.pad(x, ((0, TOKEN_ROWS - T), (0, 0))) if T != TOKEN_ROWS else x
    part = jax.ShapeDtypeStruct((blocks, TOKEN_ROWS), jnp.float32)
    pmax, pidx = persistent_kernel(functools.partial(_body, tiles=tiles), (part, part), interpret=interpret,
                                   name="greedy_head_tma")(xp, w)
    return combine_partials(pmax, pidx.astype(jnp.int32))[:T]
