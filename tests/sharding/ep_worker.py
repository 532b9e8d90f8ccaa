"""Multi-device EP checks (run by test_ep.py in a subprocess with 8 CPU devices)."""

import jax
import jax.numpy as jnp

jax.config.update("jax_default_matmul_precision", "highest")

from pallas_kernels.moe.reference import moe_ffn_dense  # noqa: E402
from sharding import make_mesh, use_mesh  # noqa: E402
from sharding.ep import moe_ffn_ep  # noqa: E402
from tests.sharding.multidevice import emit, value_error  # noqa: E402
from tests.tolerances import rel_rmse  # noqa: E402

E, K_TOP, L, F, N = 16, 4, 16, 12, 128


def _inputs(skew: float):
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    x = jax.random.normal(keys[0], (N, L))
    # A skewed router: experts 0..3 (all on expert rank 0) get a large logit bonus.
    logits = jax.random.normal(keys[1], (N, E)) + skew * (jnp.arange(E) < 4)
    scores = jax.nn.sigmoid(logits)
    _, ids = jax.lax.top_k(logits, K_TOP)
    w = jnp.take_along_axis(scores, ids, 1)
    w = w / w.sum(-1, keepdims=True)
    ws = [jax.random.normal(k, s) * 0.3 for k, s in zip(keys[2:], [(E, L, F), (E, L, F), (E, F, L)])]
    return x, ids, w, *ws


def _compare(mesh, args, **kw):
    """Forward and gradients (x, weights, w1, w2) of the EP op vs the dense single-device oracle."""
    x, ids, w, w1, w3, w2 = args

    def fwd_grad(ffn):
        def run(x, w, w1, w2):
            (y, stats), vjp = jax.vjp(lambda *a: ffn(a[0], ids, a[1], a[2], w3, a[3]), x, w, w1, w2, has_aux=False)
            return y, stats, vjp((jnp.cos(y), jax.tree.map(jnp.zeros_like, stats)))
        return run

    ref = lambda *a: (moe_ffn_dense(*a), {})
    y_ref, _, g_ref = fwd_grad(ref)(x, w, w1, w2)
    with use_mesh(mesh):
        y, stats, g = jax.jit(fwd_grad(lambda *a: moe_ffn_ep(*a, **kw)))(x, w, w1, w2)
    return {"fwd": rel_rmse(y, y_ref), "grad": max(rel_rmse(a, b) for a, b in zip(g, g_ref)),
            "overflow": int(stats["ep_overflow"]), "dropped": int(stats["ep_dropped"])}


def check_reductions(mesh):
    """QB histogram pooled over every token axis == the single-device update; token_mean == mean."""
    from jax.sharding import PartitionSpec as P

    from k3jax import balance
    from sharding.reduce import quantile_bias_hist_sharded, token_mean

    keys = jax.random.split(jax.random.PRNGKey(7), 2)
    scores = jax.nn.sigmoid(jax.random.normal(keys[0], (N, E)))
    bias = 0.1 * jax.random.normal(keys[1], (E,))
    kw = dict(num_bins=64, margin_range=(-1.0, 1.0))
    ref = balance.quantile_bias_hist(scores, bias, K_TOP, **kw)
    with use_mesh(mesh) as ctx:
        got = jax.jit(lambda s, b: quantile_bias_hist_sharded(s, b, K_TOP, **kw))(scores, bias)
        mean = jax.jit(jax.shard_map(lambda s: token_mean(jnp.sum(s), jnp.float32(s.size)), mesh=mesh,
                                     in_specs=P(ctx.token_axes, None), out_specs=P(), check_vma=False))(scores)
    local = balance.quantile_bias_hist(scores[: N // 8], bias, K_TOP, **kw)  # one shard alone
    return {"qb": rel_rmse(got, ref), "qb_local_differs": rel_rmse(local, ref) > 1e-3,
            "mean": rel_rmse(mean, jnp.mean(scores))}


def main():
    out = {}
    balanced, skewed = _inputs(0.0), _inputs(4.0)
    mesh = make_mesh(data=2, expert=4)
    # Reserve 1.0 (buffers twice the plan): the all-to-all path itself, no overflow.
    out["a2a"] = _compare(mesh, balanced, strategy="a2a", reserve=1.0)
    out["skewed"] = _compare(mesh, skewed, strategy="a2a", reserve=0.25)
    out["gather"] = _compare(mesh, balanced, strategy="gather")
    out["data_only"] = _compare(make_mesh(data=8), balanced)
    bad = _inputs(0.0)
    with use_mesh(make_mesh(data=1, expert=8)):
        w1 = jnp.zeros((12, L, F))
        out["err_experts"] = value_error(lambda: moe_ffn_ep(bad[0], bad[1] % 12, bad[2], w1, w1, jnp.zeros((12, F, L))))
    with use_mesh(mesh):
        out["err_tokens"] = value_error(lambda: moe_ffn_ep(bad[0][:6], *[a[:6] for a in bad[1:3]], *bad[3:]))
    out["reductions"] = check_reductions(make_mesh(data=2, expert=2, sequence=2))
    emit(out)


if __name__ == "__main__":
    main()
