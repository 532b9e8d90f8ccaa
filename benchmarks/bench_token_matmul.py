"""A batch-64 decode step's projections: XLA's product against ``kernel_gpu_tokens.token_matmul``.

At 5-64 tokens a decode step hands its 16-bit projections of a normed input to
``pallas_kernels.mix_matvec.kernel_gpu_tokens.token_matmul`` (the input by ``mixed_norm``); without
``ModelConfig.decode_glue_implementation`` XLA's product reads the same normed input (the path a JAX
user has: ``reference.token_matmul_reference``, XLA's autotuned GEMM, with the activation after it for an
MLP's gate and up). Cases: ``small()``'s shared experts' gate and up, the latent ``down_proj`` and
``up_proj``, KDA's ``o_proj``, MLA's packed ``q_a`` / ``kv_a``, the dense MLP's gate and up, and K3's
``down_proj``. Each op runs as ``--steps`` chained calls in one ``fori_loop`` (each output moves one
element of the next call's input, so calls cannot overlap), cycling through enough weight copies that
every call reads its weights from HBM, as a decode step's layers do; timed interleaved
(``timing.timeit_interleaved``). Prints µs a call, the weights' bytes over that time, the speed-up and the
largest deviation in bf16 ulps of the largest output. Needs a CUDA GPU:

    PYTHONPATH=$PWD python3 benchmarks/bench_token_matmul.py --out $OUT/bench_token_matmul.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from k3jax import config
from k3jax.layers import mla
from pallas_kernels.mix_matvec.kernel_gpu_tokens import token_matmul
from pallas_kernels.mix_matvec.reference import token_matmul_reference

ACT = (("activation", "situ"), ("situ_beta", 4.0), ("situ_linear_beta", 25.0))


def cases() -> dict[str, tuple[int, int, int]]:
    """name -> (input width D, outputs N, weights: 2 for a gate and up with the activation)."""
    small, k3 = config.small(), config.kimi_k3()
    D, L = small.hidden, small.moe.latent_dim
    return {"small shared gate+up": (D, small.moe.shared_width, 2), "small down_proj": (D, L, 1),
            "small up_proj": (L, D, 1), "small kda o_proj": (small.kda.num_heads * small.kda.head_dim, D, 1),
            "small mla inputs": (D, sum(int(np.prod(o)) for _, o in mla.packed_inputs(small)), 1),
            "small dense mlp gate+up": (D, small.mlp.dense_intermediate, 2),
            "k3 down_proj": (k3.hidden, k3.moe.latent_dim, 1)}


def _op(n_w: int, kernel: bool, interpret: bool):
    act = ACT if n_w == 2 else None
    if kernel:
        return lambda x, ws: token_matmul(x, ws, activation=act, interpret=interpret)
    return lambda x, ws: token_matmul_reference(x, ws, None, dict(act) if act else None)


def chained(fn, steps: int, copies: int, n_weights: int):
    """``steps`` calls of ``fn``, each moving element ``[0, 0]`` of the next call's input by its output,
    cycling through ``copies`` weight sets (``steps`` a multiple of ``copies``)."""
    def run(x, *sets):
        def body(_, x):
            for c in range(copies):
                y = fn(x, sets[c * n_weights:(c + 1) * n_weights])
                x = x.at[0, 0].add(y[0, 0].astype(x.dtype))
            return x
        return jax.lax.fori_loop(0, steps // copies, body, x)
    return jax.jit(run)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=None, help="comma-separated names of cases() (default: all)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--out", default=None)
    ap.add_argument("--interpret", action="store_true", help="CPU smoke run (kernel interpreted, 2 steps, no timing)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_mix_matvec import _bf16_ulps, cold_sets, time_cases

    chosen = cases()
    names = args.cases.split(",") if args.cases else [n for n in chosen if not (args.interpret and "k3" in n)]
    unknown = set(names) - set(chosen)
    if unknown:
        raise SystemExit(f"bench_token_matmul: unknown --cases {sorted(unknown)}; choose from {sorted(chosen)}")
    rng = np.random.default_rng(0)
    results, calls = {"device": jax.devices()[0].device_kind, "tokens": args.tokens, "cases": {}}, {}
    for name in names:
        D, N, n_w = chosen[name]
        x = jnp.asarray(rng.normal(size=(args.tokens, D)), jnp.bfloat16)
        weights = tuple(jnp.asarray(rng.normal(size=(N, D)) * D ** -0.5, jnp.bfloat16) for _ in range(n_w))
        outs = [jax.jit(_op(n_w, kernel, args.interpret))(x, weights) for kernel in (False, True)]
        row, sets = cold_sets(weights, args.steps, args.interpret)
        results["cases"][name] = dict(row, max_diff_bf16_ulp=_bf16_ulps(outs[1], outs[0]))
        for kernel, label in ((False, "xla"), (True, "kernel")):
            run = chained(_op(n_w, kernel, args.interpret), row["steps"], row["copies"], n_w)
            calls[(name, label)] = (run, (x, *sets))
    return time_cases(results, calls, args.interpret, args.out)


if __name__ == "__main__":
    sys.exit(main())
