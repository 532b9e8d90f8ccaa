"""MoE grouped-matmul and routed-layer benchmark on one GPU (the lent H200).

Checks our kernels against the XLA reference, then times forward and forward+backward of ours
(``grouped_matmul(implementation="pallas")``), ``jax.lax.ragged_dot``, tokamax 0.0.17 and
jax-linear-attention 0.1.0 ``ragged_dot``, the dense equal-group batched einsum (the no-routing
ceiling), and PyTorch's grouped GEMM and dense ``bmm`` on the same inputs (``torch_gmm.py``);
then the LatentMoE routed layer at a K3 per-device slice, ours vs the layer built from the peers'
ragged_dot with XLA gathers and scatter-add. A missing or failing peer (wheels: BENCHMARKS.md)
is recorded, not fatal. Per shape, the forward, input-gradient and weight-gradient tilings are
picked by timing first (``moe_tuning.py``; a candidate whose result differs is never picked).
Each table is timed interleaved (``timeit_interleaved``): clock drift under the power cap falls
on every implementation alike.

Group sizes (``--groups``, ``moe_groups.py``): uneven draws (the default) or a fresh router's near-even
counts; the tilings' ranking depends on it (GMM_SHAPES 3 and 4 are small()'s shapes).

    PYTHONPATH=$PWD python3 benchmarks/bench_moe.py --out $OUT/bench_moe.json
"""

import argparse
import dataclasses
import functools
import json
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import moe_groups
from benchmarks.moe_groups import random_group_sizes
from benchmarks.timing import timeit, timeit_interleaved
from pallas_kernels.moe import grouped_matmul, kernel_gpu, kernel_gpu_tgmm, moe_ffn
from pallas_kernels.moe.activations import situ_glu
from pallas_kernels.moe.reference import grouped_matmul_dense

# K3-width shapes, the E = 128 tuning shape, then small()'s routed experts (8 × 4096 tokens, top-8): gate/up, down
GMM_SHAPES = [(65536, 64, 3584, 3072), (65536, 64, 3072, 3584), (32768, 128, 2048, 1024), (262144, 64, 512, 1024),
              (262144, 64, 512, 512)]
LAYER = dict(T=8192, D=7168, L=3584, F=3072, E=56, k=16)


def rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def peers():
    """name -> ragged_dot(lhs, rhs, group_sizes) for each importable peer."""
    out = {"lax.ragged_dot": lambda a, b, g: jax.lax.ragged_dot(a, b, g)}
    try:
        import tokamax

        out["tokamax"] = lambda a, b, g: tokamax.ragged_dot(a, b, g, implementation="mosaic")
    except Exception as e:  # noqa: BLE001 (a peer that fails to import is recorded)
        print("tokamax unavailable:", repr(e))
    try:
        from jla.ops.mosaic_gpu.ragged_dot import ragged_dot as jla_ragged_dot

        out["jla"] = jla_ragged_dot
    except Exception as e:  # noqa: BLE001
        print("jax-linear-attention unavailable:", repr(e))
    return out


def _value_and_vjp(fn, *args_and_cot):
    """``(fn(*args), vjp(cot))``: the forward output is kept, so XLA cannot drop forward work."""
    *args, cot = args_and_cot
    out, vjp = jax.vjp(fn, *args)
    return out, vjp(cot)


def fwd_and_train(gmm):
    """Jitted forward and forward+backward (both gradients) of a grouped matmul."""
    fwd = jax.jit(gmm)

    def train(lhs, rhs, gs, cot):
        out, vjp = jax.vjp(lambda a, b: gmm(a, b, gs), lhs, rhs)
        # the output is returned too: otherwise XLA drops the forward (linear op: the
        # gradients never read it) and "fwd+bwd" times the backward alone
        return (out,) + vjp(cot.astype(out.dtype))

    return fwd, jax.jit(train)


