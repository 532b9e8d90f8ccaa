"""The routed experts of one decode step, XLA against the Pallas kernels, on either decode path.

Both paths start from the router's scores, as a decode step's MoE calls them
(``moe_decode.routed_experts``), at ``small()``'s experts (k=8, E=64, L=F=512, bf16), with
``implementation="xla"`` (XLA's route and experts), XLA's route then the path's kernels given the ids
(the step of stops 37-50), and the kernels that route each token themselves (the default) at
several tilings. ``--path gather`` (batch 1, the default): ``pallas_kernels/moe/kernel_gpu_decode.py``
at several ``DecodeTiles`` (``block_f``, ``num_warps``, ``prefetch``). ``--path dense`` (``--tokens
64`` by default; every expert on every token): the two kernels of
``pallas_kernels/moe/kernel_gpu_decode_dense.py`` and its routing combine at
several ``DenseTiles``, the Mosaic GPU kernels of ``kernel_gpu_decode_dense_tma`` (the default where they
take the shapes) at several ``TmaTiles``, and XLA reading the same weight bytes once (a sum: the
streaming rate; stop 55 also timed the training forward's grouped matmul here: 0.84x XLA). Each
variant runs as ``--steps`` chained calls in one ``fori_loop`` (the next call's x is this call's
output, so calls cannot overlap and host dispatch drops out) cycling through
``--copies`` weight sets, by default enough that every call reads its weights from HBM as a decode
step's layers do (stop 38's one-layer timings reused one set, partly resident in the 50 MB L2, and
ranked the fused MoE layer ahead where the step ranked it behind), timed interleaved
(``timing.timeit_interleaved``), and is first checked against the XLA path (max |difference| in bf16
ulps of the output's largest element); printed with its speed-up over XLA and the weight bytes it reads
per µs. Needs a CUDA GPU:

    PYTHONPATH=$PWD python3 benchmarks/bench_moe_decode.py --out $OUT/bench_moe_decode.json
    PYTHONPATH=$PWD python3 benchmarks/bench_moe_decode.py --path dense --out $OUT/bench_moe_dense.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.layers import moe_decode
from k3jax.layers.routing import RENORM_EPS, route
from pallas_kernels.moe.kernel_gpu_decode import DecodeTiles, gathered_experts_pallas, routed_experts_pallas
from pallas_kernels.moe import kernel_gpu_decode_dense_tma
from pallas_kernels.moe.kernel_gpu_decode_dense import (WIDE, DenseTiles, dense_experts_pallas, routed_combine,
                                                       routed_dense_experts_pallas)
from pallas_kernels.moe.rank_routing import Routing

TILES = [DecodeTiles(32, 4), DecodeTiles(32, 8), DecodeTiles(16, 4), DecodeTiles(64, 8),
         DecodeTiles(32, 4, prefetch=False), DecodeTiles(32, 8, prefetch=False), DecodeTiles(16, 4, prefetch=False)]
# WIDE: the Triton kernels' default at small()'s widths (one-wave 256-column tilings lost, RESULTS.md stop 55)
DENSE_TILES = [WIDE, DenseTiles(), DenseTiles(block_k=128), DenseTiles(block_n=32), DenseTiles(num_stages=4),
               DenseTiles(block_k=128, num_stages=2)]
TMA_TILES = [kernel_gpu_decode_dense_tma.TmaTiles(*t) for t in ((128, 64, 2), (64, 64, 4), (64, 64, 5))]
E, L, F, K = 64, 512, 512, 8  # small()'s routed experts
READ = "xla read of the bytes"


def _inputs(T, E, L, F, seed=0):
    """The experts' input ``x [T, L]`` and bf16 weights ``w1, w3 [E, L, F]``, ``w2 [E, F, L]``."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(T, L)), jnp.bfloat16)
    ws = [jnp.asarray(rng.normal(size=s) * L ** -0.5, jnp.bfloat16) for s in ((E, L, F), (E, L, F), (E, F, L))]
    return x, ws


def _router_outputs(T, E, seed=0):
    """The router's ``scores [T, E]`` (sigmoid outputs) and a balancing ``bias [E]``."""
    rng = np.random.default_rng(seed)
    scores = jax.nn.sigmoid(jnp.asarray(rng.normal(size=(T, E)), jnp.float32))
    return scores, jnp.asarray(rng.normal(size=E) * 0.05, jnp.float32)


def _route_then_kernel(x, scores, bias, *ws, path, activation, interpret=False):
    """XLA's route, then the path's kernels given the ids (the decode step of stops 37-50)."""
    ids, weights = route(scores, bias, K, renormalize=True, scaling=1.0, with_stats=False)
    kernel = gathered_experts_pallas if path == "gather" else dense_experts_pallas
    return kernel(x, ids, weights, *ws, activation=activation, interpret=interpret)


def tma_dense(x, scores, bias, w1, w3, w2, *, routing, activation, tiles, interpret=False):
    """The dense path's products by the Mosaic GPU kernels (``kernel_gpu_decode_dense_tma``), then the
    routing combine."""
    y = kernel_gpu_decode_dense_tma.expert_outputs(x, w1, w3, w2, activation=activation, tiles=tiles,
                                                   interpret=interpret)
    return routed_combine(y, scores, bias, routing=routing, interpret=interpret)


