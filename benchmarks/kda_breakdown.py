"""Where KDA time goes, for ``bench_kda.py``: the XLA prep alone and its stages, and the device time
per kernel of each JAX implementation (``--breakdown``, ``--profile``)."""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp

from bench_kda import jax_sync, make_inputs, median_ms


def breakdown(shape, iters, block_vs=""):
    """Where our time goes at one shape: XLA prep vs the scan kernels, and the V block."""
    from pallas_kernels.kda import kernel_gpu, kernel_gpu_intra

    (q, k, v, g, b), do = make_inputs(5, *shape)
    scale = shape[-1] ** -0.5
    res = {}
    for precision in ("highest", "tf32"):
        prep = lambda q, k, v, g, b, p=precision: kernel_gpu_intra.prepare(
            q, k, v, g, b, scale=scale, segment_ids=None, chunk=kernel_gpu.CHUNK, precision=p)
        outs = jax.jit(prep)(q, k, v, g, b)
        cot = [jax.random.normal(jax.random.PRNGKey(i), x.shape, x.dtype) for i, x in enumerate(outs)]

        @jax.jit
        def prep_fb(q, k, v, g, b, prep=prep, cot=cot):
            loss = lambda *a: sum(jnp.sum(x * c) for x, c in zip(prep(*a), cot))
            return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, b)

        res[f"prep_{precision}_fwd"] = median_ms(jax.jit(prep), [(q, k, v, g, b)], iters, jax_sync)
        res[f"prep_{precision}_fwdbwd"] = median_ms(prep_fb, [(q, k, v, g, b)], iters, jax_sync)
        print(f"breakdown {shape}: {res}", flush=True)
        del outs, cot
    for bv in [int(x) for x in block_vs.split(",") if x]:
        def run(q, k, v, g, b, bv=bv):
            return kernel_gpu.chunk_kda_pallas(q, k, v, g, b, scale=scale, block_v=bv)[0]

        fb = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(run(*a).astype(jnp.float32) * do), argnums=(0, 1, 2, 3, 4)))
        for mode, fn in (("fwd", jax.jit(run)), ("fwdbwd", fb)):
            try:
                res[f"bv{bv}_{mode}"] = median_ms(fn, [(q, k, v, g, b)], iters, jax_sync)
            except Exception as err:
                res[f"bv{bv}_{mode}_error"] = f"{type(err).__name__}: {err}"[:400]
    print(f"breakdown {shape}: {res}", flush=True)
    return res


def prep_stages(shape, iters, precision="tf32"):
    """The XLA prep cut into its stages, each jitted alone on materialised inputs: fwd and fwd+bwd ms.

    Stages: ``layout`` (pad, fp32 head-major copies, in-chunk cumsum), ``scores`` (anchored A_qk and
    A_kk over 16-token tiles), ``solve`` (product-form tile inverses + block substitution on
    [βv | βk e^G]). Their sum next to the whole prep shows what fusion already saves.
    """
    from pallas_kernels.kda import kernel_gpu_intra as intra

    (q, k, v, g, b), _ = make_inputs(6, *shape)
    C, sub = 64, intra.SUB
    n = -(-shape[1] // C)
    einsum = functools.partial(jnp.einsum, precision=intra.PRECISIONS[precision])

    def layout(q, k, v, g):
        q, k, v, g = (intra._head_major(x, n, C) for x in (q, k, v, g))
        return q, k, v, jnp.cumsum(g, axis=-2)

    hq, hk, hv, G = jax.jit(layout)(q, k, v, g)
    scores = lambda q, k, G: intra._anchored_scores(q, k, G, sub, einsum)
    a_kk = jnp.tril(jax.jit(scores)(hq, hk, G)[1], -1) * 0.1
    rhs = jnp.concatenate([hv, hk], axis=-1)
    solve = lambda a, r: intra._solve_unit_lower(a, r, sub, einsum)
    res = {}
    for name, fn, args in (("layout", layout, (q, k, v, g)), ("scores", scores, (hq, hk, G)),
                           ("solve", solve, (a_kk, rhs))):
        out = jax.jit(fn)(*args)
        cot = [jnp.ones_like(x) for x in jax.tree.leaves(out)]
        loss = lambda *a, fn=fn, cot=cot: sum(jnp.sum(x.astype(jnp.float32) * c)
                                              for x, c in zip(jax.tree.leaves(fn(*a)), cot))
        fb = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args)))))
        res[f"{name}_fwd"] = median_ms(jax.jit(fn), [args], iters, jax_sync)
        res[f"{name}_fwdbwd"] = median_ms(fb, [args], iters, jax_sync)
        print(f"prep stages {shape} ({precision}): {res}", flush=True)
        del out, cot
    return res


def profile_impls(impls, shape, directory, top=12):
    """Device time per kernel of each JAX implementation's fwd and fwd+bwd (3 calls each) at one shape."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from trace_summary import load_events, summarise

    (q, k, v, g, b), do = make_inputs(9, *shape)
    out = {}
    for name, (fwd, fwdbwd, conv, sync) in impls.items():
        # by name: run as a script, bench_kda's functions live in __main__, not in the imported module
        if sync.__name__ != jax_sync.__name__:  # the torch peer's kernels are not in a JAX trace
            continue
        for mode, fn, args in (("fwd", fwd, (q, k, v, g, b)), ("fwdbwd", fwdbwd, (q, k, v, g, b, do))):
            sub = os.path.join(directory, f"{name}-{mode}")
            try:
                jax.block_until_ready(fn(*args))
                with jax.profiler.trace(sub, create_perfetto_trace=True):
                    for _ in range(3):
                        jax.block_until_ready(fn(*args))
                rows = summarise(*load_events(sub), "GPU")
            except Exception as err:
                out[f"{name}-{mode}"] = {"error": f"{type(err).__name__}: {err}"[:400]}
                continue
            grand = sum(ms for _, ms, _ in rows) / 3
            out[f"{name}-{mode}"] = [(n, round(ms / 3, 3), c // 3) for n, ms, c in rows[:top]]
            print(f"profile {shape} {name} {mode}: {grand:.2f} ms per call on the device", flush=True)
            for n, ms, c in rows[:top]:
                print(f"  {ms / 3:8.3f} ms {c // 3:5d}x  {n[:100]}", flush=True)
    return out
