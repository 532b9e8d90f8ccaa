"""KDA's decode step from its packed input projections: XLA's step, XLA's prep with the unfused kernel, and
the fused kernel.

Four paths of one step (``pallas_kernels/kda/reference_decode.py``'s, same arguments and results):

- ``xla``: ``fused_step_reference`` as XLA compiles it — the KDA layer's own decode step (the tests
  show it equal bit for bit): the peer a JAX user has, and the layer's path below ``MIN_STATES``;
- ``unfused``: XLA's prep (convs, norms, β, the decay gate) then ``recurrent_step_pallas`` — the
  layer's path at ``MIN_STATES`` (sequence, head) states or more;
- ``fused``: ``fused_step_pallas``, all of it one kernel, ``f_a · W_fb`` in every program (the layer's
  path below ``MIN_STATES`` with ``decode_glue_implementation`` on);
- ``fused_z``: XLA's matmul makes ``z = f_a · W_fb``, then the fused kernel (the layer's path from
  ``MIN_STATES``, the glue on).

Shapes: ``small()``'s KDA layer (8 heads of 128) at batch 1 (one token, and four as speculative
verification feeds), at batch 64, and K3's 96 heads at batch 1. Each path runs ``--steps`` chained
calls in one ``fori_loop`` (each call continues the state and conv tails the previous one wrote, so
calls cannot overlap and host dispatch drops out), timed interleaved (``timing.timeit_interleaved``).
Prints µs a call, the state bytes a call must read and write over that time, each path's speed-up
over ``xla`` and its largest relative deviation from it. Needs a CUDA GPU (``--interpret``: a CPU smoke
run, kernels interpreted at a few heads):

    PYTHONPATH=$PWD python3 benchmarks/bench_kda_decode.py --out $OUT/bench_kda_decode.json
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

from pallas_kernels.kda.kernel_gpu_decode import fused_step_pallas, recurrent_step_pallas
from pallas_kernels.kda.reference_decode import decay_product, fused_step_reference, prepare

SHAPES = {  # name: (batch, new tokens, heads, head width)
    "small b1": (1, 1, 8, 128),
    "small b1 t4": (1, 4, 8, 128),
    "small b64": (64, 1, 8, 128),
    "k3 b1": (1, 1, 96, 128),
}
W = 4  # conv width


def inputs(B: int, T: int, H: int, K: int, seed: int = 0):
    """``(y, tails, conv weights, f_b, dt_bias, A_log, state, num_new)`` and the static keywords, laid out as
    ``KDA`` hands them to the step (q, k, v, β, f_a, then the output gate's columns)."""
    ks = jax.random.split(jax.random.key(seed), 8)
    N = 4 * H * K + H + K
    y = jax.random.normal(ks[0], (B, T, N)).astype(jnp.bfloat16)
    tails = jax.random.normal(ks[1], (3, B, W - 1, H * K), jnp.float32)
    convs = tuple(0.5 * jax.random.normal(k, (W, H, K)) for k in jax.random.split(ks[2], 3))
    f_b = 0.1 * jax.random.normal(ks[3], (K, H, K))
    dt_bias, a_log = jax.random.normal(ks[4], (H, K)), jax.random.normal(ks[5], (H,))
    state = 0.1 * jax.random.normal(ks[6], (B, H, K, K), jnp.float32)
    static = dict(offsets=(0, H * K, 2 * H * K, 3 * H * K, 3 * H * K + H), scale=K ** -0.5, lower_bound=-5.0,
                  eps=1e-6)
    return (y, tails, convs, f_b, dt_bias, a_log, state, jnp.full((B,), T, jnp.int32)), static


def paths(static: dict, interpret: bool) -> dict:
    """Each path as ``fn(*inputs) -> (o, state, tails)``."""
    def unfused(y, tails, convs, f_b, dt_bias, a_log, state, num_new):
        prep = {k: static[k] for k in ("offsets", "lower_bound", "eps")}
        *qkvgb, tails = prepare(y, tails, convs, f_b, dt_bias, a_log, num_new, **prep)
        o, state = recurrent_step_pallas(*qkvgb, state, scale=static["scale"], interpret=interpret)
        return o, state, tails

    def fused_z(y, tails, convs, f_b, *rest):
        z = decay_product(y, f_b, static["offsets"][4])
        return fused_step_pallas(y, tails, convs, z, *rest, **static, interpret=interpret)

    return {"xla": functools.partial(fused_step_reference, **static), "unfused": unfused,
            "fused": functools.partial(fused_step_pallas, **static, interpret=interpret), "fused_z": fused_z}


def chained(fn, steps: int):
    """``steps`` calls of ``fn`` in one loop, each from the state and tails the previous call wrote."""
    def run(y, tails, convs, f_b, dt_bias, a_log, state, num_new):
        def body(_, carry):
            o, state, tails = carry
            return fn(y, tails, convs, f_b, dt_bias, a_log, state, num_new)

        o0 = jnp.zeros(y.shape[:2] + state.shape[1:2] + state.shape[3:], y.dtype)
        return jax.lax.fori_loop(0, steps, body, (o0, state, tails))

    return jax.jit(run)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {list(SHAPES)}")
    ap.add_argument("--out", default=None)
    ap.add_argument("--interpret", action="store_true", help="CPU smoke run (kernels interpreted, 2 heads of 16)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from benchmarks.timing import timeit_interleaved

    results = {"device": jax.devices()[0].device_kind, "steps": args.steps, "shapes": {}}
    for name in args.shapes.split(","):
        B, T, H, K = SHAPES[name]
        if args.interpret:
            B, H, K = min(B, 2), 2, 16
        xs, static = inputs(B, T, H, K)
        fns = paths(static, args.interpret)
        outs = {p: [np.asarray(a, np.float32) for a in jax.jit(fn)(*xs)[:2]] for p, fn in fns.items()}
        ms = timeit_interleaved({p: (chained(fn, args.steps), xs) for p, fn in fns.items()})
        us = {p: 1e3 * t / args.steps for p, t in ms.items()}
        moved = 2 * B * H * K * K * 4  # the fp32 state, read and written once
        dev = {p: max(float(np.linalg.norm(a - b) / np.linalg.norm(b)) for a, b in zip(outs[p], outs["xla"]))
               for p in fns}
        row = {"batch": B, "tokens": T, "heads": H, "head_dim": K, "us": us, "state_bytes": moved,
               "tb_per_s": {p: moved / (t * 1e-6) / 1e12 for p, t in us.items()},
               "speedup": {p: us["xla"] / t for p, t in us.items()}, "rel_deviation": dev}
        results["shapes"][name] = row
        print(f"{name:12s} B={B:3d} T={T} H={H:3d}: " + ", ".join(
            f"{p} {us[p]:7.2f} us ({row['tb_per_s'][p]:.2f} TB/s, {row['speedup'][p]:.2f}x, dev {dev[p]:.1e})"
            for p in fns), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
