"""Token dispatch for the routed experts: permute into expert order and combine back.

``permute`` sorts the ``T·k`` (token, slot) assignments by expert (stable, so each group
keeps token order) and gathers the rows; ``combine`` gathers each assignment's expert output
back and takes the router-weighted sum in float32. Both directions are written as gathers
with custom VJPs: the transpose of a gather by a permutation is the gather by its inverse,
so no scatter-add appears in the backward pass (XLA's scatter-add is the slow part of MoE
dispatch on GPU).
"""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.moe.reference import accum_dtype


def invert_permutation(perm: Int[Array, "M"]) -> Int[Array, "M"]:
    """``inv[perm[i]] = i`` (an integer scatter, cheap next to the row traffic)."""
    n = perm.shape[0]
    return jnp.zeros((n,), jnp.int32).at[perm].set(jnp.arange(n, dtype=jnp.int32), unique_indices=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gather_rows(x, order, inverse, k):
    return x[order // k]  # [T·k, D] in expert order


def _gather_rows_fwd(x, order, inverse, k):
    return _gather_rows(x, order, inverse, k), (order, inverse)


def _gather_rows_bwd(k, res, g):
    order, inverse = res
    t = inverse.shape[0] // k
    per_slot = g[inverse].astype(accum_dtype(g.dtype)).reshape(t, k, -1)  # [T, k, D]
    return per_slot.sum(1).astype(g.dtype), None, None


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def permute(
    x: Float[Array, "T D"], expert_ids: Int[Array, "T k"], num_experts: int
) -> tuple[Float[Array, "M D"], Int[Array, "E"], Int[Array, "M"]]:
    """Rows of ``x`` in expert order, the group sizes, and the inverse permutation.

    Returns ``(x_sorted [T·k, D], group_sizes [E] int32, inverse [T·k] int32)`` where
    ``x_sorted[inverse[t·k + s]] == x[t]`` for the token ``t``'s slot ``s``.
    """
    if x.ndim != 2 or expert_ids.ndim != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"x must be [T, D] and expert_ids [T, k] with the same T, got {x.shape=}, {expert_ids.shape=}"
        )
    if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise ValueError(f"expert_ids must be integer, got {expert_ids.dtype}")
    k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1).astype(jnp.int32)  # [T·k], token-major
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # sorted slot -> flat assignment
    inverse = invert_permutation(order)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return _gather_rows(x, order, inverse, k), group_sizes, inverse


@jax.custom_vjp
def _combine(y, inverse, weights):
    t, k = weights.shape
    dt = accum_dtype(y.dtype)
    picked = y[inverse].astype(dt).reshape(t, k, -1)  # [T, k, D]
    return jnp.einsum("TkD,Tk->TD", picked, weights.astype(dt)).astype(y.dtype)


def _combine_fwd(y, inverse, weights):
    return _combine(y, inverse, weights), (y, inverse, weights)


def _combine_bwd(res, g):
    y, inverse, weights = res
    t, k = weights.shape
    dt = accum_dtype(y.dtype)
    gf = g.astype(dt)
    picked = y[inverse].astype(dt).reshape(t, k, -1)
    dweights = jnp.einsum("TkD,TD->Tk", picked, gf).astype(weights.dtype)
    # dy[inverse[j]] = w_j · g[j // k]: read it as a gather through the forward order.
    order = invert_permutation(inverse)
    w_sorted = weights.reshape(-1).astype(dt)[order]  # [T·k]
    dy = gf[order // k] * w_sorted[:, None]
    pad = y.shape[0] - dy.shape[0]
    dy = jnp.pad(dy, ((0, pad), (0, 0))) if pad else dy
    return dy.astype(y.dtype), None, dweights


_combine.defvjp(_combine_fwd, _combine_bwd)


def combine(
    y: Float[Array, "M D"], inverse: Int[Array, "Tk"], weights: Float[Array, "T k"]
) -> Float[Array, "T D"]:
    """``out[t] = Σ_s weights[t, s] · y[inverse[t·k + s]]``, summed in float32, in ``y.dtype``."""
    if y.ndim != 2 or weights.ndim != 2 or inverse.shape != (weights.size,):
        raise ValueError(
            f"y must be [M, D], weights [T, k] and inverse [T·k], got {y.shape=}, {inverse.shape=}, {weights.shape=}"
        )
    if y.shape[0] < inverse.shape[0]:
        raise ValueError(f"y must have at least T·k={inverse.shape[0]} rows, got {y.shape[0]}")
    return _combine(y, inverse.astype(jnp.int32), weights)
