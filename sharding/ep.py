"""Expert parallelism: the routed expert FFN under ``shard_map`` over the ``expert`` mesh axis.

Each expert-axis rank holds ``E/EP`` experts whole (``w1, w3, w2`` sharded on their expert
axis); tokens stay sharded over every token-carrying axis. Two exact strategies, no token ever
dropped:

``a2a`` (default): 1. sort the rank's ``N·k`` assignments by destination rank; 2. pack them
into a static ``[EP, cap, L]`` buffer, ``cap = ⌈N·k/EP · (1 + reserve)⌉`` (the plan QB keeps
loads at, plus a reserve); 3. ``all_to_all``; 4. local grouped expert FFN
(``pallas_kernels.moe``); 5. ``all_to_all`` back; 6. router-weighted combine in fp32.
Assignments beyond a buffer's ``cap`` rows are not dropped: they go in further *rounds* of the
same exchange (round ``r`` carries each destination's assignments ``r·cap … (r+1)·cap - 1``),
as many as the fullest buffer of the mesh needs (a ``while_loop``; none when nothing overflows),
so memory stays one buffer whatever the router does. The overflowing assignments are returned
as a metric.

``gather``: all-gather the tokens over the expert axis, each rank runs its own experts on the
assignments that chose them, ``psum_scatter`` the partial sums back (MaxText's "ring of
experts"; it moves ``N·L`` values per rank instead of ``N·k·L``, so it wins for large top-k).
Its memory is not bounded by a plan: each rank permutes all ``EP·N·k`` gathered assignments
(``[EP·N·k, L]`` rows, 14 GiB per layer at K3's widths with 8 K tokens per rank and EP = 16), so
it suits small ``EP·N``; the ``a2a`` strategy's rounds are the bounded one.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from pallas_kernels.moe.activations import split_gated_activation
from pallas_kernels.moe.dispatch import invert_permutation, permute
from pallas_kernels.moe.ops import gate_up_matmul, grouped_matmul
from pallas_kernels.moe.reference import accum_dtype
from sharding.context import ParallelConfig, current


def _rows(g, index):
    """``g[index]`` with zero rows for indices past the end (assignments outside this round)."""
    return g.at[index].get(mode="fill", fill_value=0)


def _accum_rows(g, index, k: int):
    """``Σ_s g[index[t·k + s]]`` per token ``t`` (zero past the end), in the accumulation dtype."""
    dt = accum_dtype(g.dtype)
    return _rows(g, index).astype(dt).reshape(-1, k, g.shape[-1]).sum(1).astype(g.dtype)


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
    """``Σ_s weights[t, s] · back[slot[t·k + s]]`` in fp32 (the combine; slots past the end add 0)."""
    return _weighted_sum(_rows(back, slot).reshape(weights.shape + back.shape[-1:]), weights)


def _from_slots_fwd(back, slot, src, filled, weights):
    return _from_slots(back, slot, src, filled, weights), (back, slot, src, filled, weights)


def _from_slots_bwd(res, g):
    back, slot, src, filled, weights = res
    n, k = weights.shape
    dt = accum_dtype(back.dtype)
    gf = g.astype(dt)
    dweights = jnp.einsum("NkL,NL->Nk", _rows(back, slot).astype(dt).reshape(n, k, -1), gf).astype(weights.dtype)
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
    g, u = gmm.gate_up(xs, w1, w3, group_sizes)  # [M·kk, F] each
    y = gmm(act(g, u).astype(x.dtype), w2, group_sizes)  # [M·kk, L]
    y = _take_rows(y, inverse, invert_permutation(inverse))
    return y.reshape(m, kk, -1), jnp.sum(group_sizes)


@jax.checkpoint
def _weighted_sum(y, weights):
    """``Σ_k weights · y`` in the accumulation dtype; the backward recomputes the wide copy of ``y``
    from ``y`` itself (autodiff saved it: an fp32 ``[N, k, L]`` per layer, per repetition when scanned)."""
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


def _route(ids, ep: int, e_local: int):
    """``(dest, rank, counts)``: each assignment's destination rank and its position among the
    assignments bound there (token-major), and the count per destination ``[EP]``."""
    dest = ids.reshape(-1) // e_local  # [A]
    # A running count per destination ([A, EP] ints) instead of an argsort of A keys with only EP values.
    onehot = (dest[:, None] == jnp.arange(ep)[None]).astype(jnp.int32)
    rank = jnp.take_along_axis(jnp.cumsum(onehot, axis=0), dest[:, None], axis=1)[:, 0] - 1
    return dest, rank, jnp.sum(onehot, axis=0)


def _a2a_round(r, route, x, ids, weights, w1, w3, w2, *, axis, ep, cap, act, gmm):
    """Round ``r`` of the static-capacity all-to-all: the assignments ``r·cap … (r+1)·cap - 1`` of
    every destination, ``(fp32 out [n, L], processed)``; the others add zero."""
    n, k = ids.shape
    e_local = w1.shape[0]
    dest, rank, counts = route
    rank = rank - r * cap
    # Buffer row of every assignment of this round; EP·cap (past the end) for the others.
    slot = jnp.where((rank >= 0) & (rank < cap), dest * cap + rank, ep * cap)  # [A]
    # Buffer row (d, p) holds the p-th assignment of this round bound for rank d (the inverse of slot).
    src = jnp.zeros((ep * cap,), jnp.int32).at[slot].set(jnp.arange(n * k, dtype=jnp.int32), mode="drop",
                                                         unique_indices=True)
    filled = (jnp.arange(cap)[None] < jnp.clip(counts - r * cap, 0, cap)[:, None]).reshape(-1)  # [EP·cap]
    send_x = _to_slots(x, src, filled, slot, k)  # [EP·cap, L]
    send_e = jnp.where(filled, ids.reshape(-1)[src] % e_local, e_local)[:, None]
    recv_x = lax.all_to_all(send_x, axis, 0, 0, tiled=True)  # [EP·cap, L], block j from rank j
    recv_e = lax.all_to_all(send_e, axis, 0, 0, tiled=True)
    y, processed = _local_experts(recv_x, recv_e, w1, w3, w2, act=act, gmm=gmm)
    back = lax.all_to_all(y[:, 0], axis, 0, 0, tiled=True)  # [EP·cap, L], in our slot order
    return _from_slots(back, slot, src, filled, weights), processed


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _more_rounds(one_round, rounds, route, ids, x, weights, w1, w3, w2):
    """``Σ_{r=1..rounds} one_round(r, …)`` in a ``while_loop`` (no round runs when ``rounds == 0``).

    Reverse-mode autodiff has no rule for a loop of dynamic length, hence the custom VJP: the
    backward runs the rounds again, each one's VJP in turn, keeping only the inputs (the overflow
    is rare; its rounds cost a recomputation, never memory beyond one round).
    """
    zero = (jnp.zeros(x.shape, accum_dtype(x.dtype)), jnp.zeros((), jnp.int32))

    def body(r, acc):
        out, processed = one_round(r, route, x, ids, weights, w1, w3, w2)
        return acc[0] + out, acc[1] + processed

    return lax.fori_loop(1, rounds + 1, body, zero)


def _more_rounds_fwd(one_round, rounds, route, ids, x, weights, w1, w3, w2):
    return _more_rounds(one_round, rounds, route, ids, x, weights, w1, w3, w2), (rounds, route, ids, x, weights,
                                                                                 w1, w3, w2)


def _more_rounds_bwd(one_round, res, cotangents):
    rounds, route, ids, *diff = res
    g = cotangents[0]

    def body(r, grads):
        _, vjp = jax.vjp(lambda *d: one_round(r, route, d[0], ids, *d[1:])[0], *diff)
        return jax.tree.map(jnp.add, grads, vjp(g))

    grads = lax.fori_loop(1, rounds + 1, body, tuple(jnp.zeros_like(d) for d in diff))
    return (None, None, None, *grads)


_more_rounds.defvjp(_more_rounds_fwd, _more_rounds_bwd)


def _a2a_path(x, ids, weights, w1, w3, w2, *, axis, ep, cap, act, gmm, tok_axes):
    """Every assignment through the all-to-all: round 0, then the overflow's rounds if any."""
    route = _route(ids, ep, w1.shape[0])
    one_round = functools.partial(_a2a_round, axis=axis, ep=ep, cap=cap, act=act, gmm=gmm)
    out, processed = one_round(0, route, x, ids, weights, w1, w3, w2)
    # The same number of rounds on every rank (each one is a collective): the fullest buffer's.
    rounds = (lax.pmax(jnp.max(route[2]), tok_axes) - 1) // cap
    more, more_processed = _more_rounds(one_round, rounds, route, ids, x, weights, w1, w3, w2)
    return (out + more).astype(x.dtype), processed + more_processed


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
    if ep == 1:  # every expert is local: no exchange, no buffer, nothing can overflow
        y, processed = _local_experts(x, ids, w1, w3, w2, act=act, gmm=gmm)
        return _weighted_sum(y, weights).astype(x.dtype), processed, jnp.zeros((), jnp.int32), processed[None]
    counts = jnp.bincount(ids.reshape(-1) // w1.shape[0], length=ep)
    received = lax.psum(counts, axis)
    if strategy == "gather":
        out, processed = _gather_path(x, ids, weights, w1, w3, w2, **paths)
        return out, processed, jnp.zeros((), jnp.int32), received
    cap = capacity(n, k, ep, reserve)
    overflow = lax.psum(jnp.sum(jnp.maximum(counts - cap, 0)), tok_axes)
    out, processed = _a2a_path(x, ids, weights, w1, w3, w2, ep=ep, cap=cap, tok_axes=tok_axes, **paths)
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
    did not fit the a2a buffers this call (they were computed by further rounds of the exchange),
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


@dataclasses.dataclass(frozen=True)
class ExpertMatmuls:
    """The local experts' grouped matmuls: ``self(lhs, rhs, group_sizes)`` and ``gate_up`` (whose
    Pallas backward is one ``dg·W1ᵀ + du·W3ᵀ`` product, not two added by XLA)."""

    implementation: str | None

    def __call__(self, lhs, rhs, group_sizes):
        return grouped_matmul(lhs, rhs, group_sizes, implementation=self.implementation)

    def gate_up(self, lhs, w1, w3, group_sizes):
        return gate_up_matmul(lhs, w1, w3, group_sizes, implementation=self.implementation)


def expert_fns(activation: str, situ_beta: float, situ_linear_beta: float, implementation: str | None):
    """``(act, gmm)``: the gated activation and the grouped matmuls the local experts run."""
    act = functools.partial(split_gated_activation, activation=activation, situ_beta=situ_beta,
                            situ_linear_beta=situ_linear_beta)
    return act, ExpertMatmuls(implementation)


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
