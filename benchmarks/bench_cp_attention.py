"""One context-parallel shard's MLA attention at K3 width on one GPU: key chunks over the latent vs
whole expanded keys.

A shard of context parallel's flash path (``sharding.cp_attention``) holds ``--queries`` queries
at the end of a row of ``S`` keys (the last shard: the most keys to reach) and the row's gathered
latent ``[c, k_rope]``. Two ways to attend (K3: 96 heads, latent 512, nope 128, rope 64, v 128,
bf16; ``--key-chunks`` also times the chunked path at other chunk lengths):

- ``chunked`` (the path): ``sharding.latent_flash.latent_flash``, the flash kernels over key
  chunks expanded one at a time, combined by log-sum-exp;
- ``whole`` (the path before it): every key expanded at once (``bf16[S, 96, 256]``) and one flash
  call at the queries' offset — its memory grows with ``S`` (48 GB per sequence at 1 M keys);
- ``chunked_triton_fwd`` (``--triton-forward``): the chunked path with the Triton forward kernel
  instead of the Mosaic GPU one (float32 partial outputs either way).

Each is checked against the other (output and every gradient) and timed forward and forward +
backward (``grad`` of ``sum(o·w)`` w.r.t. the queries, the latent, the rope key and ``kv_b``),
median of ``--iters`` calls; ``whole`` is skipped where its expanded keys and their gradients
would not fit (``--whole-max``). Prints JSON lines: ms, attention TFLOP/s (causal pairs × heads ×
(q·k + p·v)), the compiler's temporary bytes, and the chunked path's speed-up over whole (whole
ms / chunked ms).

Run on the H200 from the repo root: ``PYTHONPATH=$PWD python3 benchmarks/bench_cp_attention.py``
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp

from benchmarks.bench_attention import time_ms
from pallas_kernels.mla_attention import BlockSizes, mla_attention
from sharding.latent_flash import latent_flash
from tests.tolerances import BF16_FWD_RTOL, BF16_GRAD_RTOL, rel_rmse

H, R, DN, DR, DV = 96, 512, 128, 64, 128
SCALE = (DN + DR) ** -0.5


def inputs(T, S, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    bf = lambda k, shape, s=1.0: (s * jax.random.normal(k, shape)).astype(jnp.bfloat16)
    q = bf(ks[0], (1, T, H, DN + DR))
    c, kr = bf(ks[1], (1, S, R)), bf(ks[2], (1, S, DR))
    kv_b = bf(ks[3], (R, H, DN + DV), R ** -0.5)
    return (q, c, kr, kv_b), jax.random.normal(ks[4], (1, T, H, DV))


def chunked(q, c, kr, kv_b, key_chunk=None, blocks=None):
    S, T = c.shape[1], q.shape[1]
    seg = jnp.zeros((1, S), jnp.int32)
    return latent_flash(q, c, kr, kv_b, seg[:, :T], seg, S - T, scale=SCALE, nope_dim=DN, key_chunk=key_chunk,
                        blocks=blocks)


def whole(q, c, kr, kv_b):
    S, T = c.shape[1], q.shape[1]
    seg = jnp.zeros((1, S), jnp.int32)
    kv = jnp.einsum("BSR,RHK->BSHK", c, kv_b)
    return mla_attention(q[..., :DN], q[..., DN:], kv[..., :DN], kr, kv[..., DN:], seg[:, :T], scale=SCALE,
                         implementation="pallas", q_start=S - T, key_segment_ids=seg)


def programs(fn, w):
    fwd = jax.jit(lambda *a: fn(*a)[0])
    loss = lambda *a: jnp.sum(fn(*a)[0].astype(jnp.float32) * w)
    return fwd, jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


def temp_gb(fn, args):
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--queries", type=int, default=2048, help="a shard's queries (K3 at 1 M tokens, 256 shards, "
                                                             "balanced: 2048 a half)")
    ap.add_argument("--keys", default="65536,262144,1048576", help="S: the row's keys, comma-separated")
    ap.add_argument("--whole-max", type=int, default=262144, help="largest S to run the whole-keys path at")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--key-chunks", default="", help="also time the chunked path at these key chunks (comma list)")
    ap.add_argument("--triton-forward", action="store_true",
                    help="also time the chunked path with the Triton forward (BlockSizes(mosaic_forward=False))")
    a = ap.parse_args()
    T = a.queries
    for S in map(int, a.keys.split(",")):
        args, w = inputs(T, S)
        pairs = T * (S - T) + T * (T + 1) / 2
        flops = {"fwd": 2 * pairs * H * (DN + DR + DV), "fwd_bwd": 2 * pairs * H * (DN + DR + DV) * 3.5}
        ways = {"chunked": chunked} | ({"whole": whole} if S <= a.whole_max else {})
        for k in filter(None, a.key_chunks.split(",")):
            ways[f"chunked{k}"] = functools.partial(chunked, key_chunk=int(k))
        if a.triton_forward:
            ways["chunked_triton_fwd"] = functools.partial(chunked, blocks=BlockSizes(mosaic_forward=False))
        row = {"S": S, "T": T}
        outs = {}
        for name, fn in ways.items():
            fwd, grad = programs(fn, w)
            outs[name] = (fwd(*args), grad(*args))
            for step, prog in (("fwd", fwd), ("fwd_bwd", grad)):
                ms = time_ms(prog, args, a.iters)
                row[f"{name}_{step}_ms"] = round(ms, 3)
                row[f"{name}_{step}_tflops"] = round(flops[step] / ms / 1e9, 1)
            row[f"{name}_temp_gb"] = round(temp_gb(grad, args), 2)
        if "whole" in outs:
            (o, g), (o_w, g_w) = outs["chunked"], outs["whole"]
            row["o_rel"] = rel_rmse(o, o_w)
            row["grad_rel"] = max(rel_rmse(x.astype(jnp.float32), y.astype(jnp.float32)) for x, y in zip(g, g_w))
            assert row["o_rel"] <= BF16_FWD_RTOL and row["grad_rel"] <= BF16_GRAD_RTOL, row
            for step in ("fwd", "fwd_bwd"):
                row[f"chunked_speedup_{step}"] = round(row[f"whole_{step}_ms"] / row[f"chunked_{step}_ms"], 3)
        if a.triton_forward:  # the Mosaic forward's gain in the chunked path (> 1: Mosaic faster)
            for step in ("fwd", "fwd_bwd"):
                row[f"mosaic_over_triton_{step}"] = round(row[f"chunked_triton_fwd_{step}_ms"]
                                                          / row[f"chunked_{step}_ms"], 3)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
