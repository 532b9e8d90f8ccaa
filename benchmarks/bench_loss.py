"""The fused output head + cross-entropy of training (``k3jax.train.loss.head_cross_entropy``) on one GPU.

At ``small()``'s train-step size (8 × 4096 tokens, D = 1024, V = 163840, 4096-token chunks) it
times the loss with its gradients (``value_and_grad`` w.r.t. features and head) for:
  - ``fp32``: the default (fp32 logits; the logsumexp's max and sum passes, the softmax − onehot pass);
  - ``bf16``: ``logits_dtype="bfloat16"`` (the matmul stores bf16 logits; every pass moves half);
  - ``pallas_fp32`` / ``pallas_bf16``: ``implementation="pallas"`` (Hopper): one Mosaic GPU kernel
    (``pallas_kernels.head_ce``) writes the logits' exponentials shifted by each row's label logit
    (bf16) and the logsumexp's per-tile partials, which the gradient matmuls read directly (since
    stop 41; before, the kernel wrote the logits and a softmax − onehot pass read them);
  - ``matmuls``: the same chunk loop with the three matmuls alone, the logits matmul writing bf16
    that the other two read directly (the floor: no elementwise pass);
  - ``logits_xla`` / ``logits_pallas`` (bf16 logits): the chunk loop's logits and logsumexp alone,
    XLA's matmul + two-pass logsumexp against the kernel + the partials' combine (the kernel's
    matmul efficiency against cuBLAS).
All variants are timed round-robin in one process (``timing.timeit_interleaved``). Each
variant's extra time over ``matmuls`` is the price of its elementwise passes (the kernel's: its
slower matmul, the label gathers and scatter); the GB/s column divides the bytes XLA's passes
move (three reads of the logits and the bf16 gradient's write) by that extra time. Before timing, each variant's loss and gradients are compared with ``fp32``'s
(``pallas_bf16``'s also with ``bf16``'s, the same arithmetic up to the order of fp32 sums).

Run on the H200 from the repo root: ``PYTHONPATH=$PWD python3 benchmarks/bench_loss.py --tilings all``
(``--head-tiling NAME`` runs the pallas_* variants at another of ``kernel_gpu.HEAD_CANDIDATES``)
(on a CPU: ``--interpret --tokens 512 --hidden 128 --vocab 1024 --chunk 256``, a smoke test).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from benchmarks.bench_moe import rel
from benchmarks.timing import timeit_interleaved
from k3jax.train import loss
from pallas_kernels.head_ce import chunk_logits_lse, kernel_gpu


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


def logits_loop(features, head, chunk, implementation, interpret, tiling=None):
    """The chunk loop's logits (bf16) and logsumexp alone; a slice keeps each chunk's logits live."""
    fs = features.reshape(-1, chunk, features.shape[-1])
    w = head.astype(features.dtype)

    def one(f):
        logits, lse = chunk_logits_lse(f, w, "bfloat16", implementation=implementation, interpret=interpret,
                                       tiling=tiling)
        return jnp.sum(lse) + logits[0, 0].astype(jnp.float32)

    return jnp.sum(jax.lax.map(one, fs))


def variants(chunk, interpret=False, tilings=()):
    """name -> jitted (features, head, labels, mask) -> output; ``logits_pallas:NAME`` times the
    kernel alone at ``kernel_gpu.HEAD_CANDIDATES[NAME]`` for each name in ``tilings``."""
    def grad(logits_dtype, implementation="xla"):
        fn = lambda f, w, y, m: loss.head_cross_entropy(f, w, y, m, chunk, logits_dtype, implementation, interpret)
        return jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))

    logits = lambda impl, t=None: jax.jit(lambda f, w, y, m: logits_loop(f, w, chunk, impl, interpret, t))
    fns = {"fp32": grad(None), "bf16": grad("bfloat16"), "pallas_fp32": grad(None, "pallas"),
           "pallas_bf16": grad("bfloat16", "pallas"),
           "matmuls": jax.jit(lambda f, w, y, m: matmuls_only(f, w, y, m, chunk)),
           "logits_xla": logits("xla"), "logits_pallas": logits("pallas")}
    for name in tilings:
        fns[f"logits_pallas:{name}"] = logits("pallas", kernel_gpu.HEAD_CANDIDATES[name])
    return fns


def _errors(got, want):
    return [rel(got[0], want[0]), rel(got[1][0].astype(jnp.float32), want[1][0].astype(jnp.float32)),
            rel(got[1][1], want[1][1])]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8 * 4096)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--only", default=None, help="comma-separated variants to time (default: all)")
    ap.add_argument("--interpret", action="store_true", help="run the Pallas kernel in the GPU interpreter (CPU)")
    ap.add_argument("--head-tiling", default="default", choices=sorted(kernel_gpu.HEAD_CANDIDATES),
                    help="the kernel's tiling in the pallas_* and logits_pallas variants (a 'bf16 only' "
                         "candidate needs --only without pallas_fp32)")
    ap.add_argument("--tilings", default="", help="comma-separated HEAD_CANDIDATES to time the kernel alone at "
                    "(logits_pallas:NAME variants; 'all' for every candidate)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args()
    ks = jax.random.split(jax.random.key(0), 3)
    f = jax.random.normal(ks[0], (1, a.tokens, a.hidden), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(ks[1], (a.hidden, a.vocab), jnp.float32) / a.hidden ** 0.5
    y = jax.random.randint(ks[2], (1, a.tokens), 0, a.vocab)
    m = jnp.ones((1, a.tokens), jnp.float32)
    kernel_gpu.HEAD_TILING = kernel_gpu.HEAD_CANDIDATES[a.head_tiling]  # read when the variants trace
    tilings = list(kernel_gpu.HEAD_CANDIDATES) if a.tilings == "all" else [t for t in a.tilings.split(",") if t]
    bad = sorted(set(tilings) - set(kernel_gpu.HEAD_CANDIDATES))
    if bad:
        raise SystemExit(f"--tilings: unknown {bad}; choose from {sorted(kernel_gpu.HEAD_CANDIDATES)}")
    fns = variants(a.chunk, a.interpret, tilings)
    names = a.only.split(",") if a.only else list(fns)
    unknown = sorted(set(names) - set(fns))
    if unknown:
        raise SystemExit(f"--only: unknown variants {unknown}; choose from {sorted(fns)}")
    args = (f, w, y, m)
    want = {k: fns[k](*args) for k in ("fp32", "bf16")}
    ms = timeit_interleaved({k: (fns[k], args) for k in names})
    n, v = a.tokens, a.vocab
    # bytes the elementwise passes move: XLA three reads of the logits + the bf16 d_logits write;
    # the kernel path none (its bf16 exponentials' write is part of the kernel)
    added = {"fp32": n * v * (3 * 4 + 2), "bf16": n * v * (3 * 2 + 2), "pallas_fp32": 0, "pallas_bf16": 0}
    floor = ms.get("matmuls", float("nan"))
    base = ms.get("fp32", float("nan"))
    print(f"{jax.devices()[0].device_kind}: tokens={n} D={a.hidden} V={v} chunk={a.chunk}; "
          f"matmuls alone {floor:.2f} ms; kernel tiling {a.head_tiling}: {kernel_gpu.HEAD_TILING}")
    print(f"{'variant':26s} {'ms':>8s} {'/ fp32':>7s} {'over matmuls':>13s} {'GB/s':>7s} {'rel loss':>9s} "
          f"{'rel d_f':>8s} {'rel d_w':>8s}")
    results = {"ms": ms, "head_tiling": a.head_tiling, "variants": {}}
    for name in names:
        row = dict(ms=ms[name], ratio_vs_fp32=ms[name] / base)
        line = f"{name:26s} {ms[name]:8.2f} {ms[name] / base:7.3f}"
        if name in added:
            extra = ms[name] - floor
            gbs = added[name] / extra / 1e6 if extra > 0 and added[name] else float("nan")
            errs = _errors(fns[name](*args), want["fp32"])
            row.update(extra_ms=extra, gb_per_s=gbs, rel_vs_fp32=errs)
            line += f" {extra:13.2f} {gbs:7.0f} {errs[0]:9.1e} {errs[1]:8.1e} {errs[2]:8.1e}"
        results["variants"][name] = row
        print(line)
    for new, old in (("pallas_fp32", "fp32"), ("pallas_bf16", "bf16"), ("logits_pallas", "logits_xla")):
        if new in ms and old in ms:
            print(f"{new} / {old}: {ms[new] / ms[old]:.3f} ({ms[old] - ms[new]:+.2f} ms saved)")
    if "pallas_bf16" in names:
        errs = _errors(fns["pallas_bf16"](*args), want["bf16"])
        results["pallas_bf16_vs_bf16"] = errs
        print("pallas_bf16 vs bf16 (rel loss, d_f, d_w): " + " ".join(f"{e:.1e}" for e in errs))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
