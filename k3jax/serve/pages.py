"""The device side of the serving cache: MLA latent pages, live KDA states per slot, KDA snapshots.

One ``PagedCache`` mirrors ``k3jax.infer.cache.Cache.layers`` (each scanned run's entry a tuple of
stacked caches, leading ``[repeats]`` axis), with per layer kind:

- MLA: ``MLAPages.pages [*layers, P, page, C]``: one pool of fixed-size pages of latent rows
  ``[RMSNorm(c_kv), k_r]``; a sequence is a row of page ids (its page table). Page 0 is the trash
  page: unused page-table entries point at it and padding rows are written into it.
- KDA: ``KDACache`` with ``num_slots + 1`` rows (the live state of each engine slot; the last row
  is a scratch slot that idle lanes read and write), and in ``snapshots`` a second ``KDACache``
  with one row per snapshot (the state at some cached position, SGLang's "mamba slot").

A model call gathers each lane's pages into a contiguous ``MLACache`` (length = pages · page, a
static bucket), runs ``Transformer.decode`` unchanged, and scatters only the new rows back into
their pages; KDA rows are gathered and scattered by slot id. The model code never sees pages.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from k3jax.config import ModelConfig
from k3jax.infer.cache import Cache, KDACache, MLACache, init_cache

TRASH_PAGE = 0  # never allocated: the target of unused page-table entries and padding rows


@flax.struct.dataclass
class MLAPages:
    pages: Float[Array, "*layers P page C"]


@flax.struct.dataclass
class PagedCache:
    layers: tuple  # per Cache.layers entry: KDACache (live slots) or MLAPages
    snapshots: tuple  # per entry: KDACache (one row per snapshot) or None for MLA layers


def _is_entry(x) -> bool:
    return isinstance(x, (KDACache, MLACache, MLAPages))


def _map(fn, *trees):
    return jax.tree.map(fn, *trees, is_leaf=lambda x: x is None or _is_entry(x))


def _rows(kda: KDACache, fn) -> KDACache:
    """``fn(leaf, axis)`` on each KDA leaf with the axis of its batch (slot / snapshot) rows."""
    return KDACache(state=fn(kda.state, kda.state.ndim - 4), conv=fn(kda.conv, kda.conv.ndim - 3))


def _at(axis: int, index):
    return (slice(None),) * axis + (index,)


def init_paged(cfg: ModelConfig, *, num_slots: int, num_pages: int, page_size: int, num_snapshots: int,
               dtype=None) -> PagedCache:
    """Zeroed pools: ``num_pages`` pages (page 0 the trash page), ``num_slots`` live KDA slots (+1
    scratch) and ``num_snapshots`` KDA snapshots, in the config's layer layout."""
    dtype = cfg.compute_dtype if dtype is None else jnp.dtype(dtype)
    shape = init_cache(cfg, 1, 1, dtype=dtype).layers

    def grow(kda: KDACache, rows: int) -> KDACache:
        return _rows(kda, lambda x, a: jnp.zeros(x.shape[:a] + (rows,) + x.shape[a + 1:], x.dtype))

    def live(c):
        if isinstance(c, KDACache):
            return grow(c, num_slots + 1)
        lead = c.latent.shape[:-3]
        return MLAPages(pages=jnp.zeros(lead + (num_pages, page_size, c.latent.shape[-1]), c.latent.dtype))

    snaps = _map(lambda c: grow(c, num_snapshots) if isinstance(c, KDACache) else None, shape)
    return PagedCache(layers=_map(live, shape), snapshots=snaps)


def page_bytes(paged: PagedCache) -> int:
    """Device bytes of one page over all MLA layers."""
    return sum(x.size // x.shape[-3] * x.dtype.itemsize for c in jax.tree.leaves(paged.layers, is_leaf=_is_entry)
               if isinstance(c, MLAPages) for x in [c.pages])


def snapshot_bytes(paged: PagedCache) -> int:
    """Device bytes of one KDA snapshot over all KDA layers (state and conv tail)."""
    total = 0
    for c in jax.tree.leaves(paged.snapshots, is_leaf=_is_entry):
        for x, a in ((c.state, c.state.ndim - 4), (c.conv, c.conv.ndim - 3)):
            total += x.size // x.shape[a] * x.dtype.itemsize
    return total


