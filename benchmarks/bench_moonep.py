"""MoonEP vs plain expert parallelism under a Zipf-skewed router: one GPU simulating the slowest rank.

The step of an expert-parallel MoE layer waits for its slowest rank. This routes ``--ep`` ranks'
tokens (``N`` each) with a router whose expert popularity is Zipf-like on top of a balanced one
(``zipf_router``), plans the replicas from an earlier batch's loads
(``sharding.moonep_placement.plan_replicas``), splits each source rank's assignments over the
copies exactly as the layer does (``sharding.moonep.physical_ids``), and then times, on one GPU,
what the most loaded rank computes: its local grouped expert FFN forward + backward
(``sharding.ep._local_experts``, the same code the layer runs) on its received rows, in the static
receive buffer of each layout (``EP · cap`` rows; ``cap`` from the smallest reserve with no
overflow in this batch, so neither layout takes the fallback).

Printed per layout: received max/mean, the reserve and buffer rows, the experts' time (measured),
and the all-to-all time *estimated* from the bytes each rank sends (4 exchanges of its
``EP · cap · L`` buffer: dispatch and return, forward and backward) over ``--link-gbs`` GB/s, plus
MoonEP's replica fetch (``q`` experts' weights forward, their gradients back). One GPU cannot
measure the all-to-all; the 2-GPU ``bench_sharding.py --ep-bench`` does.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/bench_moonep.py --out $OUT/bench_moonep.json
CPU smoke run (no timing value):
    PYTHONPATH=. python3 benchmarks/bench_moonep.py --shape 64 4 64 32 256 --ep 8 --replicas 16 --iters 1 --f32
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.moe.activations import gated_activation
from pallas_kernels.moe.ops import grouped_matmul
from sharding.ep import _local_experts, capacity
from sharding.moonep import physical_ids
from sharding.moonep_placement import plan_replicas, planned_rank_loads


def zipf_router(key, tokens: int, num_experts: int, top_k: int, exponent: float = 0.8):
    """Top-k ids and renormalised sigmoid weights of a router whose expert popularity is Zipf-like.

    A QB-balanced router's scores are exchangeable over experts; the popularity adds
    ``−exponent · log(rank)`` to the logits, the rank of an expert a fixed shuffle of ``1..E``.
    """
    rank = jax.random.permutation(jax.random.PRNGKey(42), num_experts) + 1
    logits = jax.random.normal(key, (tokens, num_experts)) - exponent * jnp.log(rank.astype(jnp.float32))
    _, ids = jax.lax.top_k(logits, top_k)
    w = jnp.take_along_axis(jax.nn.sigmoid(logits), ids, 1)
    return ids, w / w.sum(-1, keepdims=True)


def rank_rows(phys, ep: int, per_rank: int):
    """``(rows [EP, per_rank] each rank receives per local expert, max rows from one source to one rank)``."""
    rows = jnp.bincount(phys.reshape(-1), length=ep * per_rank).reshape(ep, per_rank)
    pair = jax.vmap(lambda p: jnp.bincount(p.reshape(-1) // per_rank, length=ep))(phys)  # [source, dest]
    return rows, int(pair.max())


def layouts(args):
    """Per layout: the slowest rank's rows per local expert, its local expert count and the buffer cap."""
    E, k, _, _, N = args.shape
    ep, R = args.ep, args.replicas
    keys = jax.random.split(jax.random.PRNGKey(args.seed), 2)
    calib, _ = zipf_router(keys[0], ep * N, E, k, args.zipf)
    ids, _ = zipf_router(keys[1], ep * N, E, k, args.zipf)
    loads = jnp.bincount(calib.reshape(-1), length=E).astype(jnp.float32)
    plan = plan_replicas(loads, ep, R)
    per_source = ids.reshape(ep, N, k)
    out = {}
    for name, replicas in (("ep", None), ("moonep", plan)):
        if replicas is None:
            phys, per_rank = per_source, E // ep
        else:
            split = functools.partial(physical_ids, replica_expert=plan[0], replica_share=plan[1], num_experts=E, ep=ep)
            phys, per_rank = jax.vmap(split)(per_source, source=jnp.arange(ep)), E // ep + R // ep
        rows, pair_max = rank_rows(phys, ep, per_rank)
        total = rows.sum(1)
        out[name] = {"rows": np.asarray(rows[int(jnp.argmax(total))]), "experts": per_rank, "pair_max": pair_max,
                     "received_max_mean": float(total.max() / total.mean()),
                     "reserve": pair_max / (N * k / ep) - 1.0}
    planned = planned_rank_loads(loads, *plan, ep)
    out["moonep"]["planned_max_mean"] = float(planned.max() / planned.mean())
    out["moonep"]["replicas_used"] = int(jnp.sum(plan[1] > 0))
    return out


