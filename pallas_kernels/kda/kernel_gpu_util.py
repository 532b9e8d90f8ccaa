"""Small Mosaic GPU helpers shared by the KDA scan kernels: smem layouts and a 2-slot TMA pipeline.

``plgpu.emit_pipeline`` would do the same, but its predicated copies do not run under the CPU
interpreter (``InterpretGPUParams``), and the tests must; this loop uses only plain copies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import int_ops

SLOTS = 2


def mma_transforms(cols: int, dtype=jnp.bfloat16, swizzle: int = 128):
    """Tiling + swizzle that wgmma needs for a 2D smem operand with ``cols`` minor elements.

    Both operands of one wgmma must share a swizzle, so a kernel with a 32-wide bf16 operand
    passes ``swizzle=64`` for all of them.
    """
    swizzle = min(swizzle, cols * jnp.dtype(dtype).itemsize)
    return (
        plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
        plgpu.SwizzleTransform(swizzle),
    )


def smem(shape, dtype=jnp.bfloat16, *, mma: bool = True, slots: int | None = SLOTS, swizzle: int = 128,
         groups: int | None = None):
    """A (slotted) smem scratch, one per warpgroup with ``groups``; wgmma operands get the swizzled layout."""
    full = ((groups,) if groups else ()) + ((slots,) if slots else ()) + tuple(shape)
    transforms = mma_transforms(shape[-1], dtype, swizzle) if mma else ()
    return plgpu.SMEM(full, dtype, transforms=transforms)


@dataclasses.dataclass(frozen=True)
class Stream:
    """One per-chunk input: ``gmem[chunk*rows : (chunk+1)*rows]`` lands in ``buf.at[slot]``."""

    gmem: object
    rows: int
    buf: object
    slotted: bool = True  # False: one buffer, refilled only once every warpgroup is done with it
    early: bool = False  # unslotted, and refilled when the body says every warpgroup is done with it


def pipelined_chunks(
    n: int,
    streams: Sequence[Stream],
    barrier,
    body: Callable,
    carry,
    *,
    reverse: bool = False,
):
    """``carry = body(chunk, [buf.at[slot] ...], carry)`` for chunk in 0..n-1 (or n-1..0).

    The TMA copies of chunk ``s+1`` are issued before chunk ``s`` is computed; ``barrier`` is a
    ``Barrier(num_arrivals=len(streams), num_barriers=SLOTS)``. The body must have finished every
    wgmma that reads its slot before it returns (reading an accumulator waits for it).
    """
    chunk_of = (lambda s: n - 1 - s) if reverse else (lambda s: s)

    def fetch(step, slot):
        c = chunk_of(step)
        for st in streams:
            plgpu.copy_gmem_to_smem(
                st.gmem.at[pl.ds(c * st.rows, st.rows)], st.buf.at[slot], barrier.at[slot]
            )

    fetch(0, 0)

    def step(s, carry):
        slot = int_ops.rem(s, SLOTS)

        @pl.when(s + 1 < n)
        def _prefetch():
            fetch(s + 1, 1 - slot)

        plgpu.barrier_wait(barrier.at[slot])
        return body(chunk_of(s), slot, [st.buf.at[slot] for st in streams], carry)

    return lax.fori_loop(0, n, step, carry)


def _fetch_chunk(c, slot, shared, own, barrier, *, wg, view=lambda st, slot: st.buf.at[slot],
                 which=lambda st: True):
    """TMA loads of chunk ``c`` into ``slot`` (``view`` picks the buffer): the ``shared`` streams by
    warpgroup 0 for all, each warpgroup's ``own`` by itself; ``which`` filters both; every copy
    counts on ``barrier.at[slot]``."""
    copy = lambda st: plgpu.copy_gmem_to_smem(
        st.gmem.at[pl.ds(c * st.rows, st.rows)], view(st, slot), barrier.at[slot])

    @pl.when(wg == 0)
    def _shared():
        for st in filter(which, shared):
            copy(st)

    for st in filter(which, own):
        copy(st)


def pipelined_chunks_shared(
    n: int,
    shared: Sequence[Stream],
    own: Sequence[Stream],
    barrier,
    released,
    body: Callable,
    carry,
    *,
    wg,
):
    """:func:`pipelined_chunks` for the warpgroups of one CTA reading the same ``shared`` inputs.

    Warpgroup 0 fetches the ``shared`` streams once for all; every warpgroup fetches its ``own``.
    ``barrier`` is a ``Barrier(num_arrivals=len(shared) + warpgroups * len(own), num_barriers=SLOTS)``;
    ``released`` a ``Barrier(num_arrivals=warpgroups, num_barriers=SLOTS)`` that each warpgroup
    arrives at when done with a slot, so warpgroup 0 refills a slot only once no warpgroup reads it.
    """

    fetch = lambda c, slot: _fetch_chunk(c, slot, shared, own, barrier, wg=wg)
    fetch(0, 0)

    def step(s, carry):
        slot = int_ops.rem(s, SLOTS)

        @pl.when(s + 1 < n)
        def _prefetch():
            # The other slot last held chunk s-1 (none before step 1): wait until all are done with it.
            @pl.when(jnp.logical_and(wg == 0, s >= 1))
            def _():
                plgpu.barrier_wait(released.at[1 - slot])

            fetch(s + 1, 1 - slot)

        plgpu.barrier_wait(barrier.at[slot])
        carry = body(s, slot, [st.buf.at[slot] for st in (*shared, *own)], carry)
        plgpu.barrier_arrive(released.at[slot])
        return carry

    carry = lax.fori_loop(0, n, step, carry)

    # Observe the releases of the last two chunks too, so no barrier phase is left unobserved.
    @pl.when(wg == 0)
    def _drain():
        for c in range(max(n - SLOTS, 0), n):
            plgpu.barrier_wait(released.at[c % SLOTS])

    return carry


def pipelined_chunks_lockstep(
    n: int,
    shared: Sequence[Stream],
    own: Sequence[Stream],
    barrier,
    released,
    body: Callable,
    carry,
    *,
    wg,
    reverse: bool = False,
):
    """:func:`pipelined_chunks_shared` whose warpgroups finish chunk ``s-1`` together before ``s``
    starts, so they may read each other's per-chunk smem (and unslotted streams fit the budget).

    Every warpgroup waits on ``released`` (``Barrier(num_arrivals=warpgroups, num_barriers=SLOTS)``)
    at the top of each step: then warpgroup 0 refills the unslotted (``slotted=False``) streams for
    this chunk (their load is not hidden) and the slotted ones for the next chunk. ``early`` streams
    (unslotted) are refilled for the next chunk when the body calls ``refill()``, which it may do
    once every warpgroup is done with them (after a sync). ``barrier`` counts every copy of one
    chunk. ``body(chunk, slot, bufs, carry, refill)``.
    """
    chunk_of = (lambda s: n - 1 - s) if reverse else (lambda s: s)
    view = lambda st, slot: st.buf.at[slot] if st.slotted else st.buf
    late = lambda st: not st.slotted and not st.early

    def fetch(step, slot, which):
        _fetch_chunk(chunk_of(step), slot, shared, own, barrier, wg=wg, view=view, which=which)

    fetch(0, 0, lambda st: True)

    def step(s, carry):
        slot = int_ops.rem(s, SLOTS)

        @pl.when(s >= 1)
        def _refill():
            plgpu.barrier_wait(released.at[1 - slot])  # chunk s-1 is done in every warpgroup
            fetch(s, slot, late)

        @pl.when(s + 1 < n)
        def _prefetch():
            fetch(s + 1, 1 - slot, lambda st: st.slotted)

        def refill():
            @pl.when(s + 1 < n)
            def _early():
                fetch(s + 1, 1 - slot, lambda st: st.early)

        plgpu.barrier_wait(barrier.at[slot])
        carry = body(chunk_of(s), slot, [view(st, slot) for st in (*shared, *own)], carry, refill)
        plgpu.barrier_arrive(released.at[slot])
        return carry

    carry = lax.fori_loop(0, n, step, carry)
    plgpu.barrier_wait(released.at[(n - 1) % SLOTS])  # every phase observed by every waiter
    return carry


def mma_sum(pairs, shape) -> jnp.ndarray:
    """``sum(a @ b for a, b in pairs)`` in one fp32 accumulator, in order; waits for the result."""

    def scope(acc):
        for a, b in pairs:
            plgpu.wgmma(acc, a, b)
        return acc[...]

    return pl.run_scoped(scope, plgpu.ACC(shape, jnp.float32))


def mma(a, b, shape) -> jnp.ndarray:
    """``a @ b`` on the tensor cores (fp32 accumulate); waits for the result."""

    def scope(acc):
        plgpu.wgmma(acc, a, b)
        return acc[...]

    return pl.run_scoped(scope, plgpu.ACC(shape, jnp.float32))


def mma2(a1, b1, a2, b2, shape) -> jnp.ndarray:
    """``a1 @ b1 + a2 @ b2`` in one accumulator."""

    def scope(acc):
        plgpu.wgmma(acc, a1, b1)
        plgpu.wgmma(acc, a2, b2)
        return acc[...]

    return pl.run_scoped(scope, plgpu.ACC(shape, jnp.float32))


def T(ref):
    """The transposed view of a 2D smem ref (wgmma reads it MN-major)."""
    return ref.transpose((1, 0))
