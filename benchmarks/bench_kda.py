"""KDA chunk scan on one GPU: ours (XLA prep + Pallas Mosaic GPU scan) vs the peers.

Peers (measuring sticks only, never imported by project code): flash-linear-attention 0.6.0
``chunk_kda`` (Triton/PyTorch, ``safe_gate=True, lower_bound=-5``) and jax-linear-attention 0.1.0
KDA (Pallas Mosaic GPU). One process: first every implementation is checked against the fp32
chunked reference on a small problem, then each is warmed up and timed (median of ``--iters``
calls, alternating two sets of fresh random inputs, wall clock around a synchronised call).
Also measured: the bf16 matmul ceiling (8192^3 ``jnp.dot``), and the decode step
``recurrent_kda_step`` (B=64, H=96, K=V=128) against a same-size fp32 copy.

Run on the H200 from the repo root (peer wheels installed into ``.peers``, see BENCHMARKS.md):
``PYTHONPATH=$PWD:$PWD/.peers python3 benchmarks/bench_kda.py --out $OUT/bench_kda.json``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the card with PyTorch

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kda import chunk_kda, chunk_kda_reference, recurrent_kda_step

SHAPES = [(4, 8192, 32, 128), (1, 8192, 96, 128), (1, 65536, 96, 128), (1, 262144, 16, 128)]
LOWER_BOUND = -5.0


def flops_forward(B, T, H, D, C=64):
    """Tensor-core work of the chunked forward: A_kk, A_qk, W, U, W S, qg S, A_qk v_new, kg^T v_new."""
    per_chunk = 2 * (2 * C * C * D) + 2 * C * C * 2 * D + 2 * (2 * C * D * D) + 2 * C * C * D + 2 * C * D * D
    return B * H * (T // C) * per_chunk


def make_inputs(seed, B, T, H, D):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    l2 = lambda x: x / jnp.sqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)
    q = l2(jax.random.normal(ks[0], (B, T, H, D))).astype(jnp.bfloat16)
    k = l2(jax.random.normal(ks[1], (B, T, H, D))).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, T, H, D), jnp.bfloat16)
    g = LOWER_BOUND * jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H, D)) - 2.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    do = jax.random.normal(ks[5], (B, T, H, D), jnp.bfloat16)
    return (q, k, v, g, beta), do


def median_ms(fn, arg_sets, iters, sync):
    for a in arg_sets:  # warm-up: compile / autotune, and touch every input set once
        sync(fn(*a))
    times = []
    for i in range(iters):
        a = arg_sets[i % len(arg_sets)]
        t0 = time.perf_counter()
        sync(fn(*a))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def jax_sync(x):
    jax.block_until_ready(x)


# --- implementations: each returns (fwd(args) -> o, fwdbwd(args, do) -> (loss, grads)) -----------


def ours():
    fwd = jax.jit(lambda q, k, v, g, b: chunk_kda(q, k, v, g, b, implementation="pallas")[0])

    @jax.jit
    def fwdbwd(q, k, v, g, b, do):
        loss = lambda *a: jnp.sum(chunk_kda(*a, implementation="pallas")[0].astype(jnp.float32) * do)
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, b)

    return fwd, fwdbwd, _jax_conv, jax_sync


def _ours_gpu(**knobs):
    """Ours through ``chunk_kda_pallas`` with non-default knobs (``prep``, ``prep_precision``)."""
    from pallas_kernels.kda.kernel_gpu import chunk_kda_pallas

    run = lambda q, k, v, g, b: chunk_kda_pallas(q, k, v, g, b, scale=q.shape[-1] ** -0.5, **knobs)[0]
    fwd = jax.jit(run)

    @jax.jit
    def fwdbwd(q, k, v, g, b, do):
        loss = lambda *a: jnp.sum(run(*a).astype(jnp.float32) * do)
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, b)

    return fwd, fwdbwd, _jax_conv, jax_sync


def ours_fused():
    """Ours with the prep's backward as XLA autodiff of the XLA prep (``prep_bwd="xla"``; ``ours``
    takes the two Mosaic GPU kernels, ``"split"``); the forward is the same Mosaic GPU prep kernel."""
    return _ours_gpu(prep="fused")


def ours_shared_v():
    """Ours with both scans' V blocks as warpgroups of one CTA sharing the chunk loads (``shared_v=True``)."""
    return _ours_gpu(prep="fused", prep_bwd="split", shared_v=True, block_v=64)


def ours_unshared():
    """Ours with one CTA per (head, V block) in both scans (``shared_v=False``), whatever ``B·H``."""
    return _ours_gpu(prep="fused", prep_bwd="split", shared_v=False)


def ours_highest():
    """Ours with the XLA prep's matmuls in full fp32 (``prep_precision="highest"``; default TF32)."""
    return _ours_gpu(prep_precision="highest")


