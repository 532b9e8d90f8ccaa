"""Multi-device MoonEP checks (run by test_moonep.py in a subprocess with 8 CPU devices)."""

import jax
import jax.numpy as jnp

jax.config.update("jax_default_matmul_precision", "highest")

from benchmarks.bench_moonep import zipf_router  # noqa: E402
from pallas_kernels.moe.reference import moe_ffn_dense  # noqa: E402
from sharding import make_mesh, use_mesh  # noqa: E402
from sharding.ep import moe_ffn_ep  # noqa: E402
from sharding.moonep import moe_ffn_moonep  # noqa: E402
from sharding.moonep_placement import plan_replicas, planned_rank_loads  # noqa: E402
from tests.sharding.multidevice import emit  # noqa: E402
from tests.tolerances import rel_rmse  # noqa: E402

E, K_TOP, L, F, N = 32, 4, 16, 8, 2048
RESERVE = 0.25


def _inputs():
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    x = jax.random.normal(keys[0], (N, L))
    ws = [jax.random.normal(k, s) * 0.3 for k, s in zip(keys[2:5], [(E, L, F), (E, L, F), (E, F, L)])]
    ids, w = zipf_router(keys[1], N, E, K_TOP)
    calib, _ = zipf_router(keys[5], 8 * N, E, K_TOP)  # earlier batches: the loads QB accumulated
    return (x, ids, w, *ws), jnp.bincount(calib.reshape(-1), length=E).astype(jnp.float32)


def _fwd_grad(ffn, args):
    """Output, stats and the gradients (x, router weights, w1, w3, w2) under a cosine cotangent."""
    x, ids, w, w1, w3, w2 = args

    def run(x, w, w1, w3, w2):
        (y, stats), vjp = jax.vjp(lambda *a: ffn(a[0], ids, *a[1:]), x, w, w1, w3, w2)
        return y, stats, vjp((jnp.cos(y), jax.tree.map(jnp.zeros_like, stats)))

    return jax.jit(run)(x, w, w1, w3, w2)


def check_layer(mesh_axes, replicas, args, loads):
    """MoonEP vs the no-redundancy EP path and the dense one-device oracle, on a skewed router."""
    mesh = make_mesh(**mesh_axes)
    ep = mesh.shape["expert"]
    plan = jax.jit(plan_replicas, static_argnums=(1, 2))(loads, ep, replicas)
    planned = planned_rank_loads(loads, *plan, ep)
    y_ref, _, g_ref = _fwd_grad(lambda *a: (moe_ffn_dense(*a), {}), args)
    with use_mesh(mesh):
        y_ep, s_ep, g_ep = _fwd_grad(lambda *a: moe_ffn_ep(*a, reserve=RESERVE), args)
        y, s, g = _fwd_grad(lambda *a: moe_ffn_moonep(*a, *plan, reserve=RESERVE), args)
        # No reserve: beyond-the-plan assignments overflow; the fallback computes them (forward only).
        y_over, s_over = jax.jit(lambda *a: moe_ffn_moonep(*a, *plan, reserve=0.0))(*args)
    home = loads.reshape(ep, -1).sum(1)
    return {"fwd": rel_rmse(y, y_ref), "grad": max(rel_rmse(a, b) for a, b in zip(g, g_ref)),
            "fwd_vs_ep": rel_rmse(y, y_ep), "grad_vs_ep": max(rel_rmse(a, b) for a, b in zip(g, g_ep)),
            "overflow": int(s["ep_overflow"]), "dropped": int(s["ep_dropped"]),
            "received_max_mean": float(s["ep_received_max_mean"]),
            "ep_overflow": int(s_ep["ep_overflow"]), "ep_received_max_mean": float(s_ep["ep_received_max_mean"]),
            "planned_max_mean": float(planned.max() / planned.mean()), "home_max_mean": float(home.max() / home.mean()),
            "replicas": int(jnp.sum(plan[1] > 0)), "ep": ep, "reserve": RESERVE,
            "beyond_plan": {"overflow": int(s_over["ep_overflow"]), "dropped": int(s_over["ep_dropped"]),
                            "fwd": rel_rmse(y_over, y_ref)}}


def main():
    args, loads = _inputs()
    emit({"expert8": check_layer(dict(data=1, expert=8), 16, args, loads)})


if __name__ == "__main__":
    main()
