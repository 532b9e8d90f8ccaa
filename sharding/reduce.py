"""Reductions over the token-carrying mesh axes: losses, gradients and Quantile Balancing statistics.

Under plain ``jit`` with sharded inputs XLA inserts these reductions itself (a mean over a
batch sharded on ``data`` is a global mean). Inside ``shard_map`` they must be explicit: every
per-device sum over tokens is ``psum``-ed over *every* axis that carries tokens (data, fsdp,
expert, sequence), never only the data axis — a statistic reduced over a subset silently
becomes shard-local (SPEC §6 step 4).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from k3jax import balance
from k3jax.train.loss import head_cross_entropy
from sharding.context import ParallelConfig, current


def _ctx(ctx: ParallelConfig | None) -> ParallelConfig:
    ctx = current() if ctx is None else ctx
    if ctx is None:
        raise ValueError("needs a parallel context: use `with sharding.use_mesh(mesh):` or ctx=")
    return ctx


def token_psum(tree: Any, ctx: ParallelConfig | None = None) -> Any:
    """Inside ``shard_map``: sum a pytree of per-device token sums over every token axis."""
    return lax.psum(tree, _ctx(ctx).token_axes)


def token_mean(total: Float[Array, "..."], count: Float[Array, "..."], ctx: ParallelConfig | None = None):
    """Inside ``shard_map``: the global mean from per-device ``(sum, count)`` (e.g. masked CE)."""
    total, count = token_psum((total, count), ctx)
    return total / jnp.maximum(count, 1)


def pmean_grads(grads: Any, ctx: ParallelConfig | None = None) -> Any:
    """Inside ``shard_map``: average per-device gradients of a per-device *mean* loss over tokens."""
    return lax.pmean(grads, _ctx(ctx).token_axes)


def quantile_bias_hist_sharded(
    scores: Float[Array, "T E"],
    bias: Float[Array, "E"],
    k: int,
    *,
    num_bins: int,
    margin_range: tuple[float, float],
    ctx: ParallelConfig | None = None,
) -> Float[Array, "E"]:
    """One histogram QB update from token-sharded router scores, pooled over every token axis.

    Each device bins its own tokens' margins (``k3jax.balance.quantile_bias_hist``), the
    histograms are psum-ed over ``ctx.token_axes``, and every device reads the same bias.
    """
    ctx = _ctx(ctx)
    shards = math.prod(ctx.axis_size(a) for a in ctx.token_axes)
    if scores.shape[0] % shards:
        raise ValueError(f"scores has T={scores.shape[0]} tokens, not divisible by the {shards} token shards")
    body = functools.partial(balance.quantile_bias_hist, k=k, num_bins=num_bins, margin_range=margin_range,
                             axis_names=ctx.token_axes)
    fn = jax.shard_map(body, mesh=ctx.mesh, check_vma=False, in_specs=(P(ctx.token_axes, None), P()),
                       out_specs=P())
    return fn(scores, bias)


def head_cross_entropy_sharded(
    features: Float[Array, "B T D"],
    head: Float[Array, "D V"],
    labels: Int[Array, "B T"],
    mask: Float[Array, "B T"],
    chunk: int = 4096,
    ctx: ParallelConfig | None = None,
    logits_dtype: str | None = None,
    implementation: str | None = None,
) -> Float[Array, ""]:
    """``k3jax.train.loss.head_cross_entropy`` with each device walking only its own tokens.

    Under plain ``jit`` the loss's chunk loop runs over the flattened ``[B·T]`` tokens, so XLA
    all-gathers the token-sharded features and every device computes the head and its gradient
    for the whole batch (2× the head on a 2-way data × expert mesh). Here each device takes the
    chunked loss of its shard; the per-device sums are added outside, and the replicated head's
    gradient is summed over the devices by the ``shard_map`` transpose.
    """
    ctx = _ctx(ctx)
    splits = [math.prod(ctx.axis_size(a) for a in axes) for axes in (ctx.batch_axes, ctx.length_axes)]
    for name, x in (("features", features), ("labels", labels), ("mask", mask)):
        if x.shape[0] % splits[0] or x.shape[1] % splits[1]:
            raise ValueError(f"{name}.shape={x.shape}: B must be divisible by {splits[0]} {ctx.batch_axes} "
                             f"and T by {splits[1]} {ctx.length_axes}")
    tok = ctx.spec("batch", "length")

    def body(f, w, y, m):
        return head_cross_entropy(f, w, y, m, chunk, logits_dtype, implementation)[None]  # [1]: this device's sum

    args = (features, head, labels, mask)
    fn = jax.shard_map(body, mesh=ctx.mesh, check_vma=False, out_specs=P(ctx.token_axes or None),
                       in_specs=ctx.in_specs((P(*tok, None), P(), tok, tok), *args))
    return jnp.sum(fn(*args))
