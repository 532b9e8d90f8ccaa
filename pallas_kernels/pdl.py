"""Programmatic dependent launch from a Pallas-Triton kernel: :func:`launch_dependents`.

XLA (jax 0.11.2, ``xla_gpu_enable_pdl`` on by default) launches every kernel of a CUDA program with
programmatic stream serialization and opens each Triton kernel — its own fusions and Pallas-Triton
custom calls alike — with ``griddepcontrol.wait`` (its ``InsertPDLPass``; device-less PTX, RESULTS.md
"Stop 60"). A kernel may then start before its predecessor ends and waits there for the predecessor's
grid to complete and its writes to be visible. What lets it start early is the predecessor's
``griddepcontrol.launch_dependents``: without one, the trigger is implicit at each program's exit, so
the next kernel is scheduled only as the last program of this one exits; XLA emits an explicit one
only in the Triton GEMMs it marks (``PdlLaunchAnnotationPass``).

:func:`launch_dependents` emits that instruction. Called first in a kernel (after XLA's wait), it lets
the next kernel's programs be placed on the SMs while this one computes, so a chain of small kernels
(a batch-1 decode step: ~99 dependent kernels of 4–5 µs) stops paying the next launch after each
kernel's end. Correctness does not depend on it: the dependent's own wait still holds it until this
grid completes. Off a CUDA GPU compile (the CPU interpreter, other backends) it lowers to nothing.
"""

from __future__ import annotations

from jax._src import core as jax_core
from jax._src import effects
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.pallas import core as pallas_core
from jax._src.pallas.triton import lowering as triton_lowering
from jaxlib.triton import dialect as tt_dialect


class _LaunchDependents(effects.Effect):
    """Kept in the kernel's jaxpr though it returns nothing (an effect, so DCE keeps it)."""


_effect = _LaunchDependents()
pallas_core.kernel_local_effects.add_type(_LaunchDependents)
effects.control_flow_allowed_effects.add_type(_LaunchDependents)
effects.lowerable_effects.add_type(_LaunchDependents)

launch_dependents_p = jax_core.Primitive("launch_dependents")
launch_dependents_p.multiple_results = True


@launch_dependents_p.def_effectful_abstract_eval
def _abstract_eval():
    return (), {_effect}


@triton_lowering.register_lowering(launch_dependents_p)
def _triton_lowering(ctx: triton_lowering.LoweringRuleContext):
    del ctx
    # not pure: the instruction stays where it is written, though its (dummy) result is unused
    tt_dialect.elementwise_inline_asm([ir.IntegerType.get_signless(32)],
                                      "griddepcontrol.launch_dependents;\n\tmov.u32 $0, 0;", constraints="=r",
                                      pure=False, packed_element=1, args=[])
    return []


mlir.register_lowering(launch_dependents_p, lambda ctx: [])  # the interpreter, any other backend: nothing
launch_dependents_p.def_impl(lambda: [])


def launch_dependents() -> None:
    """Let the next kernel's programs launch now (``griddepcontrol.launch_dependents``); call it first in a
    Pallas-Triton kernel body."""
    launch_dependents_p.bind()


__all__ = ["launch_dependents", "launch_dependents_p"]
