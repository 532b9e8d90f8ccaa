"""MoonEP placement: which hot experts get redundant replicas, on which expert-parallel rank, with
what share of their tokens (Kimi K3 report, "MoonEP": dynamic redundant experts, static shapes).

Layout. ``E`` logical experts on ``D`` expert ranks; rank ``h`` is the home of experts
``[h·E/D, (h+1)·E/D)`` (their weights and optimiser state live there, as without redundancy).
Each rank also has ``q = R/D`` replica slots; slot ``j`` of rank ``d`` holds a copy of an expert
whose home is rank ``d − s_j`` (``slot_shifts``: fixed shifts spread over the ring). Fixed
shifts make fetching the copies ``q`` ``ppermute``s of one expert each (the least traffic
possible) and keep the plan two flat ``[R]`` arrays: ``replica_expert`` (logical id per slot,
slot ``r = d·q + j``) and ``replica_share`` (the fraction of that expert's assignments the slot
takes; the home keeps the rest).

Plan (``plan_replicas``, from the planned loads ``λ``: QB's per-expert counts summed since the
last plan): each rank exports its hottest experts through its ``q`` outgoing slots (D'Hondt
seats, so an expert hotter than a rank gets several copies), and diffusion along those edges
balances the flows, each edge carrying at most its expert's load over its copies.

Bound. Conservation is exact: every planned assignment is computed by exactly one copy, so
``Σ_d planned_d = Σλ`` and, at run time, every assignment is computed exactly once. Diffusion
only moves load from a more to a less loaded rank, so the plan never raises the most loaded
rank: ``max_d planned_d ≤ max_d Σ_{e home on d} λ_e``. It reaches ``μ = Σλ/D`` when the slots
can carry the excess: a rank's excess over ``μ`` must fit in the copies of its ``q`` hottest
experts and land on ranks below ``μ`` within its ``q`` shifts. Measured (tested in
``tests/sharding/test_moonep_placement.py``): Zipf(1.0) popularity over E = 64 on D = 8 with
R = 16 goes from max/mean 2.21 to 1.004; the skewed router of the 8-device test from 1.67 to
1.001. With E = 896 on D = 64 and R = 128 it only reaches 1.45 (from 2.32, Zipf 0.6): a rank
with many hot experts needs more than ``q`` copies; that needs homes moved too (not done here).
At run time a rank receives the plan's share of the *micro-batch's* loads; the static
per-destination buffers of ``sharding.ep`` (``cap = ⌈(1 + reserve)·N·k/D⌉`` rows from each
source) bound what it receives by ``D·cap``, and ``sharding.moonep`` reports the max/mean.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

# Share resolution when a source rank splits an expert's assignments among its copies.
SHARE_UNITS = 1 << 16
# Diffusion iterations of the planner (the D = 8 and 64 Zipf cases settle within 64).
PLAN_ITERATIONS = 64


def check_layout(num_experts: int, replicas: int, ep: int) -> int:
    """Replica slots per rank ``q = R/D`` after checking that the layout exists."""
    if ep < 1 or num_experts % ep:
        raise ValueError(f"num_experts={num_experts} must be divisible by the expert axis size {ep}")
    if replicas < 0 or replicas % ep:
        raise ValueError(f"redundant_experts={replicas} must be a multiple of the expert axis size {ep} "
                         "(every rank holds the same number of replica slots)")
    if replicas // ep >= ep:
        raise ValueError(f"redundant_experts={replicas} gives {replicas // ep} slots per rank; at most "
                         f"{ep - 1} (one per other rank) with an expert axis of size {ep}")
    if num_experts * SHARE_UNITS >= 2**31:
        raise ValueError(f"num_experts={num_experts} must be < {2**31 // SHARE_UNITS} (int32 routing keys)")
    return replicas // ep


def slot_shifts(ep: int, q: int) -> tuple[int, ...]:
    """Slot ``j`` of rank ``d`` copies from rank ``d − s_j``: shifts spread over the ring, so that
    a rank's ``q`` exports reach ranks far apart (neighbours of a hot rank are often hot too)."""
    return tuple(1 + (j * ep) // q for j in range(q))


def slot_homes(replicas: int, ep: int) -> Int[Array, "R"]:
    """Home rank of the expert each slot may hold (slot ``r = d·q + j`` copies from ``d − s_j``)."""
    q = replicas // ep
    d, j = jnp.divmod(jnp.arange(replicas), q)
    return (d - jnp.asarray(slot_shifts(ep, q), jnp.int32)[j]) % ep


def valid_slots(replica_expert: Int[Array, "R"], num_experts: int, ep: int) -> jax.Array:
    """Slots whose expert lives on the rank they copy from (a plan made for another mesh is ignored)."""
    homes = slot_homes(replica_expert.shape[0], ep)
    inside = (replica_expert >= 0) & (replica_expert < num_experts)
    return inside & (replica_expert // (num_experts // ep) == homes)


def _exports(home, q: int):
    """Which home expert each of a rank's ``q`` slots exports: seats by D'Hondt (the expert with the
    largest load per copy so far gets the next), so a very hot expert gets several copies."""
    ep, eh = home.shape
    copies = jnp.zeros((ep, eh), home.dtype)
    picks = []
    for _ in range(q):
        pick = jnp.argmax(home / (copies + 1), axis=1)  # [D]
        picks.append(pick)
        copies = copies.at[jnp.arange(ep), pick].add(1)
    pick = jnp.stack(picks, axis=1)  # [D, q]
    return pick, jnp.take_along_axis(copies, pick, 1)


def plan_replicas(loads: Float[Array, "E"], ep: int, replicas: int,
                  iterations: int = PLAN_ITERATIONS) -> tuple[Int[Array, "R"], Float[Array, "R"]]:
    """``(replica_expert, replica_share)`` for ``replicas`` slots on ``ep`` ranks from planned ``loads``.

    Every rank's slots export its hottest experts (``_exports``); the flows along those fixed
    edges (each at most its expert's load over its copies, so the copies never take more than the
    expert has) are balanced by diffusion: every iteration moves a ``1/(2(q+1))`` of the load
    difference between an edge's ends. Jit-able, static shapes (the train step re-plans inside it).
    """
    num_experts = loads.shape[-1]
    q = check_layout(num_experts, replicas, ep)
    if not q:
        return jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.float32)
    eh = num_experts // ep
    home = loads.astype(jnp.float32).reshape(ep, eh)
    pick, copies = _exports(home, q)
    expert_load = jnp.take_along_axis(home, pick, 1)  # [D, q]
    cap = expert_load / copies
    dest = (jnp.arange(ep)[:, None] + jnp.asarray(slot_shifts(ep, q))[None]) % ep  # [D, q]
    total = jnp.sum(home, axis=1)

    def diffuse(_, flow):
        load = total - jnp.sum(flow, axis=1) + jnp.zeros(ep).at[dest].add(flow)
        return jnp.clip(flow + (load[:, None] - load[dest]) / (2 * (q + 1)), 0.0, cap)

    flow = lax.fori_loop(0, iterations, diffuse, jnp.zeros((ep, q)))
    share = jnp.where(expert_load > 0, flow / jnp.where(expert_load > 0, expert_load, 1.0), 0.0)
    expert = jnp.arange(ep)[:, None] * eh + pick
    # Edge (source h, slot j) lands in slot j of rank dest: slot r = dest·q + j.
    slot = (dest * q + jnp.arange(q)[None]).reshape(-1)
    replica_expert = jnp.zeros(replicas, jnp.int32).at[slot].set(expert.reshape(-1).astype(jnp.int32))
    replica_share = jnp.zeros(replicas, jnp.float32).at[slot].set(jnp.clip(share, 0.0, 1.0).reshape(-1))
    return replica_expert, replica_share


def planned_rank_loads(loads: Float[Array, "E"], replica_expert: Int[Array, "R"],
                       replica_share: Float[Array, "R"], ep: int) -> Float[Array, "D"]:
    """What each rank computes under the plan if the loads are ``loads`` (home shares + its slots)."""
    num_experts = loads.shape[-1]
    q = check_layout(num_experts, replica_expert.shape[0], ep)
    loads = loads.astype(jnp.float32)
    share = jnp.where(valid_slots(replica_expert, num_experts, ep), replica_share, 0.0)
    expert = jnp.clip(replica_expert, 0, num_experts - 1)
    moved = share * loads[expert]  # [R]
    home = loads.reshape(ep, -1).sum(1) - jnp.zeros(ep).at[expert // (num_experts // ep)].add(moved)
    return home + moved.reshape(ep, q).sum(1) if q else home


def share_intervals(replica_expert: Int[Array, "R"], replica_share: Float[Array, "R"], num_experts: int,
                    ep: int) -> tuple[Float[Array, "E"], Float[Array, "R"], Float[Array, "R"]]:
    """``(home, lo, hi)``: an expert's assignments at points ``[0, home)`` of ``[0, 1)`` stay home,
    those in ``[lo_r, hi_r)`` go to slot ``r`` (the slots of one expert follow the home in slot order).

    Invalid slots get an empty interval; float rounding that pushes an expert's shares past 1 trims
    its last slots.
    """
    replicas = replica_expert.shape[0]
    share = jnp.where(valid_slots(replica_expert, num_experts, ep), jnp.clip(replica_share, 0.0, 1.0), 0.0)
    expert = jnp.clip(replica_expert, 0, num_experts - 1)
    earlier = (expert[:, None] == expert[None]) & (jnp.arange(replicas)[None] < jnp.arange(replicas)[:, None])
    before = jnp.sum(jnp.where(earlier, share[None], 0.0), axis=1)  # [R] shares of the same expert's earlier slots
    share = jnp.clip(jnp.minimum(share, 1.0 - before), 0.0, 1.0)
    home = jnp.clip(1.0 - jnp.zeros(num_experts).at[expert].add(share), 0.0, 1.0)
    lo = home[expert] + jnp.minimum(before, 1.0)
    return home, lo, jnp.maximum(lo, jnp.minimum(lo + share, 1.0))


def active_replicas(replica_expert: Int[Array, "*R"], replica_share: Float[Array, "*R"], num_experts: int,
                    ep: int) -> Int[Array, ""]:
    """Slots that take tokens under the plan (all layers of a stacked plan together)."""
    check_layout(num_experts, replica_expert.shape[-1], ep)
    fn = lambda e, s: jnp.sum(jnp.diff(jnp.stack(share_intervals(e, s, num_experts, ep)[1:]), axis=0) > 0)
    for _ in range(replica_expert.ndim - 1):
        fn = jax.vmap(fn)
    return jnp.sum(fn(replica_expert, replica_share)).astype(jnp.int32)


def update_placement(node: dict, loads: Int[Array, "*layers E"], step: Int[Array, ""], *, every: int,
                     ep: int) -> dict:
    """One MoE layer's (or a stack's) placement variables after a step that routed ``loads``.

    ``placement_loads`` sums QB's loads since the last plan; on every ``every``-th step the plan
    is recomputed from them (inside jit, static shapes) and the sum restarts.
    """
    if every < 1:
        raise ValueError(f"placement_every={every} must be >= 1")
    total = node["placement_loads"] + loads.astype(node["placement_loads"].dtype)
    replicas = node["replica_expert"].shape[-1]
    plan = functools.partial(plan_replicas, ep=ep, replicas=replicas)
    for _ in range(total.ndim - 1):
        plan = jax.vmap(plan)
    expert, share = plan(total)
    due = step % every == 0
    return {**node, "replica_expert": jnp.where(due, expert, node["replica_expert"]),
            "replica_share": jnp.where(due, share, node["replica_share"]),
            "placement_loads": jnp.where(due, jnp.zeros_like(total), total)}


def update_placements(balance: Any, stats: Any, step: Int[Array, ""], *, every: int, ep: int) -> Any:
    """``update_placement`` for every MoE layer of a ``balance`` tree, from the step's ``stats`` beside it."""

    def walk(node, stats_node):
        if "replica_expert" in node and not isinstance(node["replica_expert"], dict):
            return update_placement(node, stats_node["loads"], step, every=every, ep=ep)
        return {k: walk(v, stats_node[k]) if isinstance(v, dict) else v for k, v in node.items()}

    return walk(balance, stats)
