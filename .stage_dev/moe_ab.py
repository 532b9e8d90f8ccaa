"""A/B at K3 width: routed MoE fwd+bwd, packed [W1|W3] (one gmm of width 2F) vs two gmms (no concat/split)."""
import functools, json, os, sys, time
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp
from bench_moe import timeit_interleaved
from pallas_kernels.moe import ops
from pallas_kernels.moe.activations import split_gated_activation
from pallas_kernels.moe.dispatch import combine, permute

def split_ffn(x, ids, wts, w1, w3, w2):
    gmm = ops.grouped_matmul
    xs, gs, inv = permute(x, ids, w1.shape[0])
    g, u = gmm(xs, w1, gs), gmm(xs, w3, gs)
    a = split_gated_activation(g, u, "situ", 4.0, 25.0, x.dtype)
    return combine(gmm(a, w2, gs), inv, wts)

def packed_ffn(x, ids, wts, w1, w3, w2):
    return ops.moe_ffn(x, ids, wts, w1, w3, w2)

T, K, E, L, F = int(os.environ.get("T", 8192)), 16, 56, 3584, 3072
k = jax.random.split(jax.random.key(0), 6)
x = jax.random.normal(k[0], (T, L), jnp.bfloat16)
ids = jnp.argsort(jax.random.uniform(k[1], (T, E)), axis=1)[:, :K].astype(jnp.int32)
wts = jax.nn.softmax(jax.random.normal(k[2], (T, K)), -1)
res = {}
for master in ("bf16", "fp32"):
    dt = jnp.bfloat16 if master == "bf16" else jnp.float32
    w1 = (0.02 * jax.random.normal(k[3], (E, L, F))).astype(dt)
    w3 = (0.02 * jax.random.normal(k[4], (E, L, F))).astype(dt)
    w2 = (0.02 * jax.random.normal(k[5], (E, F, L))).astype(dt)
    calls = {}
    for name, fn in (("packed", packed_ffn), ("split", split_ffn)):
        def loss(x, w1, w3, w2, fn=fn):
            cast = lambda w: w.astype(jnp.bfloat16)
            return jnp.sum(fn(x, ids, wts, cast(w1), cast(w3), cast(w2)).astype(jnp.float32))
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
        t0 = time.perf_counter(); c = step.lower(x, w1, w3, w2).compile()
        print(master, name, "compile", round(time.perf_counter() - t0, 1), "s", flush=True)
        calls[name] = (c, (x, w1, w3, w2))
    out = {n: c(*a) for n, (c, a) in calls.items()}
    err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) for a, b in
              zip(jax.tree.leaves(out["packed"]), jax.tree.leaves(out["split"])))
    ms = timeit_interleaved(calls, reps=10, min_ms=1.0)
    flops = 6 * T * K * 3 * L * F
    res[master] = {n: {"ms": v, "tflops": flops / v / 1e9} for n, v in ms.items()}
    res[master]["max_abs_diff"] = err
    print(master, json.dumps(res[master]), flush=True)
    del calls, out
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "moe_ab.json"), "w"), indent=1)
