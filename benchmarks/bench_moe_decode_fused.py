"""One LatentMoE layer of ``small()`` at batch-1 decode: "xla", "pallas" and "pallas-fused" at several tiles.

Times ``MoE.apply(decode=True)`` (random init, bf16 params, ``decode_layout``'s output-first ``up_proj`` and
shared ``down``) with ``MoEConfig.decode_implementation`` "xla", "pallas" (the gather kernel and XLA
around it) and "pallas-fused" (``k3jax/layers/moe_decode_fused.py``: head, gather and tail kernels) at the
``TILES`` below, each as ``--steps`` chained calls in one ``fori_loop`` (the next call's x is this call's
output, so calls cannot overlap and host dispatch drops out), timed interleaved
(``bench_moe.timeit_interleaved``). Each variant is first checked against "xla" (max |difference| in
bf16 ulps of the output's largest element). Needs a CUDA GPU (``--interpret``: a CPU smoke run):

    PYTHONPATH=$PWD python3 benchmarks/bench_moe_decode_fused.py --out $OUT/bench_moe_decode_fused.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k3jax import config
from k3jax.infer.decode import decode_layout
from k3jax.layers import moe_decode_fused
from k3jax.layers.moe import MoE
from pallas_kernels.moe.kernel_gpu_decode import DecodeTiles
from pallas_kernels.moe.kernel_gpu_decode_head import HeadTiles
from pallas_kernels.moe.kernel_gpu_decode_tail import TailTiles

# "pallas-fused" variants: the three kernels' (HeadTiles | None: fitted defaults, DecodeTiles, TailTiles)
TILES = {
    "defaults": None,
    "head stages=3": (HeadTiles(num_stages=3), DecodeTiles(), TailTiles()),
    "head warps=8": (HeadTiles(num_warps=8), DecodeTiles(), TailTiles()),
    "head bd=256 warps=8": (HeadTiles(block_d=256, num_warps=8), DecodeTiles(), TailTiles()),
    "gather bf=64 warps=8": (None, DecodeTiles(64, 8), TailTiles()),
    "tail bd=16 warps=4": (None, DecodeTiles(), TailTiles(16, 4)),
    "tail bd=64 warps=8": (None, DecodeTiles(), TailTiles(64, 8)),
}


@contextlib.contextmanager
def fused_with(tiles, interpret: bool):
    """``moe_decode_fused.latent_moe`` with these tiles (and interpreted) while a call is traced."""
    original = moe_decode_fused.latent_moe
    moe_decode_fused.latent_moe = functools.partial(original, tiles=tiles, interpret=interpret)
    try:
        yield
    finally:
        moe_decode_fused.latent_moe = original


def layer(impl: str):
    base = dataclasses.replace(config.small(), param_dtype=jnp.bfloat16)
    return base, dataclasses.replace(base, moe=dataclasses.replace(base.moe, decode_implementation=impl))


def chained(cfg, steps: int):
    """``steps`` decode calls of the layer in one loop, each on the previous output."""
    step = lambda v, x: MoE(cfg).apply(v, x, decode=True)
    return jax.jit(lambda v, x: jax.lax.fori_loop(0, steps, lambda _, h: step(v, h), x))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--out", default=None)
    ap.add_argument("--interpret", action="store_true", help="CPU smoke run (kernels interpreted, no 'pallas')")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_moe import timeit_interleaved
    from bench_moe_decode import report

    base, _ = layer("xla")
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 1, base.hidden)), jnp.bfloat16)
    variables = nn.meta.unbox(jax.jit(MoE(base).init)(jax.random.key(0), x))
    variables, _ = decode_layout(variables, base)
    variants = {"xla": ("xla", None)} | ({} if args.interpret else {"pallas": ("pallas", None)})
    variants |= {f"pallas-fused {name}": ("pallas-fused", tiles) for name, tiles in TILES.items()}
    calls, once = {}, {}
    for name, (impl, tiles) in variants.items():
        cfg = layer(impl)[1]
        with fused_with(tiles, args.interpret):
            calls[name] = (chained(cfg, args.steps).lower(variables, x).compile(), (variables, x))
            once[name] = chained(cfg, 1).lower(variables, x).compile()
    outs = {name: np.asarray(fn(variables, x), np.float32) for name, fn in once.items()}
    ms = timeit_interleaved(calls, reps=3 if args.interpret else 20)
    results = {"device": jax.devices()[0].device_kind, "steps": args.steps}
    return report(results, outs, ms, args.steps, "us_per_layer", args.out)

if __name__ == "__main__":
    sys.exit(main())