def check_ours(results):
    """Ours vs the XLA reference at a mid shape: outputs and both gradients, several groupings."""
    m, e, k, n = 4096, 8, 512, 768
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    lhs = jax.random.normal(k1, (m, k), jnp.bfloat16)
    rhs = (jax.random.normal(k2, (e, k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    cot = jax.random.normal(k3, (m, n), jnp.bfloat16)
    ours = fwd_and_train(functools.partial(grouped_matmul, implementation="pallas"))
    f32 = lambda x: x.astype(jnp.float32)
    ref = fwd_and_train(lambda a, b, g: jax.lax.ragged_dot(a, b, g, preferred_element_type=jnp.float32))
    cases = {
        "uneven": random_group_sizes(k3, m, e),
        "empty+tail": jnp.asarray([700, 0, 1000, 0, 333, 0, 1, 2000], jnp.int32),
        "all_in_one": jnp.asarray([0, 0, 0, m, 0, 0, 0, 0], jnp.int32),
    }
    for name, gs in cases.items():
        out = ours[0](lhs, rhs, gs)
        _, dl, dr = ours[1](lhs, rhs, gs, cot)
        _, el, er = ref[1](f32(lhs), f32(rhs), gs, f32(cot))
        total = int(gs.sum())
        tgmm_checks = {}  # per-group, chunked and chunked with accumulator reset, overlapped wgmma
        for i in (1, 5, 10):
            cfg = kernel_gpu_tgmm.TGMM_CANDIDATES[i]
            dr_i = jax.jit(functools.partial(kernel_gpu_tgmm.tgmm, num_groups=e, tiling=cfg))(lhs, cot, gs)
            tgmm_checks[f"drhs_tgmm_candidate{i}"] = rel(f32(dr_i), er)
        results["checks"][f"gmm_{name}"] = dict(
            **tgmm_checks,
            fwd=rel(f32(out), grouped_matmul_dense(f32(lhs), f32(rhs), gs)),
            dlhs=rel(f32(dl), el),
            drhs=rel(f32(dr), er),
            tail_zero=bool(np.all(np.asarray(f32(out[total:])) == 0)),
            finite=bool(np.isfinite(np.asarray(f32(out))).all()),
        )
        print("check", name, results["checks"][f"gmm_{name}"])


def check_moe_ffn(results):
    """moe_ffn with our kernels vs the XLA path: output and every gradient."""
    t, l, f, e, k = 512, 512, 768, 8, 4
    ks = jax.random.split(jax.random.PRNGKey(3), 7)
    x = jax.random.normal(ks[0], (t, l), jnp.bfloat16)
    ids = jnp.argsort(jax.random.uniform(ks[1], (t, e)), axis=1)[:, :k].astype(jnp.int32)
    w = jax.nn.softmax(jax.random.normal(ks[2], (t, k)), -1)
    w1, w3 = [(jax.random.normal(kk, (e, l, f)) / np.sqrt(l)).astype(jnp.bfloat16) for kk in ks[3:5]]
    w2 = (jax.random.normal(ks[5], (e, f, l)) / np.sqrt(f)).astype(jnp.bfloat16)
    cot = jax.random.normal(ks[6], (t, l), jnp.bfloat16)

    def run(impl):
        fn = lambda x, w, w1, w3, w2: moe_ffn(x, ids, w, w1, w3, w2, implementation=impl)
        out, vjp = jax.vjp(fn, x, w, w1, w3, w2)
        return (out,) + vjp(cot)

    ours, ref = jax.jit(lambda: run("pallas"))(), jax.jit(lambda: run("xla"))()
    names = ["out", "dx", "dweights", "dw1", "dw3", "dw2"]
    results["checks"]["moe_ffn"] = {n: rel(a.astype(jnp.float32), b.astype(jnp.float32)) for n, a, b in zip(names, ours, ref)}
    print("check moe_ffn", results["checks"]["moe_ffn"])


def bench_gmm(results, shape, impls, tgmm_tiling=None, with_torch=True):
    m, e, k, n = shape
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(sum(shape)), 4)
    lhs = jax.random.normal(k1, (m, k), jnp.bfloat16)
    rhs = (jax.random.normal(k2, (e, k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    cot = jax.random.normal(k3, (m, n), jnp.bfloat16)
    gs = random_group_sizes(k4, m, e)
    flops = 2 * m * k * n
    row = dict(shape=dict(M=m, E=e, K=k, N=n), group_sizes_minmax=[int(gs.min()), int(gs.max())])

    def dense(a, b, g):
        del g  # equal groups: the no-routing ceiling
        return jnp.einsum("EMK,EKN->EMN", a.reshape(e, m // e, k), b).reshape(m, n)

    ref_out = None
    ours = functools.partial(grouped_matmul, implementation="pallas", tgmm_tiling=tgmm_tiling)
    timed = {}  # name -> (fwd, train): timed together below
    for name, fn in [("ours", ours)] + list(impls.items()) + [
        ("dense_einsum", dense)
    ]:
        try:
            fwd, train = fwd_and_train(fn)
            out = fwd(lhs, rhs, gs)
            if name == "ours":  # against the reference at full size first
                want = jax.jit(lambda a, b, g: jax.lax.ragged_dot(a, b, g, preferred_element_type=jnp.float32))
                row["ours_rel_vs_reference"] = rel(out.astype(jnp.float32), want(lhs, rhs, gs))
            if name != "dense_einsum":
                if ref_out is None:
                    ref_out = out
                err = rel(out.astype(jnp.float32), ref_out.astype(jnp.float32))
            else:
                err = None
            jax.block_until_ready(train(lhs, rhs, gs, cot))
            row[name] = dict(rel_vs_ours=err)
            if name == "lax.ragged_dot":  # 20-120 ms a call: timed alone, 5 reps
                f_ms = timeit(fwd, lhs, rhs, gs, reps=5, warmup=1)
                row[name].update(fwd_ms=f_ms, train_ms=timeit(train, lhs, rhs, gs, cot, reps=5, warmup=1))
            else:
                timed[name] = (fwd, train)
        except Exception as ex:  # noqa: BLE001 (record and go on)
            row[name] = dict(error=repr(ex)[:500])
            traceback.print_exc()
    calls = {}
    for name, (fwd, train) in timed.items():
        calls[(name, "fwd_ms")] = (fwd, (lhs, rhs, gs))
        calls[(name, "train_ms")] = (train, (lhs, rhs, gs, cot))
    if with_torch and ref_out is not None:
        import torch_gmm  # benchmarks/ is the script's directory

        torch_gmm.add_torch_calls(row, calls, (lhs, rhs, gs, cot), ref_out.astype(jnp.float32))
    for (name, what), ms in timeit_interleaved(calls).items():
        row[name][what] = ms
    for name in [n for n in row if isinstance(row[n], dict) and "fwd_ms" in row[n]]:
        row[name]["fwd_tflops"] = flops / row[name]["fwd_ms"] / 1e9
        print(shape, name, row[name])
    results["gmm"].append(row)


def _layer_params(key):
    c = LAYER
    ks = jax.random.split(key, 8)
    bf = jnp.bfloat16
    nrm = lambda k, s, fan: (jax.random.normal(k, s) / np.sqrt(fan)).astype(bf)
    return dict(
        w_router=nrm(ks[0], (c["D"], c["E"]), c["D"]).astype(jnp.float32),
        w_down=nrm(ks[1], (c["D"], c["L"]), c["D"]),
        w_up=nrm(ks[2], (c["L"], c["D"]), c["L"]),
        w1=nrm(ks[3], (c["E"], c["L"], c["F"]), c["L"]),
        w3=nrm(ks[4], (c["E"], c["L"], c["F"]), c["L"]),
        w2=nrm(ks[5], (c["E"], c["F"], c["L"]), c["F"]),
        norm=jnp.ones((c["L"],), jnp.float32),
    )


def _routed_layer(params, x, experts):
    """Router → down-proj D→L → routed experts → RMSNorm → up-proj L→D (SPEC §4 LatentMoE)."""
    s = jax.nn.sigmoid(x.astype(jnp.float32) @ params["w_router"])  # [T, E]
    top_s, ids = jax.lax.top_k(s, LAYER["k"])
    w = top_s / (top_s.sum(-1, keepdims=True) + 1e-20)
    lat = x @ params["w_down"]  # [T, L]
    y = experts(lat, ids, w, params["w1"], params["w3"], params["w2"]).astype(jnp.float32)
    y = y * jax.lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + 1e-5) * params["norm"]
    return y.astype(x.dtype) @ params["w_up"]


def _experts_from_gmm(gmm):
    """Routed experts built from an off-the-shelf grouped matmul with XLA gather/scatter-add."""

    def experts(lat, ids, w, w1, w3, w2):
        t, k = ids.shape
        flat = ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        tok = order // k
        gs = jnp.bincount(flat, length=w1.shape[0]).astype(jnp.int32)
        xs = lat[tok]  # [T·k, L]
        a = situ_glu(gmm(xs, w1, gs), gmm(xs, w3, gs)).astype(lat.dtype)
        y = gmm(a, w2, gs).astype(jnp.float32) * w.reshape(-1)[order][:, None]
        return jnp.zeros((t, lat.shape[1]), jnp.float32).at[tok].add(y).astype(lat.dtype)

    return experts


def bench_layer(results, impls):
    c = LAYER
    params = _layer_params(jax.random.PRNGKey(7))
    x = jax.random.normal(jax.random.PRNGKey(8), (c["T"], c["D"]), jnp.bfloat16)
    cot = jax.random.normal(jax.random.PRNGKey(9), (c["T"], c["D"]), jnp.bfloat16)
    variants = {"ours": functools.partial(moe_ffn, implementation="pallas")}
    variants.update({f"{n}_xla_gather": _experts_from_gmm(f) for n, f in impls.items() if n != "lax.ragged_dot"})
    row = dict(config=c)
    ref = None
    for name, experts in variants.items():
        try:
            fwd = jax.jit(lambda p, x: _routed_layer(p, x, experts))
            train = jax.jit(lambda p, x, g: _value_and_vjp(lambda p, x: _routed_layer(p, x, experts), p, x, g))
            out = fwd(params, x)
            ref = out if ref is None else ref
            row[name] = dict(
                rel_vs_ours=rel(out.astype(jnp.float32), ref.astype(jnp.float32)),
                fwd_ms=timeit(fwd, params, x),
                train_ms=timeit(train, params, x, cot),
            )
        except Exception as ex:  # noqa: BLE001
            row[name] = dict(error=repr(ex)[:500])
            traceback.print_exc()
        print("layer", name, row[name])
    results["layer"] = row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_moe.json")
    ap.add_argument("--skip-tune", action="store_true")
    ap.add_argument("--skip-tune-bwd", action="store_true", help="keep the default tgmm (weight gradient) tiling")
    ap.add_argument("--tgmm-candidates", default="", help="indices into kernel_gpu_tgmm.TGMM_CANDIDATES (default: all)")
    ap.add_argument("--gmm-candidates", default="", help="indices into moe_tuning.GMM_CANDIDATES (default: all)")
    ap.add_argument("--shapes", default="0,1,2", help="indices into GMM_SHAPES, in run order")
    ap.add_argument("--skip", default="", help="comma list of: checks, layer, lax.ragged_dot, tokamax, jla, torch")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip stages that start after this")
    ap.add_argument("--groups", default="uneven", choices=("uneven", "router"),
                    help="group sizes: uneven weights in [0.5, 1.5], or a fresh router's near-even counts")
    args = ap.parse_args()
    moe_groups.GROUPS = args.groups
    import moe_tuning  # benchmarks/ is the script's directory

    start = time.perf_counter()
    in_budget = lambda: time.perf_counter() - start < args.budget_s
    skip = set(filter(None, args.skip.split(",")))
    dev = jax.devices()[0]
    results = dict(device=str(dev.device_kind), jax=jax.__version__, checks={}, tuning=[], tuning_bwd=[], gmm=[], layer={})
    save = lambda: json.dump(results, open(args.out, "w"), indent=1)
    if "checks" not in skip:
        check_ours(results)
        check_moe_ffn(results)
        save()
    impls = {k: v for k, v in peers().items() if k not in skip}
    tilings, tgmm_tilings = {}, {}
    picks = [kernel_gpu_tgmm.TGMM_CANDIDATES[int(i)] for i in filter(None, args.tgmm_candidates.split(","))]
    if picks and picks[0] != kernel_gpu_tgmm.TGMM_TILING:  # the first is the reference for rel_vs_default
        picks.insert(0, kernel_gpu_tgmm.TGMM_TILING)
    gmm_picks = [moe_tuning.GMM_CANDIDATES[int(i)] for i in filter(None, args.gmm_candidates.split(","))] or None
    for idx in map(int, args.shapes.split(",")):
        if not in_budget():
            print("budget spent: skipping shape", GMM_SHAPES[idx])
            continue
        shape = GMM_SHAPES[idx]
        if not args.skip_tune:
            moe_tuning.tune(results, *shape, candidates=gmm_picks)  # sets the forward tiling used at this shape
            moe_tuning.tune(results, *shape, transpose_rhs=True, candidates=gmm_picks)  # and the input gradient's
        tilings[str(shape)] = dataclasses.asdict(kernel_gpu.GMM_TILING)
        tilings[str(shape) + " dlhs"] = dataclasses.asdict(kernel_gpu.GMM_TILING_T)
        tgmm_cfg = kernel_gpu_tgmm.TGMM_TILING if args.skip_tune_bwd else moe_tuning.tune_bwd(results, *shape, picks)
        tgmm_tilings[str(shape)] = dataclasses.asdict(tgmm_cfg)
        bench_gmm(results, shape, impls, tgmm_cfg, with_torch="torch" not in skip)
        results["gmm_tiling"], results["tgmm_tiling"] = tilings, tgmm_tilings
        save()
    if "layer" not in skip and in_budget():
        if not args.skip_tune:
            for transpose_rhs in (False, True):
                moe_tuning.tune(results, LAYER["T"] * LAYER["k"], LAYER["E"], LAYER["L"], LAYER["F"], transpose_rhs,
                                gmm_picks)
        if not args.skip_tune_bwd:  # moe_ffn takes the module default (first traced at the layer's shapes here)
            kernel_gpu_tgmm.TGMM_TILING = moe_tuning.tune_bwd(results, LAYER["T"] * LAYER["k"], LAYER["E"], LAYER["L"], LAYER["F"], picks)
        results["layer_tiling"] = dataclasses.asdict(kernel_gpu.GMM_TILING)
        results["layer_tgmm_tiling"] = dataclasses.asdict(kernel_gpu_tgmm.TGMM_TILING)
        bench_layer(results, impls)
        save()
    print_table(results)


def print_table(results):
    print(f"\n{results['device']} jax {results['jax']}")
    for row in results["gmm"]:
        s = row["shape"]
        ceil = row.get("dense_einsum", {})
        key = str([s["M"], s["E"], s["K"], s["N"]]).replace("[", "(").replace("]", ")")
        print(f"M={s['M']} E={s['E']} K={s['K']} N={s['N']}  tgmm tiling {results.get('tgmm_tiling', {}).get(key)}")
        for name, r in row.items():
            if not isinstance(r, dict) or "fwd_ms" not in r:
                if isinstance(r, dict) and "error" in r:
                    print(f"  {name:16s} ERROR {r['error'][:120]}")
                continue
            frac = ""
            if "fwd_ms" in ceil:
                frac = f" ceil× fwd {ceil['fwd_ms'] / r['fwd_ms']:.2f} train {ceil['train_ms'] / r['train_ms']:.2f}"
            print(f"  {name:16s} fwd {r['fwd_ms']:8.2f} ms ({r['fwd_tflops']:5.0f} TF/s)  fwd+bwd {r['train_ms']:8.2f} ms{frac}")
    for name, r in results["layer"].items():
        if isinstance(r, dict) and "fwd_ms" in r:
            print(f"layer {name:22s} fwd {r['fwd_ms']:8.2f} ms  fwd+bwd {r['train_ms']:8.2f} ms  rel {r['rel_vs_ours']:.2e}")


if __name__ == "__main__":
    main()
