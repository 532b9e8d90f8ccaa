"""A ring of shared-memory slots between a CTA's memory warpgroup and its compute warpgroups, for
kernels that run their own producer/consumer loops across all of a CTA's tiles
(``kernel_gpu_gmm_ring``, ``kernel_gpu_tgmm_ring``) instead of one pipeline per tile.

Both sides count the same steps over the CTA's tiles, and step ``s`` uses slot ``s % stages``:
- the memory warpgroup (``load``) waits for the slot's ``consumed`` barrier (released by step
  ``s - stages``), then copies the step's blocks into it by TMA, each arriving at ``loaded``;
- a compute warpgroup waits for ``loaded`` (``take``), issues its wgmma, then waits for the
  previous step's wgmma and releases that step's slot (``release_previous``), so one wgmma stays
  in flight; a tile's last slot is released once its accumulator is read (``release``).
Each barrier tracks its own phase (Mosaic GPU flips a per-barrier parity bit at every wait), so a
slot needs no bookkeeping beyond the step count.
"""

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import int_ops
from pallas_kernels.moe.kernel_gpu_base import _COMPUTE_WGS

MEMORY_REGISTERS = 40
COMPUTE_REGISTERS = (512 - MEMORY_REGISTERS) // _COMPUTE_WGS // 8 * 8  # the rest of the SM's registers


@dataclasses.dataclass(frozen=True)
class SlotRing:
    stages: int
    loaded: Any  # barrier refs, one per slot
    consumed: Any

    def slot(self, step):
        return int_ops.rem(step, self.stages)

    def load(self, step, copies):
        """Memory side: once the slot is free, ``(gmem source, ring buffer)`` copies into it."""
        slot = self.slot(step)
        pl.when(step >= self.stages)(lambda: plgpu.barrier_wait(self.consumed.at[slot]))
        for src, ring_buffer in copies:
            plgpu.copy_gmem_to_smem(src, ring_buffer.at[slot], self.loaded.at[slot])

    def drain(self, steps):
        """Memory side, after its last load: wait for the last ``stages`` releases, so no barrier
        phase is left pending."""

        @pl.loop(jnp.maximum(steps - self.stages, 0), steps)
        def _(step):
            plgpu.barrier_wait(self.consumed.at[self.slot(step)])

    def take(self, step):
        """Compute side: wait for the step's blocks; returns its slot."""
        slot = self.slot(step)
        plgpu.barrier_wait(self.loaded.at[slot])
        return slot

    def release_previous(self, step, first):
        """Compute side, after issuing the step's wgmma: wait for the previous step's and release its
        slot (``first``: the tile's first step, whose previous step belongs to an earlier tile and is
        released already)."""
        plgpu.wgmma_wait(1)
        pl.when(~first)(lambda: self.release(step - 1))

    def release(self, step):
        plgpu.barrier_arrive(self.consumed.at[self.slot(step)])


def scoped(stages: int, copies_per_step: int = 2, **smem):
    """Decorator: runs ``body(ring, **refs)`` with the ring's barriers and the ``smem`` allocations
    (``name -> plgpu.SMEM``), shared by all warpgroups."""

    def run(body):
        def with_refs(loaded, consumed, **refs):
            return body(SlotRing(stages, loaded, consumed), **refs)

        return pl.run_scoped(
            with_refs,
            loaded=plgpu.Barrier(num_arrivals=copies_per_step, num_barriers=stages),
            consumed=plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),
            **smem,
            collective_axes="wg",
        )

    return run


def split_warpgroups(memory, compute):
    """Runs ``memory()`` on the memory warpgroup and ``compute(wg)`` on each compute warpgroup, with
    the registers moved to the compute side."""
    wg = lax.axis_index("wg")

    @pl.when(wg == _COMPUTE_WGS)
    def _():
        plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")
        memory()

    @pl.when(wg < _COMPUTE_WGS)
    def _():
        plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
        compute(wg)
