"""MoonEP placement: which hot experts get redundant replicas, on which expert-parallel rank, with
what share of their tokens (Kimi K3 report, "MoonEP": dynamic redundant experts, static shapes).

Layout. ``E`` logical experts on ``D`` expert ranks; rank ``h`` is the home of experts
``[h·E/D, (h+1)·E/D)`` (their weights and optimiser state live there, as without redundancy).
Each rank also has ``q = R/D`` replica slots; slot ``j`` of rank ``d`` holds a copy of an expert
whose home is rank ``(d − j − 1) mod D``. The fixed ring shifts make fetching the copies ``q``
``ppermute``s of one expert each (the least traffic possible), and keep the plan a pair of flat
``[R]`` arrays: ``replica_expert`` (logical id per slot, slot ``r = d·q + j``) and
``replica_share`` (the fraction of that expert's assignments the slot takes; the home keeps the
rest).

Plan (``plan_replicas``): from the planned loads ``λ`` (QB's per-expert token counts summed since
the last plan), ``μ`` the mean rank load; for ``j = 0 … q−1`` every rank ``h`` offers its hottest
remaining home expert to rank ``h + j + 1``, and the flows along each cycle of that shift solve
``load_h − f_h + f_{h−j−1} = μ`` (clipped to ``0 ≤ f_h ≤`` what that expert still has at home).
A rank whose flow is not clipped ends the round at exactly ``μ``.

Bound. Let ``μ = Σλ/D``. Within a round a rank whose flow is not clipped ends at exactly ``μ``,
one whose flow is clipped at 0 ends below ``μ``, and one that stays above ``μ`` has exported its
whole pick: so a rank ends above ``μ`` only when its ``q`` hottest home experts (or the copies it
took in) leave more than ``μ``, i.e. when one of them is too hot to be spread over ``q + 1``
ranks. Tested properties (``tests/sharding/test_moonep_placement.py``): every assignment is placed
exactly once (``Σ_d planned_d = Σλ``); the plan never raises the most loaded rank; with loads
skewed as QB leaves them (no expert above ``q·μ``) the planned max/mean is ``≤ 1.05``.
At run time a rank receives the plan's share of the *micro-batch's* loads; the per-destination
buffers of ``sharding.ep`` bound what it receives by ``D·cap ≈ (1 + reserve)·N·k``, and
``sharding.moonep`` reports the max/mean it measured.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

# Share resolution when a source rank splits an expert's assignments among its copies.
SHARE_UNITS = 1 << 16


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


def slot_homes(replicas: int, ep: int) -> Int[Array, "R"]:
    """Home rank of the expert each slot may hold: slot ``j`` of rank ``d`` copies from ``d − j − 1``."""
    q = replicas // ep
    d, j = jnp.divmod(jnp.arange(replicas), q)
    return (d - j - 1) % ep


def valid_slots(replica_expert: Int[Array, "R"], num_experts: int, ep: int) -> jax.Array:
    """Slots whose expert lives on the rank they copy from (a plan made for another mesh is ignored)."""
    homes = slot_homes(replica_expert.shape[0], ep)
    inside = (replica_expert >= 0) & (replica_expert < num_experts)
    return inside & (replica_expert // (num_experts // ep) == homes)


def _ring_flows(excess, cap, shift: int):
    """Flows ``f_h`` (rank h → h+shift) with ``load − f_h + f_{h−shift} = μ`` where the caps allow.

    Each cycle of the shift is walked from its coldest rank, three laps so the wrap-around flow
    settles (clipping makes ``f`` monotone in the incoming flow, so laps only raise it).
    """
    ep = excess.shape[0]
    g = math.gcd(ep, shift)
    m = ep // g
    members = (jnp.arange(g)[:, None] + shift * jnp.arange(m)[None]) % ep  # [g, m] one cycle per row
    start = jnp.argmin(excess[members], axis=1)  # coldest position of every cycle
    ranks = (jnp.arange(g)[:, None] + shift * (start[:, None] + jnp.arange(m)[None])) % ep  # [g, m] walk order

    def body(incoming, i):
        r = ranks[:, i % m]
        f = jnp.clip(excess[r] + incoming, 0.0, cap[r])
        return f, (r, f)

    _, (visited, flows) = lax.scan(body, jnp.zeros(g, excess.dtype), jnp.arange(3 * m))
    out = jnp.zeros_like(excess)
    # The last lap's flows (later laps overwrite earlier ones at the same rank).
    return out.at[visited[-m:].reshape(-1)].set(flows[-m:].reshape(-1))


def plan_replicas(loads: Float[Array, "E"], ep: int, replicas: int) -> tuple[Int[Array, "R"], Float[Array, "R"]]:
    """``(replica_expert, replica_share)`` for ``replicas`` slots on ``ep`` ranks from planned ``loads``.

    Jit-able with static shapes (the train step recomputes it every ``placement_every`` steps).
    """
    num_experts = loads.shape[-1]
    q = check_layout(num_experts, replicas, ep)
    eh = num_experts // ep
    dt = jnp.promote_types(loads.dtype, jnp.float32)
    home = loads.astype(dt).reshape(ep, eh)  # what each expert still has at home
    mu = jnp.sum(home) / ep
    experts, shares = [], []
    for j in range(q):
        pick = jnp.argmax(home, axis=1)  # [D] hottest remaining home expert of every rank
        cap = jnp.take_along_axis(home, pick[:, None], 1)[:, 0]
        load = jnp.sum(home, axis=1) + _received(experts, shares, loads, ep, q)
        f = _ring_flows(load - mu, cap, j + 1)  # [D] from rank h to rank h + j + 1
        home = home.at[jnp.arange(ep), pick].add(-f)
        total = loads.astype(dt)[jnp.arange(ep) * eh + pick]
        dest = (jnp.arange(ep) + j + 1) % ep
        # Slot j of rank dest holds rank h's pick: order the per-source values by destination.
        experts.append(jnp.zeros(ep, jnp.int32).at[dest].set((jnp.arange(ep) * eh + pick).astype(jnp.int32)))
        shares.append(jnp.zeros(ep, dt).at[dest].set(jnp.where(total > 0, f / jnp.where(total > 0, total, 1), 0)))
    if not q:
        return jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.float32)
    replica_expert = jnp.stack(experts, axis=1).reshape(-1)  # [D, q] → slot r = d·q + j
    replica_share = jnp.clip(jnp.stack(shares, axis=1).reshape(-1), 0.0, 1.0).astype(jnp.float32)
    return replica_expert, replica_share


def _received(experts, shares, loads, ep: int, q: int):
    """Load each rank already takes in through the slots planned in earlier rounds."""
    got = jnp.zeros(ep, jnp.promote_types(loads.dtype, jnp.float32))
    for e, s in zip(experts, shares):
        got = got + s * loads[e]
    return got


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