def _jax_conv(x, grad=False):
    return x


def jla():
    from jla.ops.mosaic_gpu.kda import kda

    fwd = jax.jit(lambda q, k, v, g, b: kda(q, k, v, g, b)[0])

    @jax.jit
    def fwdbwd(q, k, v, g, b, do):
        loss = lambda *a: jnp.sum(kda(*a)[0].astype(jnp.float32) * do)
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, b)

    return fwd, fwdbwd, _jax_conv, jax_sync


def fla():
    import torch
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    def to_torch(x, grad=False):
        t = torch.from_dlpack(jax.block_until_ready(x)).clone()
        return t.requires_grad_(grad)

    call = lambda q, k, v, g, b: fla_chunk_kda(q, k, v, g, b, safe_gate=True, lower_bound=LOWER_BOUND)[0]

    def fwd(q, k, v, g, b):
        with torch.no_grad():
            return call(q, k, v, g, b)

    def fwdbwd(q, k, v, g, b, do):
        inputs = (q, k, v, g, b)
        return torch.autograd.grad(call(*inputs), inputs, do)

    return fwd, fwdbwd, to_torch, torch_sync


def torch_sync(_):
    import torch

    torch.cuda.synchronize()


# --- checks and ceilings ------------------------------------------------------------------------


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def check_against_reference(impls, shape=(1, 2048, 4, 128)):
    """rel RMSE of o and of dq, dk, dv, dg, dbeta vs the fp32 chunked reference, per implementation."""
    (q, k, v, g, b), do = make_inputs(123, *shape)
    f32 = lambda x: x.astype(jnp.float32)
    ref_loss = lambda *a: jnp.sum(chunk_kda_reference(*a)[0] * f32(do))
    args32 = (f32(q), f32(k), f32(v), g, b)
    o_ref = jax.jit(lambda *a: chunk_kda_reference(*a)[0])(*args32)
    g_ref = jax.jit(jax.grad(ref_loss, argnums=(0, 1, 2, 3, 4)))(*args32)
    out = {}
    for name, (fwd, fwdbwd, conv, _) in impls.items():
        try:
            a = tuple(conv(x) for x in (q, k, v, g, b))
            o = fwd(*a)
            if name == "fla":
                a = tuple(conv(x, grad=True) for x in (q, k, v, g, b))
                grads = [x.float().cpu().numpy() for x in fwdbwd(*a, conv(do))]
                o = o.float().cpu().numpy()
            else:
                grads = fwdbwd(*a, do)[1]  # (loss, grads): the loss keeps the forward alive under jit
            errs = {"o": rel(o, o_ref)}
            errs.update({f"d{n}": rel(x, y) for n, x, y in zip(("q", "k", "v", "g", "beta"), grads, g_ref)})
            out[name] = errs
        except Exception as err:  # a peer that cannot run is recorded, not fatal
            out[name] = {"error": f"{type(err).__name__}: {err}"[:600]}
            traceback.print_exc()
        print(f"check {name}: {out[name]}", flush=True)
    return out


def matmul_ceiling_tflops(n=8192):
    a, b = (jax.random.normal(jax.random.PRNGKey(i), (n, n), jnp.bfloat16) for i in (0, 1))
    ms = median_ms(jax.jit(jnp.dot), [(a, b)], 20, jax_sync)
    return 2 * n**3 / ms / 1e9


def decode_step(B=64, H=96, D=128, iters=50):
    """recurrent_kda_step for one token: achieved HBM bandwidth (state read + write) vs a copy."""
    (q, k, v, g, b), _ = make_inputs(7, B, 1, H, D)
    s = jax.random.normal(jax.random.PRNGKey(8), (B, H, D, D), jnp.float32)
    step = jax.jit(lambda s, q, k, v, g, b: recurrent_kda_step(q, k, v, g, b, s))
    copy = jax.jit(lambda s: s * 1.0001)
    state_bytes = 2 * s.size * 4
    ms_step = median_ms(step, [(s, q, k, v, g, b)], iters, jax_sync)
    ms_copy = median_ms(copy, [(s,)], iters, jax_sync)
    return {"B": B, "H": H, "D": D, "step_ms": ms_step, "copy_ms": ms_copy,
            "step_TBps": state_bytes / ms_step / 1e9, "copy_TBps": state_bytes / ms_copy / 1e9,
            "fraction_of_copy": ms_copy / ms_step}


