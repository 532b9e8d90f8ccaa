"""One warm grouped-matmul forward and forward+backward (ours), inside a profiler region.

For Nsight Compute, as ``ncu_kda.py``: compiled and run once outside the region, then once each
between ``cuProfilerStart`` and ``cuProfilerStop``. The shape is one of ``bench_moe.GMM_SHAPES``
with the same uneven group sizes. On the H200:

``ncu --profile-from-start off --clock-control none -k regex:moe --set full
python3 benchmarks/ncu_moe.py --shape 2``
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_moe import GMM_SHAPES, fwd_and_train  # noqa: E402
from benchmarks.moe_groups import random_group_sizes  # noqa: E402
from ncu_kda import profiler_region  # noqa: E402
from pallas_kernels.moe import grouped_matmul, kernel_gpu_tgmm  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, default=2, help=f"index into GMM_SHAPES {GMM_SHAPES}")
    parser.add_argument("--skip-bwd", action="store_true", help="profile the forward only")
    parser.add_argument("--tgmm-candidates", default="", metavar="I,J",
                        help="also profile the weight gradient alone under these kernel_gpu_tgmm.TGMM_CANDIDATES")
    args = parser.parse_args()
    if not 0 <= args.shape < len(GMM_SHAPES):
        parser.error(f"--shape must be an index in [0, {len(GMM_SHAPES)}), got {args.shape}")
    m, e, k, n = GMM_SHAPES[args.shape]
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(m + e + k + n), 4)  # bench_moe's inputs
    lhs = jax.random.normal(k1, (m, k), jnp.bfloat16)
    rhs = (jax.random.normal(k2, (e, k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    cot = jax.random.normal(k3, (m, n), jnp.bfloat16)
    gs = random_group_sizes(k4, m, e)
    fwd, train = fwd_and_train(functools.partial(grouped_matmul, implementation="pallas"))
    calls = [lambda: fwd(lhs, rhs, gs)] + ([] if args.skip_bwd else [lambda: train(lhs, rhs, gs, cot)])
    for i in (int(c) for c in args.tgmm_candidates.split(",") if c):
        tiling = kernel_gpu_tgmm.TGMM_CANDIDATES[i]
        drhs = jax.jit(functools.partial(kernel_gpu_tgmm.tgmm, num_groups=e, tiling=tiling))
        calls.append(lambda drhs=drhs: drhs(lhs, cot, gs))
    for call in calls:  # compile outside the region
        jax.block_until_ready(call())
    with profiler_region():
        for call in calls:
            jax.block_until_ready(call())
    print(f"profiled M,E,K,N = {m},{e},{k},{n}, group sizes {int(gs.min())}..{int(gs.max())}")


if __name__ == "__main__":
    main()
