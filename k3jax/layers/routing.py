"""The router's choice: each token's top-k experts and their weights from the router's scores (SPEC §4).

Its own module so that both the MoE layer and the decode paths of ``k3jax.layers.moe_decode`` (which
the layer imports) route with the one definition.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from k3jax import balance

# Guards the renormalisation of the top-k weights against an all-zero row (the references' value).
RENORM_EPS = 1e-20


def route(scores: Float[Array, "T E"], bias: Float[Array, "E"], top_k: int, *, renormalize: bool,
          scaling: float, with_stats: bool = True) -> tuple[Int[Array, "T k"], Float[Array, "T k"]]:
    """Expert ids by the biased scores; weights from the unbiased ones (DeepSeek-V3 noaux_tc).

    ``with_stats``: the balance statistics are computed beside the route, so the ids come from their
    top-(k+1) call (one TopK for both); without them (a decode step) from a top-k of their own, with
    no barrier to copy the ids out of it."""
    bias = jax.lax.stop_gradient(bias)
    if with_stats:
        ids, _ = balance.biased_topk(scores, bias, top_k)  # [T, k]
    else:
        ids = jax.lax.top_k(scores + bias, top_k)[1]
    weights = jnp.take_along_axis(scores, ids, axis=-1)  # [T, k]
    if renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + RENORM_EPS)
    return ids, weights * scaling


__all__ = ["RENORM_EPS", "route"]
