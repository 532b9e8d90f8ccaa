"""The router's top-k inside a decode kernel, as a rank: what the MoE decode kernels route with.

A decode step's router output is tiny (``[T, E]`` scores), yet XLA routes it with a chain of small
kernels — the bias add, the top-k, the gather of the chosen scores, their normalisation, and a copy of
the ids for the custom call that reads them (4–5 kernels, 6.1 µs of a ``small()`` MoE layer's 8.6 µs
router at batch 1 on the H200, ``benchmarks/RESULTS.md`` stop 49). The expert kernels instead take the
scores and the balancing bias and route in their own programs: the top-k of ``key = scores + bias`` in
``lax.top_k``'s order (descending, the lower index first among equal keys) is a rank — ``rank_e`` counts
the experts that come before e — and slot ``s`` holds the expert of rank s. One comparison of every
pair and a row sum, where a top-k takes k rounds of a row max whose reductions depend on one another
(stop 48's one-kernel router: as slow as XLA's chain). The chosen experts and their order are exactly
``k3jax.layers.routing.route``'s (``without statistics``); the weights differ only by the order of the
fp32 sum of the k chosen scores.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.triton_blocks import is_block_dim
from pallas_kernels.triton_sums import sums

# pairs of experts compared at a time: [E, RANK_PAIRS / E] int32 in registers (4096 over 4 warps: 32 a
# thread; E = 256 at [256, 64] spilled 228 bytes a thread in the gather kernel, ptxas for sm_90a)
RANK_PAIRS = 4096
MAX_EXPERTS = 256


@dataclasses.dataclass(frozen=True)
class Routing:
    """``k3jax.layers.routing.route``'s arguments: the ``top_k`` experts of ``scores + bias``, weighted by
    their ``scores``, renormalised ``÷(Σ + eps)`` when ``renormalize``, times ``scaling``."""

    top_k: int
    renormalize: bool = True
    scaling: float = 1.0
    eps: float = 1e-20


def check_routing(scores, bias, tokens: int, num_experts: int, routing: Routing) -> None:
    """Raise ``ValueError`` naming the argument unless ``scores [tokens, E]`` and ``bias [E]`` are float32
    with E = ``num_experts`` a power of two in [16, ``MAX_EXPERTS``] and ``0 < routing.top_k < E``."""
    E = num_experts
    if scores.ndim != 2 or scores.shape != (tokens, E) or bias.shape != (E,):
        raise ValueError(f"scores must be [T, E] and bias [E] with T = x.shape[0]={tokens} and E = "
                         f"w1.shape[0]={E}, got scores {scores.shape}, bias {bias.shape}")
    if jnp.dtype(scores.dtype) != jnp.float32 or jnp.dtype(bias.dtype) != jnp.float32:
        raise ValueError(f"the routing decode kernels take float32 scores and bias, got {scores.dtype}, {bias.dtype}")
    if not (is_block_dim(E) and E <= MAX_EXPERTS):
        raise ValueError(f"the routing decode kernels need E (w1.shape[0]) a power of two in [16, {MAX_EXPERTS}], "
                         f"got {E}")
    if not 0 < routing.top_k < E:
        raise ValueError(f"routing.top_k={routing.top_k} must lie in (0, E={E})")


def token_ranks(scores_ref, bias_ref, t, routing: Routing) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Inside a kernel: ``(rank [E], chosen [E], expert index [E])`` of token ``t`` (whole-array refs
    ``scores [T, E]``, ``bias [E]``), ``chosen`` the score of each chosen expert (rank < top_k; zero
    elsewhere); the pairs compared ``RANK_PAIRS / E`` experts at a time."""
    E = bias_ref.shape[0]
    f32, i32 = jnp.float32, jnp.int32
    scores = scores_ref[t, :].astype(f32)
    key = scores + bias_ref[...].astype(f32)
    idx = jax.lax.broadcasted_iota(i32, (E,), 0)
    rank = jnp.zeros((E,), i32)
    n = max(1, min(E, RANK_PAIRS // E))
    for c in range(0, E, n):
        other = scores_ref[t, pl.ds(c, n)].astype(f32) + bias_ref[pl.ds(c, n)].astype(f32)  # [n]
        other_idx = c + jax.lax.broadcasted_iota(i32, (n,), 0)
        before = (other[None, :] > key[:, None]) | ((other[None, :] == key[:, None])
                                                     & (other_idx[None, :] < idx[:, None]))
        rank = rank + jnp.sum(before.astype(i32), axis=1)
    return rank, jnp.where(rank < routing.top_k, scores, 0.0), idx


def slots(scores_ref, bias_ref, t, routing: Routing, which) -> list[tuple[jax.Array, jax.Array]]:
    """Inside a kernel: ``(expert, weight)`` of each slot ``s`` in ``which`` for token ``t`` (refs as
    :func:`token_ranks`), the weight ``scaling · score / (Σ chosen scores + eps)`` (renormalised) or
    ``scaling · score``. The slots' experts and scores and the chosen scores' sum come out of one
    reduction (``triton_sums.sums``): each separate sum is a round of barriers.

    Finite keys have distinct ranks (ties go by index), so one expert holds rank s. A NaN key compares
    false both ways and ranks collide, so the expert is clamped into ``[0, E)``: a NaN router row
    gives a NaN output (its weight), never a read past the expert weights."""
    rank, chosen, idx = token_ranks(scores_ref, bias_ref, t, routing)
    mine = [rank == s for s in which]
    total, *parts = sums(chosen, *(jnp.where(m, idx, 0) for m in mine), *(jnp.where(m, chosen, 0.0) for m in mine))
    experts, scores = parts[:len(mine)], parts[len(mine):]
    if routing.renormalize:
        scores = [x / (total + routing.eps) for x in scores]
    return [(jnp.minimum(e, idx.shape[0] - 1), x * routing.scaling) for e, x in zip(experts, scores)]


__all__ = ["MAX_EXPERTS", "RANK_PAIRS", "Routing", "check_routing", "slots", "token_ranks"]
