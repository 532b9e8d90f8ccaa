"""What one decode kernel costs on a chain of dependent kernels, against XLA's product on the same chain.

A ``small()`` decode step at batch 1 is a chain of ~99 dependent kernels (``decode_kernels.py``), so what a
kernel costs there is its time from its predecessor's end to its own, not its time alone. Here each op runs
``--layers`` times in a row inside one jitted ``fori_loop`` (``--loops`` turns, compiled with the decode
step's ``DECODE_XLA_OPTIONS``), every call's output the next call's input: the weights are square
(``D × D``), so no other kernel sits between two calls (``bench_mix_matvec.py``'s chain has XLA's update of the
next call's input between them). Each layer's weight is its own buffer: sliced out of one stacked array, XLA
copies the slice before every custom call, and the chain would time the copies (RESULTS.md, stop 63). The
``--layers`` weights together outgrow the L2 from ``D`` = 1024 (64 MB), so every call reads its weights from
HBM, as a step's layers do.

Ops (``--ops``), at each width of ``--widths``:

- ``matvec``: ``mix_matvec.kernel_gpu.mixed_matvec`` at batch 1, a lone source (the RMSNorm, then the product);
  ``matvec_mix3``: the same over a three-source AttnRes mix; ``xla``: XLA's product alone; ``xla_norm``: XLA's
  RMSNorm and product (the path the matvec replaces).
- ``tokens``: ``kernel_gpu_tokens.token_matmul`` at 64 rows; ``xla64``: XLA's GEMM of the same rows.
- ``tma``: the dense decode path's TMA ``down`` kernel (``kernel_gpu_decode_dense_tma``) on 4 experts of
  ``[D, D]`` and 64 rows; ``xla_tma``: XLA's einsum of the same.

Prints µs a kernel and the weights' TB/s (each op's weights over its time). Needs a CUDA GPU:

    PYTHONPATH=$PWD python3 benchmarks/bench_chain.py --out $OUT/chain.json

``--interpret`` is the CPU smoke run: kernels interpreted, 2 layers, 1 turn, outputs checked against XLA's, no
timing.
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

from k3jax.infer.decode import DECODE_XLA_OPTIONS
from pallas_kernels.mix_matvec import kernel_gpu, kernel_gpu_tokens
from pallas_kernels.mix_matvec.reference import mixed_input
from pallas_kernels.moe import kernel_gpu_decode_dense_tma as tma

OPS = ("matvec", "matvec_mix3", "xla", "xla_norm", "tokens", "xla64", "tma", "xla_tma")
TMA_EXPERTS = 4
BF = jnp.bfloat16
EPS = 1e-6


def _matvec(x, w, extra, interpret, mix=False):
    scale, sources, pair = extra
    return kernel_gpu.mixed_matvec((*sources, x) if mix else (x,), pair if mix else (), scale, (w,), mix_eps=EPS,
                                   norm_eps=EPS, dtype=BF, proj_dtype=BF, interpret=interpret)


def op_calls(D: int, interpret: bool) -> dict:
    """``op -> (step(x, w, extra), x, weight shape, extra)``: one chained call each."""
    keys = jax.random.split(jax.random.key(D), 4)
    row = jax.random.normal(keys[0], (1, D), BF)
    rows = jax.random.normal(keys[1], (64, D), BF)
    scale = jnp.ones((D,), BF)
    sources = tuple(jax.random.normal(k, (1, D), BF) for k in jax.random.split(keys[2], 2))
    pair = (jax.random.normal(keys[3], (D,), BF) * 0.1, jnp.ones((D,), BF))
    mv = (scale, sources, pair)
    square, experts = (D, D), (TMA_EXPERTS, D, D)
    return {
        "matvec": (functools.partial(_matvec, interpret=interpret), row, square, mv),
        "matvec_mix3": (functools.partial(_matvec, interpret=interpret, mix=True), row, square, mv),
        "xla": (lambda x, w, _: (x @ w.T).astype(BF), row, square, ()),
        "xla_norm": (lambda x, w, s: (mixed_input((x,), (), EPS, s, EPS, BF) @ w.T).astype(BF), row, square, scale),
        "tokens": (lambda x, w, _: kernel_gpu_tokens.token_matmul(x, (w,), interpret=interpret), rows, square, ()),
        "xla64": (lambda x, w, _: (x @ w.T).astype(BF), rows, square, ()),
        "tma": (lambda x, w, _: tma.down(x, w, interpret=interpret), jnp.broadcast_to(rows, (TMA_EXPERTS, 64, D)),
                experts, ()),
        "xla_tma": (lambda x, w, _: jnp.einsum("etf,efl->etl", x, w).astype(BF),
                    jnp.broadcast_to(rows, (TMA_EXPERTS, 64, D)), experts, ()),
    }


def chained(step, layers: int, loops: int):
    """``loops`` turns of ``layers`` dependent calls of ``step``, layer ``l`` reading weight ``ws[l]``."""
    def run(x, ws, extra):
        def turn(_, y):
            for w in ws:
                y = step(y, w, extra)
            return y
        return jax.lax.fori_loop(0, loops, turn, x)
    return jax.jit(run, compiler_options=DECODE_XLA_OPTIONS)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {OPS}")
    ap.add_argument("--widths", default="512,1024,2048", help="comma-separated D (multiples of 128)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--out", default=None)
    ap.add_argument("--interpret", action="store_true", help="CPU smoke run (D = 128, 2 layers, no timing)")
    args = ap.parse_args(argv)
    ops = args.ops.split(",")
    if unknown := set(ops) - set(OPS):
        raise SystemExit(f"bench_chain: unknown --ops {sorted(unknown)}; choose from {OPS}")
    widths = [128] if args.interpret else [int(d) for d in args.widths.split(",")]
    if bad := [d for d in widths if d <= 0 or d % 128]:
        raise SystemExit(f"bench_chain: --widths must be positive multiples of 128, got {bad}")
    layers, loops = (2, 1) if args.interpret else (args.layers, args.loops)
    sys.path.insert(0, str(Path(__file__).parent))
    from timing import timeit_interleaved

    results = {"device": jax.devices()[0].device_kind, "layers": layers, "loops": loops, "rows": {}}
    for D in widths:
        calls, nbytes = {}, {}
        for name, (step, x, shape, extra) in op_calls(D, args.interpret).items():
            if name not in ops:
                continue
            keys = jax.random.split(jax.random.key(1), layers)
            ws = tuple(jax.random.normal(k, shape, BF) * D ** -0.5 for k in keys)
            calls[name] = (chained(step, layers, loops), (x, ws, extra))
            nbytes[name] = int(np.prod(shape)) * 2
        if args.interpret:  # each kernel's chain against XLA's product of the same chain
            outs = {n: np.asarray(fn(*a), np.float32) for n, (fn, a) in calls.items()}
            for kernel, xla in (("matvec", "xla_norm"), ("tokens", "xla64"), ("tma", "xla_tma")):
                if kernel in outs and xla in outs:
                    np.testing.assert_allclose(outs[kernel], outs[xla], rtol=0.05, atol=0.05)
            results["rows"][str(D)] = {n: {"checked": True} for n in outs}
            continue
        ms = timeit_interleaved(calls, reps=15)
        rows = results["rows"][str(D)] = {}
        for name, t in ms.items():
            us = t * 1e3 / (layers * loops)
            rows[name] = {"us_a_kernel": us, "weight_tb_s": nbytes[name] / us / 1e6}
            print(f"chain D={D:5d} {name:12s} {us:7.2f} us a kernel  {nbytes[name] / us / 1e6:5.2f} TB/s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
