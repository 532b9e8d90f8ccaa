"""MLA's decode attention over the compressed cache: XLA's absorbed attention against the Pallas kernel.

Times ``pallas_kernels.mla_attention.cached_attention`` with ``implementation="xla"`` (the reference,
as XLA compiles it: the peer a JAX user has) and ``"pallas"`` (``kernel_gpu_decode``) at decode shapes:
``small()`` (8 heads, a 256 + 64 latent) at batch 1 and 64 after a ``--prompt``-token prompt, and K3's
widths (96 heads, 512 + 64) at batch 1 and 8 over a 32 K cache. Each op runs as ``--steps`` chained
calls in one ``fori_loop`` (the next call's absorbed query is this call's output, so calls cannot
overlap and host dispatch drops out), timed interleaved (``timing.timeit_interleaved``). Prints µs a
call, the cache bytes a call must read (rows up to each query's position) over that time, the kernel's
speed-up, and its largest relative deviation from the reference. Needs a CUDA GPU:

    PYTHONPATH=$PWD python3 benchmarks/bench_mla_decode.py --out $OUT/bench_mla_decode.json
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

from pallas_kernels.mla_attention import cached_attention

SHAPES = {  # name: (batch, heads, latent width R, rope width dr, cache length S, prompt)
    "small b1": (1, 8, 256, 64, None, None),
    "small b64": (64, 8, 256, 64, None, None),
    "k3 b1": (1, 96, 512, 64, 32768, 32000),
    "k3 b8": (8, 96, 512, 64, 32768, 32000),
}


def _inputs(B, H, R, dr, S, prompt, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    q_c = jax.random.normal(ks[0], (B, 1, H, R)) * 0.05
    q_r = jax.random.normal(ks[1], (B, 1, H, dr)) * 0.05
    latent = jax.random.normal(ks[2], (B, S, R + dr)).astype(jnp.bfloat16)
    last = (prompt + jnp.arange(B, dtype=jnp.int32) % 64)[:, None]  # [B, 1]: rows a little apart
    return q_c, q_r, latent, last


def chained(fn, steps: int):
    """``steps`` calls of ``fn(q_c, ...)`` in one loop, each on the previous output."""
    return jax.jit(lambda q, *rest: jax.lax.fori_loop(0, steps, lambda _, h: fn(h, *rest), q))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=1024, help="small()'s prompt (its cache holds 64 more rows)")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {list(SHAPES)}")
    ap.add_argument("--out", default=None)
    ap.add_argument("--interpret", action="store_true", help="CPU smoke run (kernel interpreted, tiny cache)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from benchmarks.timing import timeit_interleaved

    results = {"device": jax.devices()[0].device_kind, "steps": args.steps, "shapes": {}}
    for name in args.shapes.split(","):
        B, H, R, dr, S, prompt = SHAPES[name]
        prompt = prompt or args.prompt
        S = S or prompt + 65
        if args.interpret:
            B, S, prompt = min(B, 2), 96, 40
        q_c, q_r, latent, last = _inputs(B, H, R, dr, S, prompt)
        scale = (128 + dr) ** -0.5
        fns = {impl: functools.partial(cached_attention, scale=scale, implementation=impl, interpret=args.interpret)
               for impl in ("xla", "pallas")}
        outs = {impl: np.asarray(jax.jit(fn)(q_c, q_r, latent, last)) for impl, fn in fns.items()}
        calls = {impl: (chained(fn, args.steps), (q_c, q_r, latent, last)) for impl, fn in fns.items()}
        ms = timeit_interleaved(calls)
        us = {impl: 1e3 * t / args.steps for impl, t in ms.items()}
        read = int(np.sum(np.asarray(last) + 1)) * (R + dr) * latent.dtype.itemsize
        dev = float(np.linalg.norm(outs["pallas"] - outs["xla"]) / np.linalg.norm(outs["xla"]))
        row = {"batch": B, "heads": H, "latent": R, "rope": dr, "cache": S, "us": us, "bytes_read": read,
               "tb_per_s": {impl: read / (t * 1e-6) / 1e12 for impl, t in us.items()},
               "speedup": us["xla"] / us["pallas"], "rel_deviation": dev}
        results["shapes"][name] = row
        print(f"{name:10s} B={B:3d} H={H:3d} S={S:6d}: xla {us['xla']:8.2f} us ({row['tb_per_s']['xla']:.2f} TB/s), "
              f"pallas {us['pallas']:8.2f} us ({row['tb_per_s']['pallas']:.2f} TB/s): {row['speedup']:.2f}x; "
              f"relative deviation {dev:.1e}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
