"""Multi-device checks of the sharded train step's pieces (run by test_scaling.py, 8 CPU devices).

- ``head_cross_entropy_sharded`` equals the unsharded loss and gradients, and no device gathers
  the features (each computes the head only for its own tokens);
- context-parallel KDA with ``K != V`` (two ``chunk_kda`` calls per shard) equals the unsplit op;
- the EP a2a path's backward has no floating-point scatter, and no buffer of its forward and
  backward (overflow rounds included) holds the gathered ``EP·N·k`` assignments;
- the MoE layer on a data × expert mesh routes (TopK) only its own tokens on each device and
  sums the QB statistics to the single-device ones.
"""

import re

import jax
import jax.numpy as jnp

jax.config.update("jax_default_matmul_precision", "highest")

from k3jax.train.loss import head_cross_entropy  # noqa: E402
from pallas_kernels.kda import chunk_kda  # noqa: E402
from sharding import make_mesh, use_mesh  # noqa: E402
from sharding.cp import chunk_kda_cp  # noqa: E402
from sharding.ep import capacity, moe_ffn_ep  # noqa: E402
from sharding.reduce import head_cross_entropy_sharded  # noqa: E402
from tests.sharding.multidevice import emit, value_error  # noqa: E402
from tests.tolerances import rel_rmse  # noqa: E402


