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

``--op output`` times what follows the attention in a decode step, from the layer's input ``x [B, D]``
(``small()``'s widths; the chained state; the query is a slice of it): the attention kernel's splits, then
XLA's merge, ``W_v`` and the output gate with the gate's product ``x · g_proj`` (the layer's path below 16
rows before stop 66, where XLA fused the product into that epilogue) against the output kernel
(``kernel_gpu_output.gated_output``) with the gate's product left to XLA beside the attention.
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


def output_phase(x, latent, last, w_kv_b, g_proj, *, kernel: bool, interpret=False):
    """From the layer input ``x [B, D]``: the absorbed query (a slice of ``x``), the decode attention kernel's
    splits, then the merged, ``W_v``-expanded, gated output ``[B, D]`` by XLA's epilogue (``kernel=False``, the
    gate's product inside it) or the output kernel (the gate's product by XLA, beside the attention)."""
    from pallas_kernels.mla_attention import kernel_gpu_decode, kernel_gpu_output
    B, D = x.shape
    R, H, dkv = w_kv_b.shape
    dv = g_proj.shape[-1]
    dr = latent.shape[-1] - R
    q = x.astype(jnp.float32)[:, None, None, :]
    q_c = jnp.broadcast_to(q[..., :R], (B, 1, H, R)) * 0.05
    q_r = jnp.broadcast_to(q[..., R:R + dr], (B, 1, H, dr)) * 0.05
    gate = jnp.einsum("BD,DHV->BHV", x, g_proj)[:, None]  # [B, 1, H, dv]
    if kernel:
        splits = kernel_gpu_decode.split_outputs(q_c, q_r, latent, last, scale=0.1, interpret=interpret)
        o = kernel_gpu_output.gated_output(*splits, w_kv_b, gate, nope_dim=dkv - dv, interpret=interpret)
    else:
        o_c = kernel_gpu_decode.cached_attention_pallas(q_c, q_r, latent, last, scale=0.1, interpret=interpret)
        o = jnp.einsum("BTHR,RHV->BTHV", o_c, w_kv_b[..., dkv - dv:].astype(jnp.float32))
        o = (o * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(x.dtype)
    return o.reshape(B, H * dv)[:, :D]


def bench_output(args, timeit_interleaved) -> dict:
    """``--op output`` at small()'s widths (8 heads, a 256 + 64 latent, ``W_v`` 128 wide, D 1024), ``--batches``."""
    results = {"device": jax.devices()[0].device_kind, "steps": args.steps, "op": "output", "batches": {}}
    H, R, dr, dn, dv, D = 8, 256, 64, 128, 128, 1024
    for B in map(int, args.batches.split(",")):
        S, prompt = (96, 40) if args.interpret else (args.prompt + 65, args.prompt)
        _, _, latent, last = _inputs(B, H, R, dr, S, prompt)
        ks = jax.random.split(jax.random.key(1), 3)
        x = jax.random.normal(ks[0], (B, D)).astype(jnp.bfloat16)
        w_kv_b = (0.1 * jax.random.normal(ks[1], (R, H, dn + dv))).astype(jnp.bfloat16)
        g_proj = (D ** -0.5 * jax.random.normal(ks[2], (D, H, dv))).astype(jnp.bfloat16)
        fns = {name: functools.partial(output_phase, kernel=name == "kernel", interpret=args.interpret)
               for name in ("xla", "kernel")}
        rest = (latent, last, w_kv_b, g_proj)
        outs = {n: np.asarray(jax.jit(f)(x, *rest), np.float32) for n, f in fns.items()}
        ms = timeit_interleaved({n: (chained(f, args.steps), (x, *rest)) for n, f in fns.items()})
        us = {n: 1e3 * t / args.steps for n, t in ms.items()}
        dev = float(np.linalg.norm(outs["kernel"] - outs["xla"]) / np.linalg.norm(outs["xla"]))
        results["batches"][B] = {"us": us, "speedup": us["xla"] / us["kernel"], "rel_deviation": dev}
        print(f"output B={B:3d}: xla epilogue {us['xla']:8.2f} us, output kernel {us['kernel']:8.2f} us: "
              f"{us['xla'] / us['kernel']:.2f}x; relative deviation {dev:.1e}", flush=True)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=1024, help="small()'s prompt (its cache holds 64 more rows)")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {list(SHAPES)}")
    ap.add_argument("--out", default=None)
    ap.add_argument("--interpret", action="store_true", help="CPU smoke run (kernel interpreted, tiny cache)")
    ap.add_argument("--op", choices=("attention", "output"), default="attention")
    ap.add_argument("--batches", default="1,16,64", help="--op output's batches")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from benchmarks.timing import timeit_interleaved

    if args.op == "output":
        results = bench_output(args, timeit_interleaved)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
        return 0

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
