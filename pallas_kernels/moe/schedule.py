"""Work-tile schedules shared by the grouped-matmul kernels (computed in XLA, read by kernels).

Rows are sorted by group; a row block of ``tile_m`` rows that straddles group boundaries is
visited once per group owning a row of it, so every (group, block) pair is one work tile.
The schedule has a static length (an upper bound); tiles past the real count are inactive.
"""

import jax
import jax.numpy as jnp

from pallas_kernels import int_ops

# rows of the schedule array
GROUP, BLOCK, LO, COUNT, INDEX_GROUP = range(5)


def tile_schedule(group_sizes: jax.Array, m: int, tile_m: int, *, tail: bool, empty_tiles: bool) -> jax.Array:
    """int32 ``[5, W]``: per work tile (group, row block, first row inside the block, row
    count, group to index weights with).

    ``tail``: rows past ``sum(group_sizes)`` form a pseudo-group ``E`` (the forward stores
    zeros there). ``empty_tiles``: an empty group still gets one tile with no rows (the
    weight gradient must write its zeros). Inactive tiles have group ``-1``, no rows, and
    repeat the last active tile's block and index group, so a kernel that keeps an output
    block resident while its index is unchanged never writes elsewhere.
    """
    e = group_sizes.shape[0]
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    if tail:
        starts = jnp.concatenate([starts, ends[-1:]])
        ends = jnp.concatenate([ends, jnp.full((1,), m, ends.dtype)])
    num_blocks = int_ops.cdiv(m, tile_m)
    first = jnp.minimum(starts // tile_m, num_blocks - 1)
    nonempty = ends > starts
    counts = jnp.where(nonempty, (ends - 1) // tile_m - first + 1, 1 if empty_tiles else 0)
    bound = num_blocks + e + (e if empty_tiles else 0)
    cum = jnp.cumsum(counts)
    i = jnp.arange(bound, dtype=jnp.int32)
    active = i < cum[-1]
    last = jnp.maximum(cum[-1] - 1, 0)
    j = jnp.where(active, i, last)
    # compare_all: one fused kernel; the default binary search is a while loop, whose
    # predicate the GPU runtime reads back on the host every iteration
    grp = jnp.searchsorted(cum, j, side="right", method="compare_all")
    grp = jnp.minimum(grp, starts.shape[0] - 1).astype(jnp.int32)
    block = first[grp] + j - (cum[grp] - counts[grp])
    lo = jnp.clip(starts[grp] - block * tile_m, 0, tile_m)
    hi = jnp.clip(ends[grp] - block * tile_m, 0, tile_m)
    count = jnp.where(active & nonempty[grp], hi - lo, 0)
    return jnp.stack(
        [jnp.where(active, grp, -1), block, lo, count, jnp.minimum(grp, e - 1)]
    ).astype(jnp.int32)


def aligned_tile_schedule(group_sizes: jax.Array, m: int, tile_m: int, align: int = 8) -> jax.Array:
    """Work tiles that start at their group's first row (rounded down to ``align``) instead of
    at a multiple of ``tile_m``: a group of ``s`` rows takes ``ceil((s + start % align) / tile_m)``
    tiles, about half the boundary waste of ``tile_schedule``. Same rows as ``tile_schedule``
    with BLOCK replaced by the tile's first row (clamped to ``m - tile_m``, so no tile reads
    past M; needs ``m >= tile_m`` and ``m % align == 0``). Rows past the groups form group E.
    """
    e = group_sizes.shape[0]
    ends = jnp.cumsum(group_sizes)
    starts = jnp.concatenate([ends - group_sizes, ends[-1:]])
    ends = jnp.concatenate([ends, jnp.full((1,), m, ends.dtype)])
    base = starts - starts % align
    counts = jnp.where(ends > starts, int_ops.cdiv(ends - base, tile_m), 0)
    bound = int_ops.cdiv(m + (e + 1) * (tile_m + align), tile_m)
    cum = jnp.cumsum(counts)
    i = jnp.arange(bound, dtype=jnp.int32)
    active = i < cum[-1]
    j = jnp.where(active, i, jnp.maximum(cum[-1] - 1, 0))
    # compare_all: one fused kernel; the default binary search is a while loop, whose
    # predicate the GPU runtime reads back on the host every iteration
    grp = jnp.searchsorted(cum, j, side="right", method="compare_all")
    grp = jnp.minimum(grp, e).astype(jnp.int32)
    tile_start = base[grp] + (j - (cum[grp] - counts[grp])) * tile_m
    row0 = jnp.minimum(tile_start, m - tile_m)
    lo = jnp.maximum(starts[grp], tile_start) - row0
    hi = jnp.minimum(ends[grp], tile_start + tile_m) - row0
    count = jnp.where(active, jnp.maximum(hi - lo, 0), 0)
    return jnp.stack(
        [jnp.where(active, grp, -1), row0, lo, count, jnp.minimum(grp, e - 1)]
    ).astype(jnp.int32)


def fits_half(lo, count, tile_m: int):
    """True where a work tile's rows ``[lo, lo + count)`` all lie in its first ``tile_m / 2``
    rows: ``gmm`` with ``half_tiles`` then issues its wgmmas on those rows only."""
    return lo + count <= tile_m // 2


def issued_rows(meta: jax.Array, tile_m: int, half_tiles: bool) -> jax.Array:
    """Rows per active work tile that ``gmm``'s wgmmas compute (inactive tiles issue none);
    the issued FLOPs of one gmm are ``2 · K · N · sum(issued_rows)``."""
    rows = jnp.full(meta.shape[1], tile_m, jnp.int32)
    if half_tiles:
        rows = jnp.where(fits_half(meta[LO], meta[COUNT], tile_m), tile_m // 2, rows)
    return jnp.where(meta[GROUP] >= 0, rows, 0)
