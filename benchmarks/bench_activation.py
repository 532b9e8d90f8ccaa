"""The gated activations on one GPU: XLA's fusion of the jnp forms (the peer) against the Pallas-Triton pass.

    PYTHONPATH=. python3 benchmarks/bench_activation.py --out $OUT/activation.json
    PYTHONPATH=. python3 benchmarks/bench_activation.py --interpret --split 64x256 --packed 64x256 --reps 1  # CPU

Both sides run through the ops the model calls, ``implementation="xla"`` against ``"pallas"``
(``pallas_kernels/moe/activations.py``): ``split_gated_activation`` at K3's routed-expert shape
(``[131072, 3072]``: 8 K tokens × top-16 on one rank of 16-way expert parallelism, as
``bench_layer.py``) and its shared experts' (``[8192, 6144]``), ``packed_gated_activation`` at small()'s
(``[262144, 2 × 512]``: 8 × 4096 tokens × top-8, the trainer's ``[W1 | W3]`` product). Per case: the
forward as training runs it (``jax.vjp``'s forward, with the packed form's stored derivatives) and
the backward (split: the derivatives recomputed from ``g``, ``u``; packed: the stored derivatives
times the cotangent, forward included), bf16, timed interleaved in this process; beside them the
bytes floor (an XLA fusion of the same reads and writes with one multiply each) and the relative RMS
of the pass against XLA.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmarks.timing import timeit_interleaved  # noqa: E402
from pallas_kernels.moe.activations import packed_gated_activation, split_gated_activation  # noqa: E402
from tests.tolerances import rel_rmse  # noqa: E402


def _shape(text: str) -> tuple[int, int]:
    rows, cols = (int(x) for x in text.lower().split("x"))
    return rows, cols


def programs(op: str, rows: int, cols: int, activation: str, interpret: bool):
    """``(calls, check)``: ``{name: (compiled fn, args)}`` for xla / pallas forward and backward and
    the bytes floor, and ``check()`` -> relative RMS of the pass against XLA, per output."""
    k1, k2, k3 = jax.random.split(jax.random.key(rows * cols), 3)
    width = 2 * cols if op == "packed" else cols
    draw = lambda k, w, s: (jax.random.normal(k, (rows, w)) * s).astype(jnp.bfloat16)
    x = (draw(k1, width, 3.0),) if op == "packed" else (draw(k1, cols, 3.0), draw(k2, cols, 3.0))
    da = draw(k3, cols, 1.0)
    calls, outs = {}, {}
    for impl in ("xla", "pallas"):
        if op == "packed":
            f = lambda gu, impl=impl: packed_gated_activation(gu, activation, 4.0, 25.0, None, impl, interpret)
        else:
            f = lambda g, u, impl=impl: split_gated_activation(g, u, activation, 4.0, 25.0, None, impl, interpret)
        if op == "packed":  # the forward as training keeps it: the output and the stored derivatives
            # (returning only the output would let XLA drop the derivatives it has not written yet)
            fwd = jax.jit(lambda *a, f=f: (lambda out, vjp: (out, jax.tree.leaves(vjp)))(*jax.vjp(f, *a)))
        else:
            fwd = jax.jit(lambda *a, f=f: jax.vjp(f, *a)[0])
        bwd = jax.jit(lambda *a, f=f: jax.vjp(f, *a[:-1])[1](a[-1]))
        calls[f"{impl} forward"], calls[f"{impl} backward"] = (fwd, x), (bwd, x + (da,))
        outs[impl] = (jax.tree.leaves(fwd(*x))[0], *bwd(*x, da))
    if op == "packed":  # floor: read [g | u], write a and the two derivatives; read those and da, write [dg | du]
        floor_f = jax.jit(lambda gu: (gu[:, :cols] * gu[:, cols:],) * 3)
        floor_b = jax.jit(lambda gu, da: jnp.concatenate([da * gu[:, :cols], da * gu[:, cols:]], axis=1))
    else:
        floor_f = jax.jit(lambda g, u: g * u)
        floor_b = jax.jit(lambda g, u, da: (da * g, da * u))
    calls["floor forward"], calls["floor backward"] = (floor_f, x), (floor_b, x + (da,))
    return calls, lambda: [rel_rmse(a, b) for a, b in zip(outs["pallas"], outs["xla"])]


def run(op: str, rows: int, cols: int, activation: str, reps: int, interpret: bool) -> dict:
    calls, check = programs(op, rows, cols, activation, interpret)
    ms = timeit_interleaved(calls, reps=reps, min_ms=5.0 if reps > 1 else 0.0)
    row = {"op": op, "rows": rows, "cols": cols, "activation": activation, "ms": ms, "rel_rmse": check()}
    for d in ("forward", "backward"):
        row[f"{d}_speedup"] = ms[f"xla {d}"] / ms[f"pallas {d}"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--split", default="131072x3072,8192x6144", help="ROWSxF shapes of split_gated_activation")
    p.add_argument("--packed", default="262144x512", help="ROWSxF shapes of packed_gated_activation ([ROWS, 2F])")
    p.add_argument("--activation", default="situ", choices=("situ", "swiglu"))
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--interpret", action="store_true", help="run the pass in the CPU interpreter (a smoke run)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    cases = [("split", *_shape(s)) for s in a.split.split(",") if s] + \
            [("packed", *_shape(s)) for s in a.packed.split(",") if s]
    rows = [run(op, r, c, a.activation, a.reps, a.interpret) for op, r, c in cases]
    print(f"{jax.devices()[0].device_kind}, {a.activation}, bf16, ms (XLA / pass = speed-up)")
    print("| op | [rows, F] | direction | XLA | pass | speed-up | bytes floor | rel. RMS vs XLA |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        for d in ("forward", "backward"):
            ms = r["ms"]
            print(f"| {r['op']} | [{r['rows']}, {r['cols']}] | {d} | {ms[f'xla {d}']:.3f} | {ms[f'pallas {d}']:.3f} | "
                  f"{r[f'{d}_speedup']:.2f}x | {ms[f'floor {d}']:.3f} | {max(r['rel_rmse']):.1e} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "cases": rows}, f, indent=1)


if __name__ == "__main__":
    main()
