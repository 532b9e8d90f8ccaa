"""The fused output head + cross-entropy of training (``k3jax.train.loss.head_cross_entropy``) on one GPU.

At ``small()``'s train-step size (8 × 4096 tokens, D = 1024, V = 163840, 4096-token chunks) it
times the loss with its gradients (``value_and_grad`` w.r.t. features and head) for:
  - ``fp32``: the default (fp32 logits; the logsumexp's max and sum passes, the softmax − onehot pass);
  - ``bf16``: ``logits_dtype="bfloat16"`` (the matmul stores bf16 logits; every pass moves half);
  - ``matmuls``: the same chunk loop with the three matmuls alone, the logits matmul writing bf16
    that the other two read directly (the floor: no elementwise pass).
Each variant's extra time over ``matmuls`` is the price of its elementwise passes; the GB/s column
divides the bytes those passes move (three reads of the logits and the bf16 gradient's write; the
matmul's wider fp32 write hides under its compute) by that extra time. Before timing, ``bf16``'s loss and gradients are compared with ``fp32``'s.

Run on the H200 from the repo root: ``PYTHONPATH=$PWD python3 benchmarks/bench_loss.py``
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from benchmarks.bench_moe import rel, timeit
from k3jax.train import loss


def matmuls_only(features, head, labels, mask, chunk):
    """The loss's chunk loop with its three matmuls and no elementwise pass: the floor."""
    fs, _, _, _ = loss._flat_chunks(features, labels, mask, chunk)
    w = head.astype(features.dtype)

    def one(d_head, f):
        d_logits = jnp.einsum("CD,DV->CV", f, w, preferred_element_type=features.dtype)
        d_f = jnp.einsum("CV,DV->CD", d_logits, w, preferred_element_type=jnp.float32)
        return d_head + jnp.einsum("CD,CV->DV", f, d_logits, preferred_element_type=jnp.float32), d_f.sum()

    d_head, s = jax.lax.scan(one, jnp.zeros(head.shape, jnp.float32), fs)
    return s.sum() + d_head.sum()


def variants(chunk):
    """name -> jitted (features, head, labels, mask) -> output."""
    grad = lambda logits_dtype: jax.jit(jax.value_and_grad(
        lambda f, w, y, m: loss.head_cross_entropy(f, w, y, m, chunk, logits_dtype), argnums=(0, 1)))
    return {"fp32": grad(None), "bf16": grad("bfloat16"),
            "matmuls": jax.jit(lambda f, w, y, m: matmuls_only(f, w, y, m, chunk))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8 * 4096)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args()
    ks = jax.random.split(jax.random.key(0), 3)
    f = jax.random.normal(ks[0], (1, a.tokens, a.hidden), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(ks[1], (a.hidden, a.vocab), jnp.float32) / a.hidden ** 0.5
    y = jax.random.randint(ks[2], (1, a.tokens), 0, a.vocab)
    m = jnp.ones((1, a.tokens), jnp.float32)
    fns = variants(a.chunk)
    want = fns["fp32"](f, w, y, m)
    floor = timeit(fns["matmuls"], f, w, y, m)
    n, v = a.tokens, a.vocab
    # bytes the elementwise passes move: three reads of the logits, the bf16 d_logits write
    added = {"fp32": n * v * (3 * 4 + 2), "bf16": n * v * (3 * 2 + 2)}
    print(f"{jax.devices()[0].device_kind}: tokens={n} D={a.hidden} V={v} chunk={a.chunk}; matmuls alone {floor:.2f} ms")
    print(f"{'variant':8s} {'ms':>8s} {'over matmuls':>13s} {'GB/s':>7s} {'rel loss':>9s} {'rel d_f':>8s} {'rel d_w':>8s}")
    results = {"matmuls_ms": floor, "variants": {}}
    for name in ("fp32", "bf16"):
        got = fns[name](f, w, y, m)
        errs = [rel(got[0], want[0]), rel(got[1][0].astype(jnp.float32), want[1][0].astype(jnp.float32)),
                rel(got[1][1], want[1][1])]
        ms = timeit(fns[name], f, w, y, m)
        extra = ms - floor
        gbs = added[name] / extra / 1e6 if extra > 0 else float("nan")
        results["variants"][name] = dict(ms=ms, extra_ms=extra, gb_per_s=gbs, rel_vs_fp32=errs)
        print(f"{name:8s} {ms:8.2f} {extra:13.2f} {gbs:7.0f} {errs[0]:9.1e} {errs[1]:8.1e} {errs[2]:8.1e}")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