def time_shape(impls, shape, iters):
    """ms of fwd and fwd+bwd per implementation at one shape (two fresh input sets)."""
    sets = [make_inputs(seed, *shape) for seed in (1, 2)]
    row = {}
    for name, (fwd, fwdbwd, conv, sync) in impls.items():
        res = {}
        for mode in ("fwd", "fwdbwd"):
            try:
                if mode == "fwd":
                    args = [tuple(conv(x) for x in a) for a, _ in sets]
                    res[mode] = median_ms(fwd, args, iters, sync)
                else:
                    args = [tuple(conv(x, grad=True) for x in a) + (conv(do),) for a, do in sets]
                    res[mode] = median_ms(fwdbwd, args, iters, sync)
            except Exception as err:
                res[mode + "_error"] = f"{type(err).__name__}: {err}"[:600]
                traceback.print_exc()
            print(f"{shape} {name} {mode}: {res.get(mode)}", flush=True)  # a time-boxed call shows progress
            del args
        row[name] = res
        print(f"{shape} {name}: {res}", flush=True)
    return row


def print_table(results, ceiling):
    print(f"\nbf16 matmul ceiling: {ceiling:.0f} TFLOP/s (fwd+bwd FLOPs counted as 3x forward)")
    head = f"{'B,T,H,D':>18} {'impl':>10} {'fwd ms':>8} {'Mtok/s':>7} {'%TC':>5} {'f+b ms':>8} {'%TC':>5}"
    print(head + "  ours/fla fwd, f+b   ours/jla fwd, f+b  (>1 = ours faster)")
    for key, row in results.items():
        B, T, H, D = map(int, key.split(","))
        fl = flops_forward(B, T, H, D)
        for name, r in row.items():
            f, fb = r.get("fwd", float("nan")), r.get("fwdbwd", float("nan"))
            tc = lambda flops, ms: 100 * flops / ms / 1e9 / ceiling
            line = (f"{key:>18} {name:>10} {f:8.2f} {B * T / f / 1e3:7.1f} {tc(fl, f):5.1f}"
                    f" {fb:8.2f} {tc(3 * fl, fb):5.1f}")
            if name.startswith("ours"):
                for peer in ("fla", "jla"):
                    p = row.get(peer, {})
                    pf, pfb = p.get("fwd", float("nan")), p.get("fwdbwd", float("nan"))
                    line += f"  {pf / f:5.2f}x {pfb / fb:5.2f}x"
            print(line)


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import kda_breakdown  # benchmarks/ is the script's directory

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench_kda.json")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--shapes", default=";".join(",".join(map(str, s)) for s in SHAPES))
    parser.add_argument("--peers", default="ours,ours-fused,jla,fla")
    parser.add_argument("--breakdown", action="store_true", help="also time the XLA prep alone")
    parser.add_argument("--breakdown-block-v", default="", help="V blocks to time, e.g. 32,64")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="after timing each shape, trace the JAX implementations and print time per kernel")
    parser.add_argument("--skip-decode", action="store_true", help="skip the decode-step bandwidth")
    parser.add_argument("--skip-check", action="store_true", help="skip the check against the reference")
    args = parser.parse_args()
    factories = {"ours": ours, "ours-fused": ours_fused, "ours-shared-v": ours_shared_v, "ours-unshared": ours_unshared,
                 "ours-highest": ours_highest, "jla": jla, "fla": fla}
    impls = {}
    for name in args.peers.split(","):
        try:
            impls[name] = factories[name]()
        except Exception as err:
            print(f"{name} unavailable: {type(err).__name__}: {err}")
    report = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind), "results": {}}
    try:
        import torch
        report["torch"] = torch.__version__
    except ImportError:
        pass
    report["check"] = {} if args.skip_check else check_against_reference(impls)
    report["matmul_tflops"] = ceiling = matmul_ceiling_tflops()
    print(f"matmul ceiling {ceiling:.0f} TFLOP/s", flush=True)
    try:
        report["decode"] = {} if args.skip_decode else decode_step()
        print("decode", report["decode"], flush=True)
    except Exception as err:
        report["decode"] = {"error": f"{type(err).__name__}: {err}"[:600]}
    if args.breakdown:
        try:
            report["breakdown"] = kda_breakdown.breakdown(SHAPES[0], args.iters, args.breakdown_block_v)
            report["prep_stages"] = kda_breakdown.prep_stages(SHAPES[0], args.iters)
        except Exception as err:
            report["breakdown"] = {"error": f"{type(err).__name__}: {err}"[:600]}
            traceback.print_exc()
    for shape in [tuple(map(int, s.split(","))) for s in args.shapes.split(";")]:
        report["results"][",".join(map(str, shape))] = time_shape(impls, shape, args.iters)
        if args.profile:
            key = "profile_" + ",".join(map(str, shape))
            report[key] = kda_breakdown.profile_impls(impls, shape, os.path.join(args.profile, key))
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print_table(report["results"], ceiling)


if __name__ == "__main__":
    main()
