"""Greedy decoding's head: XLA's logits + argmax against the fused kernel (``pallas_kernels.head_argmax``).

At ``small()``'s head (D 1024, V 163840: 335 MB of bf16 weights, cold in every call: the L2 holds 50 MB),
for each batch of ``--batches``, times ``--steps`` chained calls in one ``fori_loop`` (the next call's rows
are scaled by a test on this call's tokens, so calls cannot overlap and host dispatch drops out),
interleaved (``timing.timeit_interleaved``):
- ``xla``: the model's head einsum (float32 logits) and ``jnp.argmax``, as decoding ran it (the peer);
- ``kernel``: ``kernel_gpu.greedy_head`` at its default tiles, and each of ``--tiles``
  (``V<block_v>D<block_d>S<stages>W<warps>``, e.g. ``V256D64S4W8``).
Prints µs a call, the weights' TB/s, XLA's time over each kernel's, and the share of rows whose token
equals XLA's (random weights: a near-tie within float32 rounding could differ). Needs a CUDA GPU
(``--interpret``: a CPU smoke run at toy sizes):

    PYTHONPATH=$PWD python3 benchmarks/bench_greedy_head.py --out $OUT/bench_greedy_head.json
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.timing import timeit_interleaved  # noqa: E402
from pallas_kernels.head_argmax.kernel_gpu import HeadTiles, default_tiles, greedy_head  # noqa: E402
from pallas_kernels.head_argmax.reference import greedy_tokens  # noqa: E402


def parse_tiles(spec: str) -> HeadTiles:
    """``V<block_v>D<block_d>S<stages>W<warps>`` -> ``HeadTiles`` (``ValueError`` naming a malformed one)."""
    m = re.fullmatch(r"V(\d+)D(\d+)S(\d+)W(\d+)", spec)
    if not m:
        raise ValueError(f"--tiles entry {spec!r} must read V<block_v>D<block_d>S<stages>W<warps>, e.g. V128D64S4W4")
    v, d, s, w = map(int, m.groups())
    return HeadTiles(block_v=v, block_d=d, num_stages=s, num_warps=w)


def chained(head, steps: int):
    """``steps`` dependent calls of ``head(x, w) -> tokens``; returns the last tokens."""
    def run(x, w):
        def body(_, carry):
            x, tok = carry
            tok = head(x, w)
            return x * (1 + (tok[:, None] == -1)).astype(x.dtype), tok  # a test XLA cannot fold
        return jax.lax.fori_loop(0, steps, body, (x, jnp.zeros((x.shape[0],), jnp.int32)))[1]
    return jax.jit(run)


def bench(batch: int, D: int, V: int, steps: int, tiles: dict[str, HeadTiles], interpret: bool = False) -> list[dict]:
    kx, kw = jax.random.split(jax.random.key(batch))
    x = jax.random.normal(kx, (batch, D), jnp.bfloat16)
    w = (jax.random.normal(kw, (D, V), jnp.float32) * D ** -0.5).astype(jnp.bfloat16)
    heads = {"xla": greedy_tokens, **{name: functools.partial(greedy_head, tiles=t, interpret=interpret)
                                     for name, t in tiles.items()}}
    calls = {name: (chained(h, steps), (x, w)) for name, h in heads.items()}
    ms = timeit_interleaved(calls, reps=10, warmup=1, min_ms=50.0)
    ref = np.asarray(greedy_tokens(x, w))
    rows = []
    for name, head in heads.items():
        us = ms[name] * 1e3 / steps
        rows.append({"batch": batch, "head": name, "us": us, "weight_tbps": D * V * 2 / us / 1e6,
                     "xla_over_this": ms["xla"] / ms[name],
                     "same_tokens": float(np.mean(np.asarray(jax.jit(head)(x, w)) == ref))})
        print(f"batch {batch:3d}  {name:14s} {us:8.2f} us  {rows[-1]['weight_tbps']:5.2f} TB/s  "
              f"xla/this {rows[-1]['xla_over_this']:5.3f}  same tokens {rows[-1]['same_tokens']:.3f}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--tiles", default="", help="comma list of extra tilings, V<block_v>D<block_d>S<stages>W<warps>")
    ap.add_argument("--out", default=None)
    ap.add_argument("--interpret", action="store_true", help="CPU smoke run of the script (kernel interpreted)")
    a = ap.parse_args(argv)
    tiles = {"kernel": default_tiles(a.vocab), **{s: parse_tiles(s) for s in a.tiles.split(",") if s}}
    rows = [r for b in map(int, a.batches.split(",")) for r in bench(b, a.hidden, a.vocab, a.steps, tiles, a.interpret)]
    if a.out:
        Path(a.out).write_text(json.dumps({"device": jax.devices()[0].device_kind, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
