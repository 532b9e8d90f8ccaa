"""The router's top-k and weights on the GPU in one kernel (a step without balance statistics).

XLA compiles :func:`pallas_kernels.moe.routing.topk_route`'s reference (``lax.top_k`` of the biased
scores, a gather of the unbiased ones, their renormalisation) to four kernels after the router's
matmul: the bias add (TopK's custom call takes a materialised operand), the TopK, the slice of its
ids into a buffer of their own and the weights' sum (``small()``'s decode step at batch 1, one MoE
layer: ``benchmarks/decode_kernels.py``). A decode step of ``small()`` is bound by how many kernels
it runs (a few µs each, ``benchmarks/RESULTS.md`` stop 48), so here one Pallas-Triton program per
block of rows does all four in registers: ``k`` rounds of (row max of the biased scores over the
experts not yet taken, the lowest index holding it, its unbiased score), then the weights' sum.

The ids are exactly ``lax.top_k``'s (ties go to the lower index, as its documentation states and
the reference relies on; experts already taken are excluded by a mask, so ``-inf`` biases give
distinct ids too). The weights are the same gathered fp32 scores; only the order of the k-term sum
before the division may differ from XLA's (≤ 1 ulp). ``interpret=True`` runs it in the CPU
interpreter (the default suite's test).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

MAX_BLOCK_T = 16  # rows per program: [16, E] fp32 scores stay in registers up to E = 1024 at 4 warps
MAX_EXPERTS = 1024


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def block_rows(t: int) -> int:
    """Rows per program: the largest power of two dividing ``t``, at most ``MAX_BLOCK_T``."""
    return min(t & -t, MAX_BLOCK_T)


def check_inputs(scores, bias, top_k: int) -> None:
    """Raise ``ValueError`` naming the argument when the kernel cannot take these inputs."""
    if scores.ndim != 2 or bias.shape != scores.shape[1:]:
        raise ValueError(f"scores must be [T, E] and bias [E], got scores {scores.shape}, bias {bias.shape}")
    t, e = scores.shape
    if t < 1:
        raise ValueError(f"scores must have at least one row, got T={t}")
    if not (_pow2(e) and 2 <= e <= MAX_EXPERTS):
        raise ValueError(f"the route kernel needs E (scores.shape[1]) a power of two in [2, {MAX_EXPERTS}], got {e}")
    if not (_pow2(top_k) and top_k < e):
        raise ValueError(f"the route kernel needs top_k a power of two below E={e}, got {top_k}")
    if any(jnp.dtype(x.dtype) != jnp.float32 for x in (scores, bias)):
        raise ValueError(f"scores and bias must be float32 for the route kernel, got {scores.dtype}, {bias.dtype}")


def accepts(scores, bias, top_k: int) -> bool:
    """Whether :func:`check_inputs` takes these inputs (what ``implementation=None`` asks)."""
    try:
        check_inputs(scores, bias, top_k)
    except ValueError:
        return False
    return True


def _kernel(s_ref, b_ref, ids_ref, w_ref, *, top_k: int, renormalize: bool, scaling: float, eps: float):
    s = s_ref[...]  # [bt, E] fp32
    biased = s + b_ref[...][None, :]
    bt, e = s.shape
    cols = jax.lax.broadcasted_iota(jnp.int32, (bt, e), 1)
    slots = jax.lax.broadcasted_iota(jnp.int32, (bt, top_k), 1)
    taken = jnp.zeros((bt, e), jnp.bool_)
    ids = jnp.zeros((bt, top_k), jnp.int32)
    weights = jnp.zeros((bt, top_k), jnp.float32)
    for r in range(top_k):  # k rounds: the best expert not yet taken, the lowest index on ties
        top = jnp.max(jnp.where(taken, -jnp.inf, biased), axis=1)
        pick = jnp.min(jnp.where(~taken & (biased == top[:, None]), cols, e), axis=1)
        hit = cols == pick[:, None]
        ids = jnp.where(slots == r, pick[:, None], ids)
        weights = jnp.where(slots == r, jnp.sum(jnp.where(hit, s, 0.0), axis=1)[:, None], weights)
        taken = taken | hit
    if renormalize:
        weights = weights / (jnp.sum(weights, axis=1, keepdims=True) + eps)
    ids_ref[...] = ids
    w_ref[...] = weights * scaling


@functools.partial(jax.jit, static_argnames=("top_k", "renormalize", "scaling", "eps", "interpret"))
def topk_route_pallas(scores: Float[Array, "T E"], bias: Float[Array, "E"], *, top_k: int, renormalize: bool,
                      scaling: float, eps: float, interpret: bool = False
                      ) -> tuple[Int[Array, "T k"], Float[Array, "T k"]]:
    """``(ids [T, k] int32, weights [T, k] fp32)``: ``routing.topk_route``'s results in one kernel."""
    check_inputs(scores, bias, top_k)
    t, e = scores.shape
    bt = block_rows(t)
    rows = lambda i: (i, 0)
    return pl.pallas_call(
        functools.partial(_kernel, top_k=top_k, renormalize=renormalize, scaling=scaling, eps=eps),
        grid=(t // bt,),
        in_specs=[pl.BlockSpec((bt, e), rows), pl.BlockSpec((e,), lambda i: (0,))],
        out_specs=[pl.BlockSpec((bt, top_k), rows), pl.BlockSpec((bt, top_k), rows)],
        out_shape=[jax.ShapeDtypeStruct((t, top_k), jnp.int32), jax.ShapeDtypeStruct((t, top_k), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="moe_route_topk",
    )(scores, bias)


__all__ = ["MAX_BLOCK_T", "MAX_EXPERTS", "accepts", "block_rows", "check_inputs", "topk_route_pallas"]
