"""Grouped matmuls for TPU in Pallas TPU (megablox-style): ``gmm`` and ``tgmm``.

Same contracts as ``kernel_gpu``. The work-tile schedule (``schedule.tile_schedule``) is
scalar-prefetched into SMEM and drives the block index maps:

``gmm``  grid (N tile, work tile, K step). A work tile accumulates its row block times its
         group's weight panel in a float32 VMEM scratch, then merges its own rows into the
         output block. Work tiles of one row block are consecutive, so the output block stays
         resident in VMEM between them and is written back once, with every row set.
``tgmm`` grid (K tile, N tile, work tile). The work tiles of one group are consecutive and
         reduce into one float32 scratch; rows of other groups (and padding past M) in a
         boundary block are zeroed before the product; the group's last tile (or its single empty tile) stores.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.moe.schedule import BLOCK, COUNT, GROUP, INDEX_GROUP, LO, tile_schedule


@dataclasses.dataclass(frozen=True)
class TpuTiling:
    """Block sizes: rows ``tile_m`` (multiple of 16 for bf16), ``tile_k``/``tile_n`` (of 128)."""

    tile_m: int = 128
    tile_k: int = 128
    tile_n: int = 128


GMM_TILING = TpuTiling()
TGMM_TILING = TpuTiling()


def required_multiple() -> int:
    """K and N must be multiples of this (``ops`` zero-pads up to it)."""
    return max(GMM_TILING.tile_k, GMM_TILING.tile_n, TGMM_TILING.tile_k, TGMM_TILING.tile_n)


def _interpret_arg(interpret: bool):
    return pltpu.InterpretParams() if interpret else False


def _row_mask(shape, lo, count):
    rows = lax.broadcasted_iota(jnp.int32, shape, 0)
    return (rows >= lo) & (rows < lo + count)


def _flat(meta):
    """The schedule ``[5, W]`` as one row ``[5·W]``: SMEM pads a 2-D operand's 5 rows to 8 (32 bytes
    per work tile, 1 MiB at ~4.2 M rows); flat it takes 20 bytes a tile."""
    return meta.reshape(-1)


def _at(meta, field, w, tiles: int):
    return meta[field * tiles + w]


def _gmm_kernel(meta, lhs_ref, rhs_ref, out_ref, acc_ref, *, num_groups, transpose_rhs):
    w, kk = pl.program_id(1), pl.program_id(2)
    tiles = pl.num_programs(1)
    grp, lo, count = _at(meta, GROUP, w, tiles), _at(meta, LO, w, tiles), _at(meta, COUNT, w, tiles)

    @pl.when(kk == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when((count > 0) & (grp < num_groups))
    def _():
        dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))
        acc_ref[...] += lax.dot_general(
            lhs_ref[...], rhs_ref[...], dims, preferred_element_type=jnp.float32
        )

    @pl.when((kk == pl.num_programs(2) - 1) & (count > 0))
    def _():
        mask = _row_mask(out_ref.shape, lo, count)
        out_ref[...] = jnp.where(mask, acc_ref[...].astype(out_ref.dtype), out_ref[...])


def gmm(lhs, rhs, group_sizes, *, transpose_rhs=False, tiling=None, interpret=False):
    """``lhs [M,K]``, ``rhs [E,K,N]`` (``[E,N,K]`` read transposed when ``transpose_rhs``)."""
    cfg = tiling or GMM_TILING
    m, k = lhs.shape
    e = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tm, tk, tn = cfg.tile_m, cfg.tile_k, cfg.tile_n
    if k % tk or n % tn:
        raise ValueError(f"K={k} must divide by tile_k={tk} and N={n} by tile_n={tn}")
    meta = tile_schedule(group_sizes, m, tm, tail=True, empty_tiles=False)
    tiles = meta.shape[1]
    rhs_block = (None, tn, tk) if transpose_rhs else (None, tk, tn)
    rhs_index = (
        (lambda j, w, kk, s: (_at(s, INDEX_GROUP, w, tiles), j, kk))
        if transpose_rhs
        else (lambda j, w, kk, s: (_at(s, INDEX_GROUP, w, tiles), kk, j))
    )
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(n // tn, meta.shape[1], k // tk),
        in_specs=[
            pl.BlockSpec((tm, tk), lambda j, w, kk, s: (_at(s, BLOCK, w, tiles), kk)),
            pl.BlockSpec(rhs_block, rhs_index),
        ],
        out_specs=pl.BlockSpec((tm, tn), lambda j, w, kk, s: (_at(s, BLOCK, w, tiles), j)),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
    )
    kernel = functools.partial(_gmm_kernel, num_groups=e, transpose_rhs=transpose_rhs)
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((m, n), lhs.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=_interpret_arg(interpret),
        name="moe_gmm_tpu_transposed" if transpose_rhs else "moe_gmm_tpu",
    )(_flat(meta), lhs, rhs)


def gmm_sum(lhss, rhss, group_sizes, *, transpose_rhs=False, tiling=None, interpret=False):
    """``Σ_p gmm(lhss[p], rhss[p])`` as ``kernel_gpu.gmm_sum``; here one ``gmm`` of the operands
    concatenated along K (XLA copies them: no two-pair TPU kernel yet)."""
    k_axis = 2 if transpose_rhs else 1
    return gmm(jnp.concatenate(lhss, axis=1), jnp.concatenate(rhss, axis=k_axis), group_sizes,
               transpose_rhs=transpose_rhs, tiling=tiling, interpret=interpret)


def _tgmm_kernel(meta, lhs_ref, dout_ref, out_ref, acc_ref):
    w = pl.program_id(2)
    tiles = pl.num_programs(2)
    last_w = tiles - 1
    grp, lo, count = _at(meta, GROUP, w, tiles), _at(meta, LO, w, tiles), _at(meta, COUNT, w, tiles)
    prev = _at(meta, GROUP, jnp.maximum(w - 1, 0), tiles)
    nxt = _at(meta, GROUP, jnp.minimum(w + 1, last_w), tiles)
    first_of_group = (w == 0) | (prev != grp)
    last_of_group = (w == last_w) | (nxt != grp)

    @pl.when((grp >= 0) & first_of_group)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(count > 0)
    def _():
        # both operands: rows past M in a partial block are padding of any value (NaN too)
        zero = jnp.zeros((), lhs_ref.dtype)
        lhs = jnp.where(_row_mask(lhs_ref.shape, lo, count), lhs_ref[...], zero)
        dout = jnp.where(_row_mask(dout_ref.shape, lo, count), dout_ref[...], zero)
        acc_ref[...] += lax.dot_general(lhs, dout, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    @pl.when((grp >= 0) & last_of_group)
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def tgmm(lhs, dout, group_sizes, *, num_groups, tiling=None, interpret=False):
    """``out[e] = lhs[rows of e]ᵀ @ dout[rows of e]``: ``[M,K] × [M,N] -> [E,K,N]`` in ``lhs.dtype``."""
    cfg = tiling or TGMM_TILING
    m, k = lhs.shape
    n = dout.shape[1]
    tm, tk, tn = cfg.tile_m, cfg.tile_k, cfg.tile_n
    if k % tk or n % tn:
        raise ValueError(f"K={k} must divide by tile_k={tk} and N={n} by tile_n={tn}")
    if group_sizes.shape != (num_groups,):
        raise ValueError(f"group_sizes must have shape ({num_groups},), got {group_sizes.shape}")
    meta = tile_schedule(group_sizes, m, tm, tail=False, empty_tiles=True)
    tiles = meta.shape[1]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(k // tk, n // tn, meta.shape[1]),
        in_specs=[
            pl.BlockSpec((tm, tk), lambda i, j, w, s: (_at(s, BLOCK, w, tiles), i)),
            pl.BlockSpec((tm, tn), lambda i, j, w, s: (_at(s, BLOCK, w, tiles), j)),
        ],
        out_specs=pl.BlockSpec((None, tk, tn), lambda i, j, w, s: (_at(s, INDEX_GROUP, w, tiles), i, j)),
        scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)],
    )
    return pl.pallas_call(
        _tgmm_kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((num_groups, k, n), lhs.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=_interpret_arg(interpret),
        name="moe_tgmm_tpu",
    )(_flat(meta), lhs, dout)
