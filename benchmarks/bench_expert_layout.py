"""Would the decode step's expert kernels read faster with W1 / W3 stored output axis first?

Today the gather kernel (batch 1) reads ``W1_e[:, block]`` and ``W3_e[:, block]`` of the model's
``[E, L, F]`` stacks — 32 columns, 64 contiguous bytes of each of L rows — and the dense kernels
(16–256 tokens) read 64-column slabs of W1 / W3 and of W2 ``[E, F, L]``; stop 49 found the same change
worth 0.149 ms a batch-1 step for XLA's products (``decode_layout``'s ``OUTPUT_FIRST``). Here the
kernels read the same blocks from stacks stored ``[E, F, L]`` (W1 and W3, "t13"; every program's block
contiguous) and, for the dense path, also W2 as ``[E, L, F]`` ("t123"), next to the package's kernels on
today's layout (``pallas_kernels/moe/kernel_gpu_decode.py``, ``kernel_gpu_decode_dense.py``) and an XLA
one-pass read of the dense path's bytes (what streaming them can reach). Cold weights, chained calls,
interleaved, as ``bench_moe_decode.py`` times them; outputs checked against the package's kernels.

The variants live here until a measurement decides (RESULTS.md "Stop 52": the device time ran out
before this ran); the winner moves into the kernels and ``decode_layout``, the loser is deleted:

    PYTHONPATH=$PWD python3 benchmarks/bench_expert_layout.py --out $OUT/expert_layout.json
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
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

sys.path.insert(0, str(Path(__file__).parent))
from bench_moe_decode import _inputs, _router_outputs, chained_copies  # noqa: E402  (benchmarks/ on the path)
from k3jax.layers.routing import RENORM_EPS  # noqa: E402
from pallas_kernels.moe import kernel_gpu_decode, kernel_gpu_decode_dense  # noqa: E402
from pallas_kernels.moe.activations import gated_activation  # noqa: E402
from pallas_kernels.moe.kernel_gpu_decode_dense import DenseTiles  # noqa: E402
from pallas_kernels.moe.rank_routing import Routing, slot, token_ranks  # noqa: E402

ACT = dict(activation="situ", situ_beta=4.0, situ_linear_beta=25.0)
f32 = jnp.float32


def _gather_kernel(scores_ref, bias_ref, x_ref, w1_ref, w3_ref, w2_ref, out_ref, weight_ref, *, routing, block_f):
    """``kernel_gpu_decode._kernel`` (routing, prefetch) reading W1 / W3 as ``[E, F, L]`` row blocks."""
    i, j = pl.program_id(0), pl.program_id(1)
    e, weight = slot(*token_ranks(scores_ref, bias_ref, i // routing.top_k, routing), i % routing.top_k)
    weight_ref[...] = weight
    dt = x_ref.dtype
    rows = pl.ds(pl.multiple_of(j * block_f, block_f), block_f)
    w1, w3, w2 = w1_ref[e, rows, :], w3_ref[e, rows, :], w2_ref[e, rows, :]
    h = x_ref[i // routing.top_k, :].astype(f32)  # [L]
    g = jnp.sum(h[None, :] * w1.astype(f32), axis=1).astype(dt)  # [BF]
    u = jnp.sum(h[None, :] * w3.astype(f32), axis=1).astype(dt)
    a = gated_activation(g, u, ACT["activation"], ACT["situ_beta"], ACT["situ_linear_beta"]).astype(dt).astype(f32)
    out_ref[...] = jnp.sum(a[:, None] * w2.astype(f32), axis=0)


def gather_t13(x, scores, bias, w1t, w3t, w2, *, routing, block_f=32, num_warps=4, interpret=False):
    """The gather path (routing in the kernel) from W1 / W3 ``[E, F, L]`` and W2 ``[E, F, L]``."""
    T, L = x.shape
    k, nf = routing.top_k, w1t.shape[1] // block_f
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)
    parts, weights = pl.pallas_call(
        functools.partial(_gather_kernel, routing=routing, block_f=block_f), grid=(T * k, nf),
        in_specs=[whole(a) for a in (scores, bias, x, w1t, w3t, w2)],
        out_specs=[pl.BlockSpec((None, None, L), lambda i, j: (i, j, 0)),
                   pl.BlockSpec((None, None), lambda i, j: (i, j))],
        out_shape=[jax.ShapeDtypeStruct((T * k, nf, L), f32), jax.ShapeDtypeStruct((T * k, nf), f32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1), interpret=interpret,
        name="layout_gather_t13",
    )(scores, bias, x, w1t, w3t, w2)
    return kernel_gpu_decode._combine(parts.reshape(T, k, nf, L), weights[:, 0].reshape(T, k), x.dtype)


def _products_t(a_ref, w_refs, block_k: int) -> list:
    """``a · Wᵀ`` (fp32) for ``[N, K]`` blocks, over ``block_k`` slabs of K: ``kernel_gpu_decode_dense``'s
    products from weights stored output axis first."""
    K = a_ref.shape[1]

    def step(i, accs):
        ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        a = a_ref[:, ks]
        return tuple(acc + jax.lax.dot_general(a, w[:, ks], (((1,), (1,)), ((), ())), preferred_element_type=f32)
                     for acc, w in zip(accs, w_refs))

    zeros = tuple(jnp.zeros((a_ref.shape[0], w.shape[0]), f32) for w in w_refs)
    return list(jax.lax.fori_loop(0, K // block_k, step, zeros))


def _gate_up_t(x_ref, w1_ref, w3_ref, a_ref, *, block_k):
    dt = a_ref.dtype
    g, u = _products_t(x_ref, (w1_ref, w3_ref), block_k)
    a_ref[...] = gated_activation(g.astype(dt), u.astype(dt), ACT["activation"], ACT["situ_beta"],
                                  ACT["situ_linear_beta"]).astype(dt)


def _down_t(a_ref, w2_ref, y_ref, *, block_k):
    (y,) = _products_t(a_ref, (w2_ref,), block_k)
    y_ref[...] = y.astype(y_ref.dtype)


def _call_t(kernel, a, w, bt, tiles, interpret, name, *more_w):
    """``kernel_gpu_decode_dense._call`` for weights ``[E, N, K]``: grid (token block, expert, column
    block); ``a`` ``[Tp, K]`` (shared) or ``[E, Tp, K]``; output ``[E, Tp, N]``."""
    E, N, K = w.shape
    Tp, bn = a.shape[-2], tiles.block_n
    a_spec = (pl.BlockSpec((bt, K), lambda t, e, j: (t, 0)) if a.ndim == 2
              else pl.BlockSpec((None, bt, K), lambda t, e, j: (e, t, 0)))
    return pl.pallas_call(
        kernel, grid=(Tp // bt, E, N // bn),
        in_specs=[a_spec] + [pl.BlockSpec((None, bn, K), lambda t, e, j: (e, j, 0))] * (1 + len(more_w)),
        out_specs=pl.BlockSpec((None, bt, bn), lambda t, e, j: (e, t, j)),
        out_shape=jax.ShapeDtypeStruct((E, Tp, N), a.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret, name=name,
    )(a, w, *more_w)


def dense_t1x(x, scores, bias, w1t, w3t, w2, *, routing, w2_output_first: bool, tiles=DenseTiles(), interpret=False):
    """The dense path from W1 / W3 ``[E, F, L]`` and W2 ``[E, L, F]`` (t123) or ``[E, F, L]`` (t13: the
    package's down kernel)."""
    T = x.shape[0]
    bt = kernel_gpu_decode_dense._token_block(T, tiles)
    xp = jnp.pad(x, ((0, -(-T // bt) * bt - T), (0, 0)))
    a = _call_t(functools.partial(_gate_up_t, block_k=tiles.block_k), xp, w1t, bt, tiles, interpret,
                "layout_gate_up_t", w3t)
    if w2_output_first:
        y = _call_t(functools.partial(_down_t, block_k=tiles.block_k), a, w2, bt, tiles, interpret, "layout_down_t")
    else:
        down = functools.partial(kernel_gpu_decode_dense._down_kernel, block_k=tiles.block_k)
        y = kernel_gpu_decode_dense._call(down, a, w2, w2.shape[2], bt, tiles, interpret, "moe_decode_dense_down")
    return kernel_gpu_decode_dense.routed_combine(y[:, :T], scores, bias, routing=routing, tiles=tiles,
                                                  interpret=interpret)


def xla_read(x, scores, bias, w1, w3, w2, **_):
    """XLA reading every byte of the three stacks once (a sum): the streaming rate to compare with."""
    s = sum(jnp.sum(w.astype(f32)) for w in (w1, w3, w2))
    return (x.astype(f32) + 1e-30 * s).astype(x.dtype)


def variants(path: str, routing: Routing, interpret: bool) -> dict:
    """``{name: (fn, layout)}``; layout ``plain`` (today), ``t13`` or ``t123`` (which stacks are swapped)."""
    kw = dict(routing=routing, interpret=interpret)
    wide = kernel_gpu_decode_dense.WIDE
    if path == "gather":
        return {"today bf=32 w=4": (functools.partial(kernel_gpu_decode.routed_experts_pallas, **ACT, **kw), "plain"),
                "t13 bf=32 w=4": (functools.partial(gather_t13, **kw), "t13"),
                "t13 bf=32 w=8": (functools.partial(gather_t13, num_warps=8, **kw), "t13")}
    today = functools.partial(kernel_gpu_decode_dense.routed_dense_experts_pallas, **ACT, **kw)
    return {"today n=64 w=4": (functools.partial(today, tiles=DenseTiles()), "plain"),
            "today n=128 w=8 (default)": (functools.partial(today, tiles=wide), "plain"),
            "t123 n=64 w=4": (functools.partial(dense_t1x, w2_output_first=True, **kw), "t123"),
            "t123 n=128 w=8": (functools.partial(dense_t1x, w2_output_first=True, tiles=wide, **kw), "t123"),
            "t13 n=64 w=4": (functools.partial(dense_t1x, w2_output_first=False, **kw), "t13"),
            "t13 n=128 w=8": (functools.partial(dense_t1x, w2_output_first=False, tiles=wide, **kw), "t13"),
            "xla read of the bytes": (xla_read, "plain")}


def laid_out(ws: list, layout: str) -> list:
    """The stacks ``[W1, W3, W2]`` in ``layout``: ``t13`` swaps W1 / W3 to ``[E, F, L]``, ``t123`` all three."""
    swap = {"plain": (), "t13": (0, 1), "t123": (0, 1, 2)}[layout]
    return [jnp.swapaxes(w, 1, 2) if i in swap else w for i, w in enumerate(ws)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", choices=("gather", "dense", "both"), default="both")
    ap.add_argument("--experts", default="64,512,512,8", help="E,L,F,k (default: small()'s routed experts)")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--out", default=None)
    ap.add_argument("--interpret", action="store_true", help="CPU smoke run (kernels interpreted, 2 steps)")
    args = ap.parse_args(argv)
    from benchmarks.timing import timeit_interleaved

    E, L, F, k = (int(v) for v in args.experts.split(","))
    routing = Routing(k, True, 1.0, RENORM_EPS)
    results = {"device": jax.devices()[0].device_kind, "experts": [E, L, F, k]}
    for path in (("gather", "dense") if args.path == "both" else (args.path,)):
        T = 1 if path == "gather" else 64
        x, ws = _inputs(T, E, L, F)
        scores, bias = _router_outputs(T, E)
        fns = variants(path, routing, args.interpret)
        outs = {n: np.asarray(jax.jit(fn)(x, scores, bias, *laid_out(ws, lay)), f32) for n, (fn, lay) in fns.items()}
        ref = outs[next(iter(outs))]
        moved = 3 * (E if path == "dense" else k) * L * F * 2  # weight bytes a call reads
        copies = 1 if args.interpret else min(32, max(1, -(-200_000_000 // (3 * E * L * F * 2))))
        steps = 2 if args.interpret else -(-args.steps // copies) * copies
        calls = {}
        for n, (fn, lay) in fns.items():
            sets = [w for _ in range(copies) for w in laid_out([jnp.array(w, copy=True) for w in ws], lay)]
            calls[n] = (chained_copies(fn, steps, copies), (x, scores, bias, *sets))
        ms = timeit_interleaved(calls, **(dict(reps=1, warmup=0, min_ms=0.0) if args.interpret else {}))
        rows = results[path] = {}
        for n in fns:
            us = 1e3 * ms[n] / steps
            ulp = float(np.abs(outs[n] - ref).max() / (2.0 ** -7 * np.abs(ref).max()))
            rows[n] = {"us_per_call": us, "tb_per_s": moved / us / 1e6, "max_diff_ulp": ulp}
            print(f"{path:6s} {n:28s} {us:8.2f} us   {moved / us / 1e6:5.2f} TB/s   diff vs today {ulp:.2f} ulp",
                  flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
