"""A decode step's layer inputs: XLA's mix, norm and projection against the mixed matvec kernel.

Times ``pallas_kernels.mix_matvec.kernel_gpu.mixed_matvec`` against its reference as XLA compiles it
(``reference.mixed_matvec_reference``: the sources' reductions, the softmax, the projection fused with
the mix and the norm — the path a JAX user has, and the decode step's without
``ModelConfig.decode_glue_implementation``) at batch 1, for every projection the step hands the kernel:
``small()``'s KDA and MLA packed inputs, its router (float32, with the sigmoid), latent ``down_proj``,
shared experts' gate and up (with the activation), the latent norm before ``up_proj`` and KDA's
per-head output norm and gate before ``o_proj``, and K3's KDA packed inputs and latent ``down_proj`` at
7168 wide over 9 sources and its KDA ``o_proj`` (96 heads); and, not in the model yet, small()'s head
(the output mix, the final norm and fp32 logits over 163 840 rows: does the kernel keep up with the
cuBLAS product XLA calls there?). Each op runs as ``--steps``
chained calls in one ``fori_loop`` (each call's output moves one element of the next call's partial
sum, so calls cannot overlap), cycling through enough weight copies that every call reads its weights
from HBM, as a decode step's layers do; timed interleaved (``timing.timeit_interleaved``). Prints µs a
call, the weights' bytes over that time, the kernel's speed-up and its largest deviation from XLA's
output in bf16 ulps of the largest output (the unit of the input's rounding). Needs a CUDA GPU:

    PYTHONPATH=$PWD python3 benchmarks/bench_mix_matvec.py --out $OUT/bench_mix_matvec.json
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

from k3jax import config
from k3jax.layers import kda, mla
from pallas_kernels.mix_matvec.kernel_gpu import mixed_matvec
from pallas_kernels.mix_matvec.reference import mixed_matvec_reference

ACT = (("activation", "situ"), ("situ_beta", 4.0), ("situ_linear_beta", 25.0))


def _packed_width(packed_inputs, cfg) -> int:
    return sum(int(np.prod(out)) for _, out in packed_inputs(cfg))


def cases() -> dict[str, dict]:
    """name -> (width D, outputs N, sources, weights, projection dtype, epilogue, terms added to the stream
    inside (a layer's first mix: the MoE's routed and shared outputs; its second: the mixer's), the norm's
    group (per head) with the output gate)."""
    small, k3 = config.small(), config.kimi_k3()
    f32, bf = jnp.float32, jnp.bfloat16
    case = lambda D, N, sources, weights=1, proj=bf, epilogue=None, addends=0, group=None, out=None: dict(
        D=D, N=N, sources=sources, weights=weights, proj=proj, epilogue=epilogue, addends=addends, group=group,
        out=out)
    D, L = small.hidden, small.moe.latent_dim
    return {
        "small kda inputs": case(D, _packed_width(kda.packed_inputs, small), 3, addends=2),
        "small mla inputs": case(D, _packed_width(mla.packed_inputs, small), 3, addends=2),
        "small router": case(D, small.moe.num_experts, 3, proj=f32, epilogue="sigmoid", addends=1),
        "small down_proj": case(D, L, 3, addends=1),
        "small shared gate+up": case(D, small.moe.shared_width, 3, weights=2, addends=1),
        "small latent norm + up_proj": case(L, D, 1),
        "small kda o_norm + o_proj": case(small.kda.num_heads * small.kda.head_dim, D, 1, group=small.kda.head_dim),
        # not in the model yet: would the head's output mix, final norm and fp32 logits keep up with cuBLAS?
        "small head": case(D, small.vocab_size, small.num_attn_res_blocks + 1, addends=2, out=f32),
        "k3 kda inputs": case(k3.hidden, _packed_width(kda.packed_inputs, k3), 9, addends=2),
        "k3 down_proj": case(k3.hidden, k3.moe.latent_dim, 9, addends=1),
        "k3 kda o_norm + o_proj": case(k3.kda.num_heads * k3.kda.head_dim, k3.hidden, 1, group=k3.kda.head_dim),
    }


def _inputs(c: dict, seed: int = 0):
    rng = np.random.default_rng(seed)
    D, bf = c["D"], jnp.bfloat16
    sources = tuple(jnp.asarray(rng.normal(size=(1, D)), bf) for _ in range(c["sources"]))
    mix = (jnp.asarray(rng.normal(size=D) * 0.1, bf), jnp.ones(D, bf)) if c["sources"] > 1 else ()
    weights = tuple(jnp.asarray(rng.normal(size=(c["N"], D)) * D ** -0.5, c["proj"]) for _ in range(c["weights"]))
    addends = tuple(jnp.asarray(rng.normal(size=(1, D)), bf) for _ in range(c["addends"]))
    gate = jnp.asarray(rng.normal(size=(1, D)), bf) if c["group"] else None
    return sources, mix, jnp.ones(c["group"] or D, jnp.float32 if c["group"] else bf), weights, addends, gate


def _op(c: dict, kernel: bool, interpret: bool):
    kw = dict(dtype=jnp.bfloat16, proj_dtype=c["proj"], epilogue=c["epilogue"], out_dtype=c["out"])
    act = ACT if c["weights"] == 2 else None
    if kernel:
        return lambda s, m, sc, ws, add, g: mixed_matvec(s, m, sc, ws, mix_eps=1e-5, norm_eps=1e-5, activation=act,
                                                         addends=add, gate=g, interpret=interpret, **kw)
    return lambda s, m, sc, ws, add, g: mixed_matvec_reference(s, m, 1e-5, sc, 1e-5, ws, activation=dict(act or ()),
                                                               addends=add, gate=g, **kw)


def chained(fn, steps: int, copies: int, n_weights: int):
    """``steps`` calls of ``fn``, each moving element ``[0, 0]`` of the next call's partial sum by its output,
    cycling through ``copies`` weight sets (``steps`` a multiple of ``copies``)."""
    def run(sources, mix, scale, addends, gate, *sets):
        def body(_, partial):
            for c in range(copies):
                y = fn((*sources[:-1], partial), mix, scale, sets[c * n_weights:(c + 1) * n_weights], addends, gate)
                partial = partial.at[0, 0].add(y[0, 0].astype(partial.dtype))
            return partial
        return jax.lax.fori_loop(0, steps // copies, body, sources[-1])
    return jax.jit(run)


def _bf16_ulps(got, want) -> float:
    """``max |got - want|`` in bf16 ulps at ``max |want|`` (the unit of the input's rounding, float32 outputs
    included)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / (2.0 ** -7 * np.max(np.abs(want))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=None, help="comma-separated names of cases() (default: all)")
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--out", default=None)
    ap.add_argument("--interpret", action="store_true", help="CPU smoke run (kernel interpreted, small() cases, "
                                                             "2 steps, no timing)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    chosen = cases()
    big = lambda n: "k3" in n or "head" in n  # too slow to interpret
    names = args.cases.split(",") if args.cases else [n for n in chosen if not (args.interpret and big(n))]
    unknown = set(names) - set(chosen)
    if unknown:
        raise SystemExit(f"bench_mix_matvec: unknown --cases {sorted(unknown)}; choose from {sorted(chosen)}")
    results, calls = {"device": jax.devices()[0].device_kind, "steps": args.steps, "cases": {}}, {}
    for name in names:
        c = chosen[name]
        sources, mix, scale, weights, addends, gate = _inputs(c)
        outs = [jax.jit(_op(c, kernel, args.interpret))(sources, mix, scale, weights, addends, gate)
                for kernel in (False, True)]
        row, sets = cold_sets(weights, args.steps, args.interpret)
        results["cases"][name] = dict(row, max_diff_bf16_ulp=_bf16_ulps(outs[1], outs[0]))
        for kernel, label in ((False, "xla"), (True, "kernel")):
            run = chained(_op(c, kernel, args.interpret), row["steps"], row["copies"], len(weights))
            calls[(name, label)] = (run, (sources, mix, scale, addends, gate, *sets))
    return time_cases(results, calls, args.interpret, args.out)


def cold_sets(weights: tuple, steps: int, interpret: bool) -> tuple[dict, list]:
    """``({weight_bytes, copies, steps}, sets)``: enough copies of ``weights`` that one loop iteration reads
    >= 200 MB (at most 64; 1 when ``interpret``), ``steps`` rounded up to a multiple of them (2 when
    ``interpret``), the copies flattened in order (the first set the arrays themselves)."""
    nbytes = sum(w.size * w.dtype.itemsize for w in weights)
    copies = 1 if interpret else min(64, max(1, -(-200_000_000 // nbytes)))
    steps = 2 if interpret else -(-steps // copies) * copies
    sets = [w if k == 0 else jnp.array(w, copy=True) for k in range(copies) for w in weights]
    return {"weight_bytes": nbytes, "copies": copies, "steps": steps}, sets


def time_cases(results: dict, calls: dict, interpret: bool, out: str | None) -> int:
    """Run ``calls`` (``(case, "xla" | "kernel") -> (fn, args)``) once each when ``interpret``, else time them
    interleaved into ``results["cases"]`` (µs a call, speed-up, the kernel's weight TB/s) and print a row a
    case; write ``results`` to ``out``; 0 (the exit status)."""
    from timing import timeit_interleaved

    if interpret:
        for run, a in calls.values():
            jax.block_until_ready(run(*a))
    else:
        ms = timeit_interleaved(calls)
        for name, row in results["cases"].items():
            us = {label: 1e3 * ms[(name, label)] / row["steps"] for label in ("xla", "kernel")}
            row.update(us_xla=us["xla"], us_kernel=us["kernel"], speedup=us["xla"] / us["kernel"],
                       kernel_tb_s=row["weight_bytes"] / us["kernel"] / 1e6)
            print(f"{name:30s} xla {us['xla']:7.2f} us   kernel {us['kernel']:7.2f} us   {row['speedup']:5.2f}x   "
                  f"{row['kernel_tb_s']:5.2f} TB/s   max diff {row['max_diff_bf16_ulp']:.2f} bf16 ulp", flush=True)
    if out:
        Path(out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