def time_rank(rows, experts: int, buffer: int, args) -> float:
    """Median ms of the rank's grouped expert FFN forward + backward on ``rows`` in a ``buffer``-row buffer."""
    _, _, L, F, _ = args.shape
    dt = jnp.float32 if args.f32 else jnp.bfloat16
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    x = jax.random.normal(keys[0], (buffer, L), dt)
    shapes = [(experts, L, F), (experts, L, F), (experts, F, L)]
    ws = [(0.02 * jax.random.normal(kk, s)).astype(dt) for kk, s in zip(keys[1:], shapes)]
    local = np.full(buffer, experts, np.int32)
    local[: int(rows.sum())] = np.repeat(np.arange(experts), rows)
    local = jnp.asarray(local)[:, None]
    act = functools.partial(gated_activation, activation="situ")
    gmm = functools.partial(grouped_matmul, implementation=args.implementation)

    def loss(x, w1, w3, w2):
        y, _ = _local_experts(x, local, w1, w3, w2, act=act, gmm=gmm)
        return jnp.sum(y.astype(jnp.float32))

    f = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3)))
    jax.block_until_ready(f(x, *ws))
    times = []
    for _ in range(args.iters):
        start = time.perf_counter()
        jax.block_until_ready(f(x, *ws))
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=5, default=[896, 16, 3584, 3072, 4096],
                        metavar=("E", "K", "L", "F", "N"), help="experts, top-k, latent width, expert F, tokens/rank")
    parser.add_argument("--ep", type=int, default=64, help="expert-parallel ranks simulated")
    parser.add_argument("--replicas", type=int, default=128, help="redundant experts R (a multiple of --ep)")
    parser.add_argument("--zipf", type=float, default=0.4, help="popularity exponent on top of the balanced router")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--link-gbs", type=float, default=450.0, help="per-direction GB/s for the a2a estimate")
    parser.add_argument("--implementation", default=None, help="grouped_matmul implementation (None: default)")
    parser.add_argument("--f32", action="store_true", help="float32 (CPU smoke runs)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    E, k, L, F, N = args.shape
    bytes_per = 4 if args.f32 else 2
    results = {"device": jax.devices()[0].device_kind, "shape": dict(E=E, k=k, L=L, F=F, N=N), "ep": args.ep,
               "replicas": args.replicas, "zipf": args.zipf}
    for name, r in layouts(args).items():
        reserve = max(0.0, r["reserve"])
        buffer = args.ep * capacity(N, k, args.ep, reserve)
        experts_ms = time_rank(r["rows"], r["experts"], buffer, args)
        moved = 4 * buffer * L * bytes_per
        if name == "moonep":
            moved += 2 * (args.replicas // args.ep) * 3 * L * F * bytes_per
        a2a_ms = moved / (args.link_gbs * 1e9) * 1e3
        row = {k2: v for k2, v in r.items() if k2 != "rows"}
        row.update(reserve=reserve, buffer_rows=buffer, rows_slowest_rank=int(r["rows"].sum()),
                   experts_ms=experts_ms, a2a_ms_estimated=a2a_ms)
        results[name] = row
        print(f"{name:7s} received max/mean {r['received_max_mean']:.3f}  reserve {reserve:.2f}  buffer {buffer} rows  "
              f"slowest rank {row['rows_slowest_rank']} rows on {r['experts']} experts: experts fwd+bwd "
              f"{experts_ms:.2f} ms, all-to-all ~{a2a_ms:.2f} ms (estimated)", flush=True)
    speedup = (results["ep"]["experts_ms"] + results["ep"]["a2a_ms_estimated"]) / (
        results["moonep"]["experts_ms"] + results["moonep"]["a2a_ms_estimated"])
    results["speedup"] = speedup
    print(f"MoonEP planned max/mean {results['moonep']['planned_max_mean']:.3f} with "
          f"{results['moonep']['replicas_used']} replicas; slowest-rank layer time ratio ep/moonep {speedup:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
