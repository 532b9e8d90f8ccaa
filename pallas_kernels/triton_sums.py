"""Several sums in one Pallas-Triton reduction: :func:`sums`.

Each ``jnp.sum`` in a Pallas-Triton kernel lowers to its own ``tt.reduce``, and a reduction across a
program's warps is a round of shared-memory exchanges behind two barriers (``bar.sync``). A kernel whose
inputs need many independent sums of the same shape — the AttnRes mix's per-source dot products and
squares, an MLP's gate and up products — pays those rounds one after another. ``tt.reduce`` takes
several operands and reduces them together, sharing the rounds (what Pallas itself uses for
``argmax``'s value and index); :func:`sums` binds it for plain sums.

In ``small()``'s decode step (device-less, sm_90a PTX) the mixed matvecs go from 17–25 to 10–16
``bar.sync``, ``mixed_norm`` 17 → 10, KDA's fused step 51 → 44; on an H100 the batch-1 step 0.697 →
0.680 ms, batch 64 flat (benchmarks/RESULTS.md, stop 60). Off a Triton compile (the CPU interpreter,
XLA) it is ``jnp.sum`` of each operand.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax._src import core as jax_core
from jax._src.interpreters import mlir
from jax._src.pallas.triton import lowering as triton_lowering
from jaxtyping import Array, Shaped

sums_p = jax_core.Primitive("sums")
sums_p.multiple_results = True


def _sums(*xs, axis: int):
    return [jnp.sum(x, axis=axis) for x in xs]


@sums_p.def_abstract_eval
def _abstract_eval(*avals, axis: int):
    return [jax_core.ShapedArray(a.shape[:axis] + a.shape[axis + 1:], a.dtype) for a in avals]


@triton_lowering.register_lowering(sums_p)
def _triton_lowering(ctx: triton_lowering.LoweringRuleContext, *xs, axis: int):
    # jax's own multi-operand tt.reduce builder (private; the pinned jax 0.11.2's, as its argmax uses it)
    add = lambda left, right: tuple(a + b for a, b in zip(left, right))
    return triton_lowering._reduction_lowering(add, ctx, tuple(xs), axes=(axis,))


sums_p.def_impl(_sums)
mlir.register_lowering(sums_p, mlir.lower_fun(_sums, multiple_results=True))


def sums(*xs: Shaped[Array, "..."], axis: int = 0) -> list:
    """``[jnp.sum(x, axis) for x in xs]`` as one Triton reduction; the ``xs`` share a shape (each sums in
    its own dtype)."""
    if not xs:
        return []
    shape = xs[0].shape
    for n, x in enumerate(xs):
        if x.shape != shape:
            raise ValueError(f"sums: xs[{n}] has shape {list(x.shape)}, xs[0] {list(shape)}; they must match")
    axis = axis % len(shape) if shape else 0
    return sums_p.bind(*xs, axis=axis) if shape else list(xs)


__all__ = ["sums", "sums_p"]
