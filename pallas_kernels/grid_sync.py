"""A barrier across every program of a Pallas-Triton grid, for kernels that run several dependent phases.

A decode step of ``small()`` is a chain of ~100 (batch 1) to ~190 (batch 64) dependent kernels. A kernel
whose programs are all resident at once can instead run dependent phases back to back, every program
waiting here between them: each program counts itself in at ``sync_ref[index]`` (an int32 counter, zero
before the kernel) and spins until all ``programs`` have arrived.

Ordering follows CUDA's cooperative grid sync: a CTA barrier so every thread's stores precede the
arrival, the arrival and the polls as Triton's acquire-release atomics at GPU scope (a scalar atomic runs
on one thread and broadcasts its result), a CTA barrier after; the next phase then reads what other
programs wrote with plain loads, as threads do after CUDA's ``grid.sync()`` (the acquire orders them;
jax 0.11.2's Triton lowering takes no ``.cg`` cache modifier: its table is keyed without the dot).

**Every program must be resident at once** (a grid of at most one program per SM, or as many as fit), or
the first programs spin forever waiting for ones that cannot start; the interpreter runs programs one
after another, so it takes a grid of one program only. ``benchmarks/bench_grid_barrier.py`` times a
barrier against a kernel boundary (H100: it loses, RESULTS.md stop 57).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu


def grid_barrier(sync_ref, index: int, programs: int, interpret: bool = False) -> None:
    """Wait until ``programs`` programs have reached barrier ``index`` (``sync_ref``: int32 zeros, one
    counter a barrier; each counter serves one barrier of one kernel call). ``interpret``: the CPU
    interpreter's lone program only counts itself in (it has no CTA barrier and nobody to wait for)."""
    if interpret and programs != 1:
        raise ValueError(f"the interpreter runs programs one after another: programs={programs} must be 1")
    counter = (jnp.int32(index),)
    if interpret:
        plgpu.atomic_add(sync_ref, counter, jnp.int32(1))
        return
    plgpu.debug_barrier()
    arrived = plgpu.atomic_add(sync_ref, counter, jnp.int32(1)) + 1
    jax.lax.while_loop(lambda n: n < programs, lambda _: plgpu.atomic_add(sync_ref, counter, jnp.int32(0)), arrived)
    plgpu.debug_barrier()


__all__ = ["grid_barrier"]