def xla_read(x, scores, bias, w1, w3, w2):
    """XLA reading every byte of the three stacks once (a sum; output x): the streaming rate the dense
    path's kernels compare with (stop 54, H100: 43.3 µs for small()'s 100 MB, 2.3 TB/s)."""
    s = sum(jnp.sum(w.astype(jnp.float32)) for w in (w1, w3, w2))
    return (x.astype(jnp.float32) + 1e-30 * s).astype(x.dtype)


def chained_copies(fn, steps: int, copies: int):
    """``steps`` calls of ``fn(x, ...)`` in one loop, each on the previous output, each loop iteration
    calling ``fn`` once on each of ``copies`` weight sets ``(w1, w3, w2)`` in turn (``steps`` a
    multiple of ``copies``): with more weight bytes between two reads of one set than the GPU's L2
    holds, every call reads its weights from HBM, as each MoE layer of a decode step does."""
    def run(x, scores, bias, *ws):
        def body(_, h):
            for c in range(copies):
                h = fn(h, scores, bias, *ws[3 * c:3 * c + 3])
            return h
        return jax.lax.fori_loop(0, steps // copies, body, x)
    return jax.jit(run)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", choices=("gather", "dense"), default="gather")
    ap.add_argument("--tokens", type=int, default=None, help="default: 1 (gather), 64 (dense)")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--copies", type=int, default=None,
                    help="weight sets cycled through (default: enough that one loop iteration reads >= 200 MB, "
                         "four times the H200's L2, at most 32: cold weights, as in a decode step); 1: the same "
                         "weights every call, mostly L2-resident")
    ap.add_argument("--activation", default="situ")
    ap.add_argument("--out", default=None)
    ap.add_argument("--interpret", action="store_true", help="CPU smoke run of the script (kernel interpreted)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from benchmarks.timing import timeit_interleaved

    tokens = args.tokens or (1 if args.path == "gather" else 64)
    x, ws = _inputs(tokens, E, L, F)
    scores, bias = _router_outputs(tokens, E)  # each call routes, as the decode step's MoE does
    act = dict(activation=args.activation)
    routing = Routing(K, True, 1.0, RENORM_EPS)
    fns = {"xla": functools.partial(moe_decode.routed_experts, path=args.path, top_k=K, renormalize=True,
                                    scaling=1.0, **act, implementation="xla"),
           "pallas, xla route": functools.partial(_route_then_kernel, path=args.path, **act,
                                                  interpret=args.interpret)}
    if args.path == "gather":
        for t in TILES:
            fns[f"pallas bf={t.block_f} warps={t.num_warps}{'' if t.prefetch else ' in place'}"] = functools.partial(
                routed_experts_pallas, routing=routing, **act, tiles=t, interpret=args.interpret)
        ids = route(scores, bias, K, renormalize=True, scaling=1.0, with_stats=False)[0]
        weight_bytes = 3 * len(np.unique(np.asarray(ids))) * L * F * 2
    else:
        for t in DENSE_TILES:
            name = f"pallas t={t.block_t} n={t.block_n} k={t.block_k} w={t.num_warps} s={t.num_stages}"
            fns[name] = functools.partial(routed_dense_experts_pallas, routing=routing, **act, tiles=t,
                                          interpret=args.interpret)
        for t in TMA_TILES:
            fns[f"tma n={t.tile_n} k={t.tile_k} s={t.stages}"] = functools.partial(
                tma_dense, routing=routing, **act, tiles=t, interpret=args.interpret)
        weight_bytes = 3 * E * L * F * 2
    outs = {name: np.asarray(jax.jit(fn)(x, scores, bias, *ws), np.float32) for name, fn in fns.items()}
    if args.path == "dense":  # a rate to compare with, not an output (its check is left out)
        fns[READ] = xla_read
    copies = args.copies or min(32, max(1, -(-200_000_000 // weight_bytes)))
    steps = -(-args.steps // copies) * copies
    sets = [w if c == 0 else jnp.array(w, copy=True) for c in range(copies) for w in ws]  # buffers of their own
    calls = {name: (chained_copies(fn, steps, copies), (x, scores, bias, *sets)) for name, fn in fns.items()}
    results = {"device": jax.devices()[0].device_kind, "path": args.path, "tokens": tokens, "steps": steps,
               "copies": copies, "weight_bytes": weight_bytes}
    return report(results, outs, timeit_interleaved(calls), steps, "us_per_call", args.out)


def report(results: dict, outs: dict, ms: dict, steps: int, key: str, out: str | None) -> int:
    """Each variant's largest deviation from ``outs["xla"]`` in bf16 ulps of ``max|y|`` and its time
    per call (``ms`` per ``steps`` calls) into ``results`` (``check``, ``key``), printed and written
    to ``out``; 0 (the exit status)."""
    ref = outs["xla"]
    results["check"] = {n: float(np.abs(o - ref).max() / (2.0 ** -7 * np.abs(ref).max())) for n, o in outs.items()}
    results[key] = {n: 1e3 * t / steps for n, t in ms.items()}
    us = results[key]
    results["speedup_over_xla"] = {n: us["xla"] / us[n] for n in us}
    for n in us:
        check = f"max diff vs xla {results['check'][n]:.2f} ulp(max|y|)" if n in outs else "(a read, no output)"
        rate = f"   {results['weight_bytes'] / us[n] / 1e6:5.2f} TB/s of weights" if "weight_bytes" in results else ""
        print(f"{n:44s} {us[n]:8.2f} us   {results['speedup_over_xla'][n]:5.2f}x xla{rate}   {check}", flush=True)
    if out:
        Path(out).write_text(json.dumps(results, indent=1))
    return 0

if __name__ == "__main__":
    sys.exit(main())
