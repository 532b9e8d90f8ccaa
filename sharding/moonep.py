"""MoonEP: expert parallelism with redundant experts (Kimi K3 report), so that hot experts' tokens
are spread over several ranks and every rank receives about its plan ``N·k/EP`` (``sharding.ep``).

Weights. Only the logical experts are parameters (``[E, L, F]``, sharded over the expert axis as
in ``sharding.ep``). Inside the layer every rank fetches the ``q = R/EP`` copies its replica slots
hold (``sharding.moonep_placement``: slot ``j`` copies from rank ``d − s_j``, so that is ``q``
``ppermute``s of one expert each) and appends them to its home experts: ``E/EP + q`` physical
experts per rank. Autodiff transposes the fetch, so the gradients of all copies of an expert are
summed into the logical expert on its home rank before the optimiser ever sees them, and the
copies are the current weights at every step: nothing to refresh, and a placement change moves no
state (the next step is the same function of the same parameters).

Routing (one rank, its ``N·k`` assignments, no communication beyond one ``[E]`` count):
1. rank every assignment among this rank's assignments to the same expert (a stable sort);
2. split each expert's assignments by the plan's shares, in that order: the first
   ``home_share · c`` stay with the home copy, the next ``share_r · c`` go to slot ``r``, ...
   (integer keys, ``SHARE_UNITS`` per expert: deterministic, identical on every device);
3. physical id = rank · (E/EP + q) + local slot; then ``sharding.ep.exchange`` unchanged: static
   ``[EP, cap]`` buffers, all-to-all, grouped FFN, all-to-all back, fp32 combine.

Every assignment goes to exactly one copy of its expert, all copies hold the same weights: the
output is the no-redundancy output (up to fp32 summation order in the weight gradients). The
exchange keeps ``sharding.ep``'s overflow rounds for a micro-batch that overflows the buffers;
with a plan that fits the loads none runs (``ep_overflow`` = 0, tested), and they compute such
tokens rather than dropping them.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from sharding.context import ParallelConfig, current
from sharding.ep import _check, exchange, expert_fns, moe_ffn_ep, received_max_mean, shard_experts
from sharding.moonep_placement import SHARE_UNITS, check_layout, share_intervals, slot_shifts


_GOLDEN = 0.6180339887


def fetch_replicas(w: Float[Array, "El A B"], replica_expert: Int[Array, "R"], *, axis: str, ep: int,
                   ) -> Float[Array, "P A B"]:
    """This rank's home experts followed by the copies its ``q`` slots hold (``[E/EP + q, A, B]``).

    Rank ``h`` sends its expert ``replica_expert[(h + s_j)·q + j]`` to rank ``h + s_j``; an
    invalid slot (its expert lives elsewhere) receives zeros and is given no tokens.
    """
    e_local = w.shape[0]
    q = replica_expert.shape[0] // ep
    me = lax.axis_index(axis)
    copies = []
    for j, shift in enumerate(slot_shifts(ep, q)):
        e = replica_expert[((me + shift) % ep) * q + j]
        local = jnp.clip(e - me * e_local, 0, e_local - 1)
        row = lax.dynamic_index_in_dim(w, local, keepdims=False)
        row = jnp.where(e // e_local == me, row, jnp.zeros_like(row))
        copies.append(lax.ppermute(row, axis, [(h, (h + shift) % ep) for h in range(ep)]))
    return jnp.concatenate([w, jnp.stack(copies)]) if copies else w


def physical_ids(ids: Int[Array, "N k"], replica_expert: Int[Array, "R"], replica_share: Float[Array, "R"], *,
                 num_experts: int, ep: int, source: Int[Array, ""] | int = 0) -> Int[Array, "N k"]:
    """The physical expert (``rank · (E/EP + q) + slot``) each assignment of source ``source`` goes to.

    A source with few assignments to an expert would always pick the copies covering the same
    points of ``[0, 1)``; a golden-ratio phase per source spreads them (a rotation: shares kept).
    """
    n, k = ids.shape
    replicas = replica_expert.shape[0]
    q = replicas // ep
    e_local = num_experts // ep
    flat = ids.reshape(-1)
    home = (flat // e_local) * (e_local + q) + flat % e_local
    if not replicas:
        return home.reshape(n, k)
    _, lo, hi = share_intervals(replica_expert, replica_share, num_experts, ep)
    lo, hi = (jnp.round(v * SHARE_UNITS).astype(jnp.int32) for v in (lo, hi))
    # 1. Position of each assignment among this rank's assignments to the same expert.
    order = jnp.argsort(flat, stable=True)
    counts = jnp.bincount(flat, length=num_experts)
    first = jnp.cumsum(counts) - counts
    pos = jnp.zeros_like(flat).at[order].set(jnp.arange(flat.shape[0], dtype=flat.dtype) - first[flat[order]])
    # 2. Its point in [0, 1) of the expert's assignments, in integer units, looked up among the
    #    slots' intervals (sorted by expert, then start).
    point = (pos.astype(jnp.float32) + 0.5) / counts[flat].astype(jnp.float32) + _GOLDEN * jnp.float32(source)
    u = jnp.floor((point - jnp.floor(point)) * SHARE_UNITS).astype(jnp.int32)
    expert = jnp.clip(replica_expert, 0, num_experts - 1)
    key = expert * SHARE_UNITS + lo  # [R]
    by_key = jnp.argsort(key, stable=True)
    r = by_key[jnp.clip(jnp.searchsorted(key[by_key], flat * SHARE_UNITS + u, side="right") - 1, 0, replicas - 1)]
    hit = (expert[r] == flat) & (u >= lo[r]) & (u < hi[r])
    slot = r // q * (e_local + q) + e_local + r % q
    return jnp.where(hit, slot, home).reshape(n, k)


def _moonep_body(x, ids, weights, w1, w3, w2, replica_expert, replica_share, *, ctx: ParallelConfig,
                 num_experts, reserve, act, gmm):
    axis, ep = ctx.expert_axis, ctx.expert_size
    lead = x.shape[:-1]
    x, ids, weights = (a.reshape(-1, a.shape[-1]) for a in (x, ids, weights))
    n, k = ids.shape
    source = lax.axis_index(ctx.token_axes) if ctx.token_axes else 0
    phys = physical_ids(ids, replica_expert, replica_share, num_experts=num_experts, ep=ep, source=source)
    fetch = functools.partial(fetch_replicas, replica_expert=replica_expert, axis=axis, ep=ep)
    out, processed, overflow, received = exchange(x, phys, weights, fetch(w1), fetch(w3), fetch(w2), ctx=ctx,
                                                  strategy="a2a", reserve=reserve, act=act, gmm=gmm)
    shards = math.prod(ctx.axis_size(a) for a in ctx.token_axes)
    stats = {"ep_overflow": overflow, "ep_dropped": n * k * shards - lax.psum(processed, ctx.token_axes),
             "ep_received_max_mean": received_max_mean(received, ctx)}
    return out.reshape(lead + out.shape[-1:]), stats


def moe_ffn_moonep(
    x: Float[Array, "*N L"],
    topk_ids: Int[Array, "*N k"],
    topk_weights: Float[Array, "*N k"],
    w1: Float[Array, "E L F"],
    w3: Float[Array, "E L F"],
    w2: Float[Array, "E F L"],
    replica_expert: Int[Array, "R"],
    replica_share: Float[Array, "R"],
    *,
    activation: str = "situ",
    situ_beta: float = 4.0,
    situ_linear_beta: float = 25.0,
    implementation: str | None = None,
    ctx: ParallelConfig | None = None,
    reserve: float | None = None,
) -> tuple[Float[Array, "*N L"], dict[str, Array]]:
    """``sharding.ep.moe_ffn_ep`` with the ``R`` redundant copies of a MoonEP plan.

    ``replica_expert``/``replica_share`` come from ``sharding.moonep_placement.plan_replicas`` (any
    values are exact: a slot whose expert is not on its source rank, or with share 0, is unused).
    Stats: those of ``moe_ffn_ep``.
    """
    ctx = current() if ctx is None else ctx
    if ctx is None:
        raise ValueError("moe_ffn_moonep needs a parallel context: use `with sharding.use_mesh(mesh):` or ctx=")
    reserve = ctx.ep_reserve if reserve is None else reserve
    kw = dict(activation=activation, situ_beta=situ_beta, situ_linear_beta=situ_linear_beta,
              implementation=implementation)
    if replica_expert.shape != replica_share.shape or replica_expert.ndim != 1:
        raise ValueError(f"replica_expert and replica_share must both be [R], got {replica_expert.shape} "
                         f"and {replica_share.shape}")
    if ctx.expert_size == 1 or replica_expert.shape[0] == 0:
        return moe_ffn_ep(x, topk_ids, topk_weights, w1, w3, w2, ctx=ctx, reserve=reserve, **kw)
    check_layout(w1.shape[0], replica_expert.shape[0], ctx.expert_size)
    _check(x, topk_ids, topk_weights, w1, ctx)
    act, gmm = expert_fns(activation, situ_beta, situ_linear_beta, implementation)
    body = functools.partial(_moonep_body, ctx=ctx, num_experts=w1.shape[0], reserve=reserve, act=act, gmm=gmm)
    return shard_experts(body, ctx, x, topk_ids, topk_weights, w1, w3, w2, replica_expert.astype(jnp.int32),
                         replica_share.astype(jnp.float32))
