"""Row blocks of the per-group ``tgmm`` kernels (``kernel_gpu_tgmm``, ``kernel_gpu_tgmm_ring``): which
rows of ``lhs`` and ``dout`` a group's row block covers, and the masked, trimmed wgmma over them."""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import int_ops


def group_rows(group_sizes: jax.Array, tile_m: int, aligned: bool) -> jax.Array:
    """Per group: int32 ``[3, E]`` rows = (start row, end row, number of row blocks); ``aligned``
    blocks start at the group's first row rounded down to 8, the others at multiples of ``tile_m``."""
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    spanned = int_ops.cdiv(ends - starts // 8 * 8, tile_m) if aligned else (ends - 1) // tile_m - starts // tile_m + 1
    blocks = jnp.where(group_sizes > 0, spanned, 0)
    return jnp.stack([starts, ends, blocks]).astype(jnp.int32)


def block_rows(cfg, m, i, start):
    """(first row of row block ``i`` of the group whose rows start at ``start``, the first of the
    group's rows in that block); ``aligned`` blocks start at ``start`` rounded down to 8, the last
    one clamped to end at row ``m`` at most."""
    tm = cfg.tile_m
    if cfg.aligned:
        own = start // 8 * 8 + i * tm
        return pl.multiple_of(jnp.minimum(own, m - tm), 8), jnp.maximum(start, own)
    row0 = (start // tm + i) * tm
    return row0, jnp.maximum(start, row0)


def mask_rows(ref, lo, hi):
    """Zero the rows of a ``[rows, cols]`` shared-memory tile outside ``[lo, hi)``."""
    rows = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, ref.shape, 0), plgpu.Layout.WGMMA)
    keep = (rows >= lo) & (rows < hi)
    ref[...] = jnp.where(keep, ref[...], jnp.zeros((), ref.dtype))
    plgpu.commit_smem()


def k_group_rows(cfg, dtype) -> int:
    """Rows per wgmma K group of tgmm's operands: the contraction runs over rows, and Mosaic GPU
    issues a wgmma's K in whole groups of the operands' swizzle width (64 bf16 rows at 128 bytes)."""
    item = jnp.dtype(dtype).itemsize
    return max(cfg.swizzle_bytes or plgpu.find_swizzle(d * item * 8) for d in (cfg.tile_k, cfg.cta_n())) // item


def wgmma_rows(cfg, acc, a_smem, b, lo, hi):
    """``acc += a_smemᵀ @ b`` over rows ``[lo, hi)`` of the block (the others are zero in ``b``):
    with ``trim_rows``, over the K groups that hold those rows only; a static branch per
    (first group, end group) pair, as a wgmma's K is static. No rows: no wgmma."""
    if not cfg.trim_rows:
        plgpu.wgmma(acc, a_smem.T, b)
        return
    tm, group = cfg.tile_m, k_group_rows(cfg, a_smem.dtype)
    first = jnp.clip(lo, 0, tm) // group
    end = (jnp.clip(hi, 0, tm) + group - 1) // group
    for g0 in range(tm // group):
        for g1 in range(g0 + 1, tm // group + 1):
            rows = pl.ds(g0 * group, (g1 - g0) * group)
            pl.when((first == g0) & (end == g1))(lambda rows=rows: plgpu.wgmma(acc, a_smem.at[rows].T, b.at[rows]))
