"""Grouped matmul as a loop over (row tile, expert) work items, in plain JAX: the CPU path.

XLA's CPU backend expands ``jax.lax.ragged_dot`` into a dense product with every group and a
mask: ``E`` times the FLOPs (measured: M,K,N,E = 16384,512,512,64 costs 552 GFLOP instead of
8.6 and runs 59x slower than one plain matmul of the same rows). Here the rows, already sorted by
group, are cut into tiles of ``tile`` rows; a tile that straddles group boundaries becomes one
work item per group it touches, as in megablox (Gale et al., arXiv 2211.15841, §5.1). The
schedule has a static length ``ceil(M / tile) + E - 1``, so the loop is a ``lax.scan`` with
``(tile + E·tile / M)`` rows of matmul work per row instead of ``E``.

Gradients are custom (``jax.custom_vjp``) and use the same schedule: ``dlhs`` is the grouped
product with each expert's transposed weight; ``drhs[e]`` accumulates ``x_tileᵀ (dy_tile ·
mask)`` over the items of expert ``e``, so autodiff never stores a per-item weight copy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, ArrayLike, Float, Int

from pallas_kernels.moe.reference import accum_dtype, group_ids

TILE = 128


def schedule(group_sizes: Int[Array, "E"], m: int, tile: int):
    """``(item_tile, item_expert, item_valid)`` of length ``ceil(m/tile) + E - 1``, plus the row groups.

    Tile ``t`` yields one item per group from the group of its first row to that of its last
    (groups past the last one, i.e. rows in no group, are clipped away by ``item_valid``'s mask
    in the loop body). Items past the total are marked invalid.
    """
    e = group_sizes.shape[0]
    tiles = -(-m // tile)
    rows = group_ids(group_sizes, tiles * tile)  # [tiles*tile], e for rows in no group
    first = jnp.minimum(rows[::tile], e - 1)
    last = jnp.minimum(rows[tile - 1 :: tile], e - 1)
    counts = last - first + 1
    ends = jnp.cumsum(counts)
    n_items = tiles + e - 1
    idx = jnp.arange(n_items)
    item_tile = jnp.searchsorted(ends, idx, side="right").astype(jnp.int32)
    valid = item_tile < tiles
    item_tile = jnp.minimum(item_tile, tiles - 1)
    item_expert = (first[item_tile] + idx - (ends - counts)[item_tile]).astype(jnp.int32)
    return item_tile, jnp.minimum(item_expert, e - 1), valid, rows


def _tile_loop(body, init, sched, tile):
    item_tile, item_expert, valid, rows = sched

    def step(acc, item):
        t, ex, ok = item
        start = (t * tile).astype(jnp.int32)
        mask = (lax.dynamic_slice(rows, (start,), (tile,)) == ex) & ok
        return body(acc, (start, jnp.zeros_like(start)), ex, mask), None

    return lax.scan(step, init, (item_tile, item_expert, valid))[0]


def _gmm(lhs, rhs, sched, tile, transpose_rhs=False):
    """``out[rows of group e] = lhs[rows] @ rhs[e]`` (``rhs[e]ᵀ`` when ``transpose_rhs``), fp32 accumulation."""
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    dt = accum_dtype(lhs.dtype)
    padded = jnp.pad(lhs, [(0, -m % tile), (0, 0)])
    dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))

    def body(out, at, ex, mask):
        x = lax.dynamic_slice(padded, at, (tile, k))
        y = lax.dot_general(x, rhs[ex], dims, preferred_element_type=dt)
        cur = lax.dynamic_slice(out, at, (tile, n))
        return lax.dynamic_update_slice(out, cur + jnp.where(mask[:, None], y, 0), at)

    out = _tile_loop(body, jnp.zeros((padded.shape[0], n), dt), sched, tile)
    return out[:m]


def _tgmm(lhs, dout, sched, tile, e):
    """``drhs[e] = Σ_items lhs_tileᵀ (dout_tile · mask)``: ``[E, K, N]`` in fp32."""
    m, k = lhs.shape
    n = dout.shape[1]
    pad = [(0, -m % tile), (0, 0)]
    lhs, dout = jnp.pad(lhs, pad), jnp.pad(dout, pad)
    dt = accum_dtype(lhs.dtype)

    def body(acc, at, ex, mask):
        x = lax.dynamic_slice(lhs, at, (tile, k))
        dy = jnp.where(mask[:, None], lax.dynamic_slice(dout, at, (tile, n)), 0)
        upd = lax.dot_general(x, dy, (((0,), (0,)), ((), ())), preferred_element_type=dt)
        return acc.at[ex].add(upd)

    return _tile_loop(body, jnp.zeros((e, k, n), dt), sched, tile)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped(lhs, rhs, group_sizes, tile):
    sched = schedule(group_sizes, lhs.shape[0], tile)
    return _gmm(lhs, rhs, sched, tile).astype(lhs.dtype)


def _grouped_fwd(lhs, rhs, group_sizes, tile):
    return _grouped(lhs, rhs, group_sizes, tile), (lhs, rhs, group_sizes)


def _grouped_bwd(tile, res, g):
    lhs, rhs, group_sizes = res
    sched = schedule(group_sizes, lhs.shape[0], tile)
    g = g.astype(lhs.dtype)
    dlhs = _gmm(g, rhs, sched, tile, transpose_rhs=True).astype(lhs.dtype)
    drhs = _tgmm(lhs, g, sched, tile, rhs.shape[0]).astype(rhs.dtype)
    return dlhs, drhs, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def grouped_matmul_tiled(
    lhs: Float[Array, "M K"], rhs: Float[Array, "E K N"], group_sizes: Int[ArrayLike, "E"], *, tile: int = TILE
) -> Float[Array, "M N"]:
    """``jax.lax.ragged_dot`` semantics (rows past ``sum(group_sizes)`` are zero) by a tile loop.

    ``tile`` rows per work item (smaller when ``M`` is smaller). Accumulates in >= float32;
    output in ``lhs.dtype``. Differentiable w.r.t. ``lhs`` and ``rhs``.
    """
    if tile < 1:
        raise ValueError(f"tile must be a positive number of rows, got {tile}")
    tile = min(tile, max(8, -(-lhs.shape[0] // 8) * 8))
    return _grouped(lhs, rhs, jnp.asarray(group_sizes, jnp.int32), tile)
