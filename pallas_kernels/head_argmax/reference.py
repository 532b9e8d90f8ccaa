"""Pure-JAX definitions of the greedy head: each row's highest-scoring vocabulary id.

1. :func:`greedy_tokens`: ``argmax(x · W)`` over the vocabulary, the logits summed in float32 from
   16-bit operands (the model's head einsum), the lowest id on ties (``jnp.argmax``): what decoding at
   temperature 0 computed from the stored ``[T, V]`` float32 logits before the kernel existed, and its
   XLA path.
2. :func:`block_partials` + :func:`combine_partials`: the same argmax cut the way
   ``kernel_gpu.greedy_head`` computes it. Each vocabulary block of ``block_v`` columns gives, per row,
   its largest logit and that logit's lowest id; the row's token is the id of the first block whose
   maximum is the row's maximum, the lowest such id on ties, as over the whole row. (A row with NaN
   logits gets an unspecified id; ``jnp.argmax`` would give the first NaN's.)
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def logits(x: Float[Array, "T D"], w: Float[Array, "D V"]) -> Float[Array, "T V"]:
    """``x · W`` with ``W`` cast to ``x``'s dtype, summed in float32 (or wider for float64 inputs)."""
    return jnp.einsum("td,dv->tv", x, w.astype(x.dtype), preferred_element_type=jnp.promote_types(x.dtype, jnp.float32))


def greedy_tokens(x: Float[Array, "T D"], w: Float[Array, "D V"]) -> Int[Array, "T"]:
    """Each row's argmax of :func:`logits` (lowest id on ties), int32."""
    return jnp.argmax(logits(x, w), axis=-1).astype(jnp.int32)


def block_partials(x: Float[Array, "T D"], w: Float[Array, "D V"], block_v: int):
    """``(pmax, pidx)``, each ``[V / block_v, T]``: every vocabulary block's largest logit per row and its
    lowest id (over the whole vocabulary)."""
    T, V = x.shape[0], w.shape[1]
    blocks = logits(x, w).reshape(T, V // block_v, block_v)
    pidx = jnp.argmax(blocks, axis=-1).astype(jnp.int32) + jnp.arange(0, V, block_v, dtype=jnp.int32)
    return jnp.max(blocks, axis=-1).T, pidx.T


def _larger(a, b):
    """Of two (logit, id) pairs the larger logit, the lower id on a tie."""
    (va, ia), (vb, ib) = a, b
    take_a = (va > vb) | ((va == vb) & (ia < ib))
    return jnp.where(take_a, va, vb), jnp.where(take_a, ia, ib)


def combine_partials(pmax: Float[Array, "NB T"], pidx: Int[Array, "NB T"]) -> Int[Array, "T"]:
    """Each row's token from the blocks' partials: the lowest id among the blocks reaching the row's max
    (one variadic reduction: XLA runs it as one kernel, where an argmax then a gather took two)."""
    inits = (jnp.array(-jnp.inf, pmax.dtype), jnp.array(jnp.iinfo(jnp.int32).max, jnp.int32))
    return jax.lax.reduce((pmax, pidx), inits, _larger, (0,))[1]


__all__ = ["block_partials", "combine_partials", "greedy_tokens", "logits"]
