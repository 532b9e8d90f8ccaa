"""The split gate/up input gradient ``dlhs = dg·W1ᵀ + du·W3ᵀ`` on one GPU (the lent H200), at the
routed layer's per-device shape (``bench_moe.LAYER``: 8 K tokens top-16 → 131072 rows, 56 local
experts, L = 3584, F = 3072): ``kernel_gpu.gmm_sum`` (one accumulator over both pairs, the slot
ring) against what ``ops._gate_up_pallas_bwd`` ran before it, ``gmm`` of ``[dg | du]`` and
``[W1 | W3]`` including the two concatenations, and that product alone on operands concatenated
beforehand (the per-tile pipeline ``GMM_TILING_T``: the kernel without the copies). Checks every
``gmm_sum`` tiling against the concatenated product bit for bit, then times them interleaved.

    PYTHONPATH=$PWD python3 benchmarks/bench_gmm_sum.py --out $OUT/gmm_sum.json
    PYTHONPATH=$PWD python3 benchmarks/bench_gmm_sum.py --candidates 0,1 --reps 10
    PJRT_NPROC=8 PYTHONPATH=$PWD python3 benchmarks/bench_gmm_sum.py --interpret --rows 300 --experts 4 \
        --latent 256 --ffn 128 --reps 1 --candidates 0,1  # CPU smoke run
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_moe import LAYER  # noqa: E402
from benchmarks.timing import timeit_interleaved  # noqa: E402
from benchmarks.moe_groups import random_group_sizes  # noqa: E402
from pallas_kernels.moe import kernel_gpu  # noqa: E402

GpuTiling = kernel_gpu.GpuTiling
# the ring candidates of moe_tuning.GMM_CANDIDATES (4 slots of 128×256×64 would overflow shared memory)
CANDIDATES = [
    kernel_gpu.GMM_SUM_TILING,  # the default: 128×256×64, 3 slots
    GpuTiling(ring=True, half_tiles=True),
    GpuTiling(tile_n=64, stages=4, ring=True, half_tiles=True),
    GpuTiling(stages=2, ring=True, half_tiles=True),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=LAYER["T"] * LAYER["k"])
    p.add_argument("--experts", type=int, default=LAYER["E"])
    p.add_argument("--latent", type=int, default=LAYER["L"])
    p.add_argument("--ffn", type=int, default=LAYER["F"])
    p.add_argument("--candidates", default="", help="indices into CANDIDATES (default: all)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--interpret", action="store_true", help="CPU smoke run (tiny --rows/--latent/--ffn)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    m, e, l, f = a.rows, a.experts, a.latent, a.ffn
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    dg, du = (jax.random.normal(k, (m, f), jnp.bfloat16) for k in ks[:2])
    w1, w3 = ((jax.random.normal(k, (e, l, f), jnp.float32) / np.sqrt(f)).astype(jnp.bfloat16) for k in ks[2:4])
    gs = random_group_sizes(ks[4], m, e)

    old = jax.jit(lambda dg, du, w1, w3, gs: kernel_gpu.gmm(
        jnp.concatenate([dg, du], axis=1), jnp.concatenate([w1, w3], axis=2), gs, transpose_rhs=True,
        interpret=a.interpret))
    alone = jax.jit(lambda g, w, gs: kernel_gpu.gmm(g, w, gs, transpose_rhs=True, interpret=a.interpret))
    packed = (jnp.concatenate([dg, du], axis=1), jnp.concatenate([w1, w3], axis=2))
    want = np.asarray(jax.block_until_ready(old(dg, du, w1, w3, gs)), np.float32)
    calls = {"concat + gmm (before)": (old, (dg, du, w1, w3, gs)),
             "gmm on concatenated operands (kernel alone)": (alone, (*packed, gs))}
    picks = [int(i) for i in a.candidates.split(",")] if a.candidates else range(len(CANDIDATES))
    results = {"shape": dict(rows=m, experts=e, latent=l, ffn=f), "bitwise_equal": {}}
    for i in picks:
        cfg = CANDIDATES[i]
        fn = jax.jit(lambda dg, du, w1, w3, gs, cfg=cfg: kernel_gpu.gmm_sum(
            [dg, du], [w1, w3], gs, transpose_rhs=True, tiling=cfg, interpret=a.interpret))
        name = f"gmm_sum {i}: {cfg.tile_m}x{cfg.cta_n()}x{cfg.tile_k} stages={cfg.stages} half={cfg.half_tiles}"
        try:
            got = np.asarray(jax.block_until_ready(fn(dg, du, w1, w3, gs)), np.float32)
        except Exception as err:  # noqa: BLE001  (a tiling that does not compile is recorded, not fatal)
            results.setdefault("failed", {})[name] = repr(err)[:400]
            print(f"FAILED {name}: {err!r}"[:400])
            continue
        results["bitwise_equal"][name] = bool(np.array_equal(got, want))
        calls[name] = (fn, (dg, du, w1, w3, gs))
    times = timeit_interleaved(calls, reps=a.reps)
    results["ms"] = times
    flops = 2 * m * 2 * f * l
    for name, ms in times.items():
        print(f"{ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s  {name}"
              + ("" if name not in results["bitwise_equal"] else f"  bitwise={results['bitwise_equal'][name]}"))
    results["tilings"] = {i: dataclasses.asdict(CANDIDATES[i]) for i in picks}
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    return 0 if all(results["bitwise_equal"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
