"""Per-shape tiling search for ``bench_moe.py``: the forward (``gmm``) and weight-gradient (``tgmm``)
tilings of our kernels, each timed and checked against the first candidate that runs."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from bench_moe import fwd_and_train, rel
from benchmarks.moe_groups import random_group_sizes
from benchmarks.timing import timeit_interleaved
from pallas_kernels.moe import grouped_matmul, kernel_gpu, kernel_gpu_tgmm


# forward / input-gradient tilings the tuning times per shape
GMM_CANDIDATES = [
    kernel_gpu.GpuTiling(tile_m=128, tile_n=128, tile_k=64, stages=3),
    kernel_gpu.GpuTiling(tile_m=128, tile_n=128, tile_k=64, stages=3, aligned=False),
    kernel_gpu.GpuTiling(tile_m=64, tile_n=128, tile_k=64, stages=4),
    kernel_gpu.GpuTiling(tile_m=64, tile_n=128, tile_k=128, stages=2),
    kernel_gpu.GpuTiling(tile_m=128, tile_n=64, tile_k=64, stages=4),
    # tiles whose rows fit in their first 64 issue half the wgmma rows
    kernel_gpu.GpuTiling(tile_m=128, tile_n=128, tile_k=64, stages=3, half_tiles=True),
    kernel_gpu.GpuTiling(tile_m=128, tile_n=64, tile_k=64, stages=4, half_tiles=True),
    # 2-CTA clusters sharing each lhs block by multicast
    kernel_gpu.GpuTiling(tile_m=128, tile_n=128, tile_k=64, stages=3, half_tiles=True, cluster_n=True),
    kernel_gpu.GpuTiling(tile_m=128, tile_n=64, tile_k=64, stages=4, half_tiles=True, cluster_n=True),
    # one pipeline across each CTA's tiles (K steps a multiple of stages)
    kernel_gpu.GpuTiling(tile_m=128, tile_n=128, tile_k=64, stages=2, half_tiles=True, chain_tiles=True),
    kernel_gpu.GpuTiling(tile_m=128, tile_n=64, tile_k=64, stages=4, half_tiles=True, chain_tiles=True),
    # one slot ring across each CTA's tiles (kernel_gpu_gmm_ring), one wgmma in flight
    kernel_gpu.GpuTiling(tile_m=128, tile_n=128, tile_k=64, stages=3, ring=True),
    kernel_gpu.GpuTiling(tile_m=128, tile_n=128, tile_k=64, stages=3, half_tiles=True, ring=True),
    kernel_gpu.GpuTiling(tile_m=128, tile_n=64, tile_k=64, stages=4, half_tiles=True, ring=True),
    kernel_gpu.GpuTiling(tile_m=128, tile_n=128, tile_k=64, stages=2, half_tiles=True, ring=True),
]


def tune(results, m, e, k, n, transpose_rhs=False, candidates=None):
    """Pick the fastest forward tiling for our kernel at one shape; keep it for the rest.
    ``transpose_rhs``: the input gradient's product instead (``[M, N] @ rhs[e]ᵀ``, ``GMM_TILING_T``)."""
    key = jax.random.PRNGKey(1)
    lhs = jax.random.normal(key, (m, n if transpose_rhs else k), jnp.bfloat16)
    rhs = (jax.random.normal(key, (e, k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    gs = random_group_sizes(key, m, e)
    configs = candidates or GMM_CANDIDATES
    want, rows, calls = None, [], {}
    for i, cfg in enumerate(configs):
        row = dict(shape=[m, e, k, n], transpose_rhs=transpose_rhs, tiling=dataclasses.asdict(cfg), fwd_ms=None)
        try:
            fn = jax.jit(functools.partial(kernel_gpu.gmm, tiling=cfg, transpose_rhs=transpose_rhs))
            got = fn(lhs, rhs, gs).astype(jnp.float32)
            want = got if want is None else want  # the first tiling that runs is the reference
            row["rel_vs_first"] = rel(got, want)
            calls[i] = (fn, (lhs, rhs, gs))
        except Exception as ex:  # noqa: BLE001 (a config over the shared-memory budget)
            row["error"] = repr(ex)[:300]
        rows.append(row)
    for i, ms in timeit_interleaved(calls, reps=7).items():  # candidates under the same clocks
        rows[i]["fwd_ms"] = ms
    best = None
    for cfg, row in zip(configs, rows):
        results["tuning"].append(row)
        print("tiling" + (" (dlhs)" if transpose_rhs else ""), cfg,
              {key: v for key, v in row.items() if key not in ("shape", "tiling", "transpose_rhs")})
        ok = row["fwd_ms"] is not None and row["rel_vs_first"] < 1e-2  # a fast wrong tiling never wins
        if ok and (best is None or row["fwd_ms"] < best[1]):
            best = (cfg, row["fwd_ms"])
    if best is not None:
        if transpose_rhs:
            kernel_gpu.GMM_TILING_T = best[0]
        else:
            kernel_gpu.GMM_TILING = best[0]
    return best


def tune_bwd(results, m, e, k, n, candidates=None):
    """Pick the fastest weight-gradient (tgmm) tiling at one shape by timing our forward+backward
    with each of ``kernel_gpu_tgmm.TGMM_CANDIDATES`` (forward tiling as already tuned; all timed
    interleaved); tgmm alone too."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(2), 3)
    lhs = jax.random.normal(k1, (m, k), jnp.bfloat16)
    rhs = (jax.random.normal(k2, (e, k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    cot = jax.random.normal(k3, (m, n), jnp.bfloat16)
    gs = random_group_sizes(k3, m, e)
    want, rows, calls = None, [], {}
    configs = candidates or kernel_gpu_tgmm.TGMM_CANDIDATES
    for i, cfg in enumerate(configs):
        row = dict(shape=[m, e, k, n], tiling=dataclasses.asdict(cfg))
        try:
            tg = jax.jit(functools.partial(kernel_gpu_tgmm.tgmm, num_groups=e, tiling=cfg))
            got = tg(lhs, cot, gs).astype(jnp.float32)
            want = got if want is None else want  # the default tiling's drhs, checked in check_ours
            row["rel_vs_default"] = rel(got, want)
            _, train = fwd_and_train(functools.partial(grouped_matmul, implementation="pallas", tgmm_tiling=cfg))
            calls[(i, "tgmm_ms")] = (tg, (lhs, cot, gs))
            calls[(i, "train_ms")] = (train, (lhs, rhs, gs, cot))
        except Exception as ex:  # noqa: BLE001 (a tiling that fails to compile is recorded)
            row["error"] = repr(ex)[:300]
        rows.append(row)
    for (i, what), ms in timeit_interleaved(calls, reps=7).items():  # candidates under the same clocks
        rows[i][what] = ms
    best = None
    for cfg, row in zip(configs, rows):
        results["tuning_bwd"].append(row)
        print("tgmm tiling", cfg, {key: v for key, v in row.items() if key not in ("shape", "tiling")})
        ok = "train_ms" in row and row["rel_vs_default"] < 1e-2
        if ok and (best is None or row["train_ms"] < best[1]):
            best = (cfg, row["train_ms"])
    return best[0] if best is not None else kernel_gpu_tgmm.TGMM_TILING
