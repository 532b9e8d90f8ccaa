"""Expert parallelism: the routed expert FFN under ``shard_map`` over the ``expert`` mesh axis.

Each expert-axis rank holds ``E/EP`` experts whole (``w1, w3, w2`` sharded on their expert
axis); tokens stay sharded over every token-carrying axis. Two exact strategies, no token ever
dropped:

``a2a`` (default): 1. sort the rank's ``N·k`` assignments by destination rank; 2. pack them
into a static ``[EP, cap, L]`` buffer, ``cap = ⌈N·k/EP · (1 + reserve)⌉`` (the plan QB keeps
loads at, plus a reserve); 3. ``all_to_all``; 4. local grouped expert FFN
(``pallas_kernels.moe``); 5. ``all_to_all`` back; 6. router-weighted combine in fp32.
If any rank would overflow any buffer, *every* rank takes the ``gather`` path for this call
(a ``lax.cond`` on a mesh-wide ``pmax``), so overflowing tokens are computed, not dropped; the
number of overflowing assignments is returned as a metric.

``gather``: all-gather the tokens over the expert axis, each rank runs its own experts on the
assignments that chose them, ``psum_scatter`` the partial sums back (MaxText's "ring of
experts"; it moves ``N·L`` values per rank instead of ``N·k·L``, so it wins for large top-k).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from pallas_kernels.moe.activations import gated_activation
from pallas_kernels.moe.dispatch import invert_permutation, permute
from pallas_kernels.moe.ops import grouped_matmul
from pallas_kernels.moe.reference import accum_dtype
from sharding.context import ParallelConfig, current


def _accum_rows(g, index, k: int):
    """``Σ_s g[index[t·k + s]]`` per token ``t``, summed in the accumulation dtype."""
    dt = accum_dtype(g.dtype)
    return g[index].astype(dt).reshape(-1, k, g.shape[-1]).sum(1).astype(g.dtype)


# Every row movement below is a gather whose transpose is another gather (the slot / order maps
# are injective), written as custom VJPs: autodiff of a plain gather is a scatter-add, XLA's slow
# op on GPU (pallas_kernels/moe/dispatch.py), and the a2a path has three of them per layer.
@jax.custom_vjp
def _take_rows(y, perm, inverse):
    """``y[perm]`` for a permutation ``perm`` whose inverse is ``inverse``."""
    return y[perm]


_take_rows.defvjp(lambda y, perm, inverse: (y[perm], inverse),
                  lambda inverse, g: (g[inverse], None, None))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _to_slots(x, src, filled, slot, k):
    """Send buffer: row r is token ``src[r] // k`` where ``filled[r]``, else zero.

    ``slot [N·k]`` is the row of each assignment (its transpose: a gather and a sum over k).
    """
    return jnp.where(filled[:, None], x[src // k], 0).astype(x.dtype)


def _to_slots_bwd(k, slot, g):
    return _accum_rows(g, slot, k), None, None, None


_to_slots.defvjp(lambda x, src, filled, slot, k: (_to_slots(x, src, filled, slot, k), slot), _to_slots_bwd)


@jax.custom_vjp
def _from_slots(back, slot, src, filled, weights):
    """``Σ_s weights[t, s] · back[slot[t·k + s]]`` in fp32, in ``back.dtype`` (the combine)."""
    return _weighted_sum(back[slot].reshape(weights.shape + back.shape[-1:]), weights).astype(back.dtype)


def _from_slots_fwd(back, slot, src, filled, weights):
    return _from_slots(back, slot, src, filled, weights), (back, slot, src, filled, weights)


def _from_slots_bwd(res, g):
    back, slot, src, filled, weights = res
    n, k = weights.shape
    dt = accum_dtype(back.dtype)
    gf = g.astype(dt)
    dweights = jnp.einsum("NkL,NL->Nk", back[slot].astype(dt).reshape(n, k, -1), gf).astype(weights.dtype)
    # Buffer row r came from assignment src[r]: its cotangent is that assignment's weight times g.
    w_row = weights.reshape(-1).astype(dt)[src]
    dback = jnp.where(filled[:, None], gf[src // k] * w_row[:, None], 0.0).astype(back.dtype)
    return dback, None, None, None, dweights


_from_slots.defvjp(_from_slots_fwd, _from_slots_bwd)


def _local_experts(x, ids, w1, w3, w2, *, act, gmm):
    """Unweighted expert outputs ``[M, kk, L]`` for rows ``x [M, L]`` and local ids ``[M, kk]``.

    Ids equal to ``E_local`` mean "not here": ``permute`` sorts them past every group, the
    grouped matmuls leave those rows zero.
    """
    e_local = w1.shape[0]
    m, kk = ids.shape
    xs, group_sizes, inverse = permute(x, ids, e_local)  # [M·kk, L]
    g = gmm(xs, w1, group_sizes)  # [M·kk, F]
    u = gmm(xs, w3, group_sizes)
    y = gmm(act(g, u).astype(x.dtype), w2, group_sizes)  # [M·kk, L]
    y = _take_rows(y, inverse, invert_permutation(inverse))
    return y.reshape(m, kk, -1), jnp.sum(group_sizes)


def _weighted_sum(y, weights):
    dt = accum_dtype(y.dtype)
    return jnp.einsum("NkL,Nk->NL", y.astype(dt), weights.astype(dt))


def _gather_path(x, ids, weights, w1, w3, w2, *, axis, act, gmm):
    """All-gather tokens, run local experts, reduce-scatter the partial sums."""
    e_local = w1.shape[0]
    first = lax.axis_index(axis) * e_local
    x_all = lax.all_gather(x, axis, tiled=True)  # [EP·N, L]
    ids_all = lax.all_gather(ids, axis, tiled=True) - first  # [EP·N, k]
    w_all = lax.all_gather(weights, axis, tiled=True)
    mine = (ids_all >= 0) & (ids_all < e_local)
    y, processed = _local_experts(x_all, jnp.where(mine, ids_all, e_local), w1, w3, w2, act=act, gmm=gmm)
    partial = _weighted_sum(y, jnp.where(mine, w_all, 0.0))  # [EP·N, L] fp32
    out = lax.psum_scatter(partial, axis, scatter_dimension=0, tiled=True)  # [N, L]
    return out.astype(x.dtype), processed


def _a2a_path(x, ids, weights, w1, w3, w2, *, axis, ep, cap, act, gmm):
    """Static-capacity all-to-all dispatch; assumes no buffer overflows (checked by the caller)."""
    n, k = ids.shape
    e_local = w1.shape[0]
    flat = ids.reshape(-1)  # [A], token-major
    dest = flat // e_local
    # Rank of each assignment among those bound for the same rank: a running count per
    # destination ([A, EP] ints) instead of an argsort of A keys with only EP distinct values.
    onehot = (dest[:, None] == jnp.arange(ep)[None]).astype(jnp.int32)  # [A, EP]
    rank = jnp.take_along_axis(jnp.cumsum(onehot, axis=0), dest[:, None], axis=1)[:, 0] - 1
    counts = jnp.sum(onehot, axis=0)  # [EP]
    slot = dest * cap + rank  # [A]: buffer row of every assignment (all < EP·cap: no overflow)
    # Buffer row (d, p) holds the p-th assignment bound for rank d (the inverse of slot).
    src = jnp.zeros((ep * cap,), jnp.int32).at[slot].set(jnp.arange(n * k, dtype=jnp.int32), mode="drop",
                                                         unique_indices=True)
    filled = (jnp.arange(cap)[None] < counts[:, None]).reshape(-1)  # [EP·cap]
    send_x = _to_slots(x, src, filled, slot, k)  # [EP·cap, L]
    send_e = jnp.where(filled, flat[src] % e_local, e_local)[:, None]
    recv_x = lax.all_to_all(send_x, axis, 0, 0, tiled=True)  # [EP·cap, L], block j from rank j
    recv_e = lax.all_to_all(send_e, axis, 0, 0, tiled=True)
    y, processed = _local_experts(recv_x, recv_e, w1, w3, w2, act=act, gmm=gmm)
    back = lax.all_to_all(y[:, 0], axis, 0, 0, tiled=True)  # [EP·cap, L], in our slot order
    return _from_slots(back, slot, src, filled, weights).astype(x.dtype), processed


def capacity(tokens: int, top_k: int, ep: int, reserve: float) -> int:
    """Rows per destination rank: the plan ``N·k/EP`` times ``1 + reserve``, at most ``N·k``."""
    plan = tokens * top_k / ep
    return max(1, min(tokens * top_k, math.ceil(plan * (1.0 + reserve))))


def exchange(x, ids, weights, w1, w3, w2, *, ctx: ParallelConfig, strategy, reserve, act, gmm):
    """One rank's ``(out [n, L], processed, overflow, received [EP])`` for flat ``ids`` into ``w1 [E_local…]``.

    Inside the ``shard_map`` body: ids are global over ``EP · E_local`` experts, expert ``i`` on
    rank ``i // E_local``. ``received`` counts the assignments each rank of this expert group gets.
    """
    axis, ep = ctx.expert_axis, ctx.expert_size
    n, k = ids.shape
    tok_axes = ctx.token_axes
    paths = dict(axis=axis, act=act, gmm=gmm)
    gather = functools.partial(_gather_path, **paths)
    if ep == 1:  # every expert is local: no exchange, no buffer, nothing can overflow
        y, processed = _local_experts(x, ids, w1, w3, w2, act=act, gmm=gmm)
        return _weighted_sum(y, weights).astype(x.dtype), processed, jnp.zeros((), jnp.int32), processed[None]
    counts = jnp.bincount(ids.reshape(-1) // w1.shape[0], length=ep)
    received = lax.psum(counts, axis)
    if strategy == "gather":
        out, processed = gather(x, ids, weights, w1, w3, w2)
        return out, processed, jnp.zeros((), jnp.int32), received
    cap = capacity(n, k, ep, reserve)
    overflow = lax.psum(jnp.sum(jnp.maximum(counts - cap, 0)), tok_axes)
    a2a = functools.partial(_a2a_path, ep=ep, cap=cap, **paths)
    # Under autodiff a cond outputs the residuals of both branches, the untaken one's as
    # zeros: without the checkpoint that is ~7 [EP·N·k, L] fp32 buffers filled with zeros per
    # layer and step. The rarely taken fallback keeps only its inputs and recomputes instead.
    fallback = jax.checkpoint(gather, policy=jax.checkpoint_policies.nothing_saveable)
    out, processed = lax.cond(overflow > 0, fallback, a2a, x, ids, weights, w1, w3, w2)
    return out, processed, overflow, received


def received_max_mean(received, ctx: ParallelConfig):
    """Largest per-rank received count over the mean, worst expert group of the mesh (fp32)."""
    r = received.astype(jnp.float32)
    ratio = jnp.max(r) / jnp.maximum(jnp.mean(r), 1.0)
    others = tuple(a for a in ctx.token_axes if a != ctx.expert_axis)
    return lax.pmax(ratio, others) if others else ratio


def _ep_body(x, ids, weights, w1, w3, w2, *, ctx: ParallelConfig, strategy, reserve, act, gmm):
    lead = x.shape[:-1]
    x, ids, weights = (a.reshape(-1, a.shape[-1]) for a in (x, ids, weights))
    n, k = ids.shape
    shards = math.prod(ctx.axis_size(a) for a in ctx.token_axes)
    out, processed, overflow, received = exchange(x, ids, weights, w1, w3, w2, ctx=ctx, strategy=strategy,
                                                  reserve=reserve, act=act, gmm=gmm)
    dropped = n * k * shards - lax.psum(processed, ctx.token_axes)
    stats = {"ep_overflow": overflow, "ep_dropped": dropped, "ep_received_max_mean": received_max_mean(received, ctx)}
    return out.reshape(lead + out.shape[-1:]), stats


def _check(x, topk_ids, topk_weights, w1, ctx: ParallelConfig) -> None:
    ep = ctx.expert_size
    if topk_ids.shape[:-1] != x.shape[:-1] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights must be [*N, k] with *N = x.shape[:-1] = {x.shape[:-1]}, "
                         f"got {topk_ids.shape} and {topk_weights.shape}")
    if w1.shape[0] % ep:
        raise ValueError(
            f"num_experts={w1.shape[0]} must be divisible by the expert mesh axis size {ep}"
        )
    shards = math.prod(ctx.axis_size(a) for a in ctx.token_axes)
    if math.prod(x.shape[:-1]) % shards:
        raise ValueError(
            f"tokens={math.prod(x.shape[:-1])} (x.shape={x.shape}) must be divisible by the "
            f"{shards} token shards of mesh axes {ctx.token_axes}"
        )
    if x.ndim not in (2, 3):
        raise ValueError(f"x must be [N, L] or [B, T, L], got shape {x.shape}")
    if x.ndim == 3:
        b_shards = math.prod(ctx.axis_size(a) for a in ctx.batch_axes)
        t_shards = math.prod(ctx.axis_size(a) for a in ctx.length_axes)
        if x.shape[0] % b_shards or x.shape[1] % t_shards:
            raise ValueError(
                f"x.shape={x.shape}: batch must be divisible by {b_shards} ({ctx.batch_axes}) and "
                f"length by {t_shards} ({ctx.length_axes})"
            )


def moe_ffn_ep(
    x: Float[Array, "*N L"],
    topk_ids: Int[Array, "*N k"],
    topk_weights: Float[Array, "*N k"],
    w1: Float[Array, "E L F"],
    w3: Float[Array, "E L F"],
    w2: Float[Array, "E F L"],
    *,
    activation: str = "situ",
    situ_beta: float = 4.0,
    situ_linear_beta: float = 25.0,
    implementation: str | None = None,
    ctx: ParallelConfig | None = None,
    strategy: str | None = None,
    reserve: float | None = None,
) -> tuple[Float[Array, "*N L"], dict[str, Int[Array, ""]]]:
    """``Σ_s w_ts · E_{ids_ts}(x_t)`` (as ``pallas_kernels.moe.moe_ffn``) over the expert mesh axis.

    ``x`` is ``[N, L]`` (tokens flattened from ``[B, T]``) or ``[B, T, L]``, sharded like the
    activations. Returns ``(y, stats)``; ``stats["ep_overflow"]`` counts the assignments that
    did not fit the a2a buffers this call (they were computed by the gather path),
    ``stats["ep_dropped"]`` is the number of assignments no rank computed (always 0: a check),
    ``stats["ep_received_max_mean"]`` the most assignments an expert rank received over the mean.
    """
    ctx = current() if ctx is None else ctx
    if ctx is None:
        raise ValueError("moe_ffn_ep needs a parallel context: use `with sharding.use_mesh(mesh):` or ctx=")
    strategy = ctx.ep_strategy if strategy is None else strategy
    reserve = ctx.ep_reserve if reserve is None else reserve
    if strategy not in ("a2a", "gather"):
        raise ValueError(f"strategy={strategy!r} must be 'a2a' or 'gather'")
    _check(x, topk_ids, topk_weights, w1, ctx)
    act, gmm = expert_fns(activation, situ_beta, situ_linear_beta, implementation)
    body = functools.partial(_ep_body, ctx=ctx, strategy=strategy, reserve=reserve, act=act, gmm=gmm)
    return shard_experts(body, ctx, x, topk_ids, topk_weights, w1, w3, w2)


STATS = ("ep_overflow", "ep_dropped", "ep_received_max_mean")


def expert_fns(activation: str, situ_beta: float, situ_linear_beta: float, implementation: str | None):
    """``(act, gmm)``: the gated activation and the grouped matmul the local experts run."""
    act = functools.partial(gated_activation, activation=activation, situ_beta=situ_beta,
                            situ_linear_beta=situ_linear_beta)
    return act, functools.partial(grouped_matmul, implementation=implementation)


def shard_experts(body, ctx: ParallelConfig, x, topk_ids, topk_weights, w1, w3, w2, *replicated):
    """``body`` under ``shard_map``: tokens as the activations, experts over the expert axis,
    ``replicated`` arrays whole on every device; returns ``(y, stats)`` with scalar ``STATS``."""
    if x.ndim == 3:
        tok_spec = P(ctx.batch_axes or None, ctx.length_axes or None, None)
    else:
        tok_spec = P(ctx.batch_axes + ctx.length_axes or None, None)
    w_spec = P(ctx.expert_axis, None, None)
    # check_vma=False: the kernels' internal zero-initialised carries are not typed as varying.
    args = (x, topk_ids.astype(jnp.int32), topk_weights, w1, w3, w2, *replicated)
    specs = (tok_spec,) * 3 + (w_spec,) * 3 + (P(),) * len(replicated)
    fn = jax.shard_map(body, mesh=ctx.mesh, check_vma=False, out_specs=(tok_spec, {n: P() for n in STATS}),
                       in_specs=ctx.in_specs(specs, *args))
    return fn(*args)