def _max_rel(a, b):
    return max(rel_rmse(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def check_head_ce(mesh, B=8, T=32, D=16, V=40, chunk=16):
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    f = jax.random.normal(ks[0], (B, T, D))
    w = jax.random.normal(ks[1], (D, V)) * 0.3
    y = jax.random.randint(ks[2], (B, T), 0, V)
    m = (jnp.arange(T)[None] < T - 3).astype(jnp.float32) * jnp.ones((B, 1))
    ref = jax.value_and_grad(lambda f, w: head_cross_entropy(f, w, y, m, chunk), (0, 1))(f, w)
    with use_mesh(mesh) as ctx:
        tok = ctx.sharding("batch", "length")
        f_in = jax.device_put(f, ctx.sharding("batch", "length", None))
        fn = jax.jit(jax.value_and_grad(lambda f, w, y, m: head_cross_entropy_sharded(f, w, y, m, chunk), (0, 1)))
        got = fn(f_in, w, jax.device_put(y, tok), jax.device_put(m, tok))
        text = fn.lower(f_in, w, jax.device_put(y, tok), jax.device_put(m, tok)).compile().as_text()
        err = value_error(lambda: head_cross_entropy_sharded(f[:3], w, y[:3], m[:3], chunk))
    gathers = re.findall(r"= (\S+) all-gather\(", text)
    return {"loss": rel_rmse(got[0], ref[0]), "grad": _max_rel(got[1], ref[1]), "all_gathers": gathers,
            "err": err}


def check_kda_k_ne_v(mesh, B=2, T=64, H=2, K=8, V=16, C=8):
    ks = jax.random.split(jax.random.PRNGKey(1), 5)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q, k = unit(jax.random.normal(ks[0], (B, T, H, K))), unit(jax.random.normal(ks[1], (B, T, H, K)))
    v = jax.random.normal(ks[2], (B, T, H, V))
    g = -0.5 * jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H, K)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    t = jnp.arange(T)
    seg = jnp.stack([(t >= T // 4).astype(jnp.int32) + (t >= T // 2 + 3), jnp.zeros(T, jnp.int32)])
    args = (q, k, v, g, beta)

    def fwd_grad(f, a):
        y, vjp = jax.vjp(f, *a)
        return y, vjp(jnp.cos(y))

    ref = fwd_grad(lambda *a: chunk_kda(*a, segment_ids=seg, chunk_size=C, implementation="xla")[0], args)
    with use_mesh(mesh):
        got = jax.jit(lambda *a: fwd_grad(lambda *b: chunk_kda_cp(*b, segment_ids=seg, chunk_size=C), a))(*args)
    return {"fwd": rel_rmse(got[0], ref[0]), "grad": _max_rel(got[1], ref[1])}


def check_ep_hlo(mesh, E=16, k=4, L=16, F=12, N=128, reserve=1.0):
    """Float scatters anywhere in the EP fwd+bwd, and the most rows of any float array in it."""
    ks = jax.random.split(jax.random.PRNGKey(2), 5)
    x = jax.random.normal(ks[0], (N, L))
    _, ids = jax.lax.top_k(jax.random.normal(ks[1], (N, E)), k)
    w = jnp.full((N, k), 1.0 / k)
    ws = [jax.random.normal(kk, s) * 0.3 for kk, s in zip(ks[2:], [(E, L, F), (E, L, F), (E, F, L)])]

    def loss(x, w, w1):
        return jnp.sum(jnp.cos(moe_ffn_ep(x, ids, w, w1, ws[1], ws[2], strategy="a2a", reserve=reserve)[0]))

    with use_mesh(mesh) as ctx:
        text = jax.jit(jax.grad(loss, (0, 1, 2))).lower(x, w, ws[0]).compile().as_text()
        shards = ctx.expert_size * ctx.axis_size("data")
    float_scatters = re.findall(r"= ((?:f|bf)\d+\[[\d,]*\])\S* scatter\(", text)
    rows = [int(r) for r in re.findall(r"(?:f|bf)\d+\[(\d+),[\d,]*\]", text)]
    n_local = N // shards
    return {"float_scatters": float_scatters, "max_rows": max(rows), "while_loops": text.count(" while("),
            "a2a_rows": ctx.expert_size * capacity(n_local, k, ctx.expert_size, reserve),
            "gather_rows": ctx.expert_size * n_local * k}


def check_moe_routing(mesh, B=8, T=16):
    """tiny()'s MoE on the mesh vs one device: output, QB statistics, and TopK on local tokens only."""
    import flax.linen as nn

    from k3jax.config import preset
    from k3jax.layers.moe import MoE

    cfg = preset("tiny")
    x = jax.random.normal(jax.random.PRNGKey(4), (B, T, cfg.hidden))
    variables = nn.unbox(MoE(cfg).init(jax.random.PRNGKey(5), x))
    apply = lambda v, x: MoE(cfg).apply(v, x, mutable=["stats"])
    y_ref, s_ref = apply(variables, x)
    with use_mesh(mesh) as ctx:
        x_in = jax.device_put(x, ctx.sharding("batch", "length", None))
        fn = jax.jit(apply)
        y, stats = fn(variables, x_in)
        text = fn.lower(variables, x_in).compile().as_text()
        shards = ctx.expert_size * ctx.axis_size("data")
    topk_rows = sorted({int(r) for r in re.findall(r"= \((?:f|bf)\d+\[(\d+),\d+\]\S* [^)]*\) custom-call\([^)]*\), "
                                                    r"custom_call_target=\"TopK\"", text)})
    same = {n: bool(jnp.array_equal(stats["stats"][n][0], s_ref["stats"][n][0]))
            for n in ("loads", "hist") if n in s_ref["stats"]}
    return {"fwd": rel_rmse(y, y_ref), "stats_equal": same, "topk_rows": topk_rows, "local_tokens": B * T // shards}


def main():
    out = {
        "ce_data_expert": check_head_ce(make_mesh(data=2, expert=4)),
        "ce_sequence": check_head_ce(make_mesh(data=2, sequence=4)),
        "kda_k_ne_v": check_kda_k_ne_v(make_mesh(data=2, sequence=4)),
        "ep_hlo": check_ep_hlo(make_mesh(data=2, expert=4)),
        "moe_routing": check_moe_routing(make_mesh(data=2, expert=4)),
    }
    emit(out)


if __name__ == "__main__":
    main()