def gather(paged: PagedCache, slot_ids: Int[Array, "B"], page_table: Int[Array, "B N"],
           lengths: Int[Array, "B"]) -> Cache:
    """The contiguous ``Cache`` of the lanes: KDA rows ``slot_ids``, MLA rows from the lanes' pages."""
    def one(c):
        if isinstance(c, KDACache):
            return _rows(c, lambda x, a: jnp.take(x, slot_ids, axis=a))
        p = c.pages
        rows = jnp.take(p, page_table, axis=p.ndim - 3)  # [*layers, B, N, page, C]
        latent = rows.reshape(rows.shape[:-3] + (rows.shape[-3] * rows.shape[-2], rows.shape[-1]))
        return MLACache(latent=latent, lengths=jnp.broadcast_to(lengths, p.shape[:-3] + lengths.shape))
    return Cache(layers=_map(one, paged.layers), lengths=lengths)


def scatter(paged: PagedCache, cache: Cache, slot_ids: Int[Array, "B"], page_table: Int[Array, "B N"],
            lengths: Int[Array, "B"], num_new: Int[Array, "B"], width: int) -> PagedCache:
    """Write the lanes' new KDA states to their slots and their ``num_new`` new latent rows (at
    positions ``lengths ..``) into their pages; padding rows go to the trash page."""
    B, N = page_table.shape

    def one(old, new):
        if isinstance(old, KDACache):
            return KDACache(state=_put(old.state, new.state, old.state.ndim - 4, slot_ids),
                            conv=_put(old.conv, new.conv, old.conv.ndim - 3, slot_ids))
        p, latent = old.pages, new.latent  # latent [*layers, B, S, C]
        size = p.shape[-2]
        t = jnp.arange(width)[None]  # [1, T]
        pos = lengths[:, None] + t  # [B, T]
        valid = t < num_new[:, None]
        page = jnp.take_along_axis(page_table, jnp.clip(pos // size, 0, N - 1), axis=1)
        page = jnp.where(valid, page, TRASH_PAGE)
        src = jnp.clip(pos, 0, latent.shape[-2] - 1)
        lead = latent.ndim - 3
        rows = jnp.take_along_axis(latent, jnp.broadcast_to(src[..., None], latent.shape[:lead] + src.shape + (1,)),
                                   axis=lead + 1)  # [*layers, B, T, C]
        return MLAPages(pages=p.at[_at(lead, page) + (pos % size,)].set(rows))
    return paged.replace(layers=_map(one, paged.layers, cache.layers))


def _put(old, new, axis: int, ids):
    return old.at[_at(axis, ids)].set(new)


@functools.partial(jax.jit, donate_argnums=0)
def save_snapshot(paged: PagedCache, slot: Int[Array, ""], snap: Int[Array, ""]) -> PagedCache:
    """Copy slot ``slot``'s live KDA state into snapshot ``snap``."""
    def one(live, snaps):
        if snaps is None:
            return None
        return KDACache(state=_copy_row(live.state, snaps.state, live.state.ndim - 4, slot, snap),
                        conv=_copy_row(live.conv, snaps.conv, live.conv.ndim - 3, slot, snap))
    return paged.replace(snapshots=_map(one, paged.layers, paged.snapshots))


@functools.partial(jax.jit, donate_argnums=0)
def load_snapshot(paged: PagedCache, snap: Int[Array, ""], slot: Int[Array, ""], fresh: bool | Bool[Array, ""]) -> PagedCache:
    """Slot ``slot`` resumes from snapshot ``snap`` (``fresh``: from the zero state of an empty
    sequence instead)."""
    def one(live, snaps):
        if snaps is None:
            return live
        def row(dst, src, a):
            picked = jnp.take(src, snap, axis=a)
            return dst.at[_at(a, slot)].set(jnp.where(fresh, jnp.zeros_like(picked), picked))
        return KDACache(state=row(live.state, snaps.state, live.state.ndim - 4),
                        conv=row(live.conv, snaps.conv, live.conv.ndim - 3))
    return paged.replace(layers=_map(one, paged.layers, paged.snapshots))


@functools.partial(jax.jit, donate_argnums=0)
def copy_page(paged: PagedCache, src: Int[Array, ""], dst: Int[Array, ""]) -> PagedCache:
    """Copy page ``src`` into page ``dst`` (copy-on-write of a partly filled shared page)."""
    def one(c):
        if isinstance(c, KDACache):
            return c
        a = c.pages.ndim - 3
        return MLAPages(pages=c.pages.at[_at(a, dst)].set(jnp.take(c.pages, src, axis=a)))
    return paged.replace(layers=_map(one, paged.layers))


def _copy_row(src, dst, axis: int, i, j):
    return dst.at[_at(axis, j)].set(jnp.take(src, i, axis=axis))
