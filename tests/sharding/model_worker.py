"""tiny() forward and gradients on meshes of 8 devices vs one device (run by test_model_sharded.py).

By default a 3-layer cut of tiny() (KDA + dense, KDA + MoE, MLA + MoE: every layer kind, two
AttnRes blocks) on the two meshes that shard all of data, expert and sequence (one with 4 sequence
shards: the KDA state hops across several), and on data2_expert4 (no sequence split: KDA's short conv
takes ``short_convs``, partitioned by XLA). ``--all``: the 6-layer tiny() on all four meshes.
"""

import dataclasses
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

jax.config.update("jax_default_matmul_precision", "highest")

from k3jax.config import tiny  # noqa: E402
from k3jax.model import Transformer  # noqa: E402
from sharding import logical_axes, make_mesh, shard_params, sharded_init, use_mesh  # noqa: E402
from tests.sharding.multidevice import emit  # noqa: E402
from tests.tolerances import rel_rmse  # noqa: E402

B, T = 8, 64
FAST_MESHES = ("data2_expert2_seq2", "seq4_expert2", "data2_expert4")
MESHES = {
    "data8": dict(data=8),
    "data2_expert4": dict(data=2, expert=4),
    "data2_expert2_seq2": dict(data=2, expert=2, sequence=2),
    "seq4_expert2": dict(data=1, sequence=4, expert=2),
}


def _batch():
    tokens = jax.random.randint(jax.random.PRNGKey(1), (B, T), 0, 256)
    t = jnp.arange(T)
    # Documents that straddle every sequence-shard boundary, and one that starts exactly on one.
    seg = jnp.where(jnp.arange(B)[:, None] % 2 == 0, (t >= 13).astype(jnp.int32) + (t >= 32), 0)
    return tokens, seg


def _step(model):
    def run(variables, tokens, seg):
        def loss(params):
            logits, state = model.apply({**variables, "params": params}, tokens, segment_ids=seg,
                                        mutable=["stats"])
            return jnp.mean(jnp.sin(logits)), (logits, state["stats"])
        grads, (logits, stats) = jax.grad(loss, has_aux=True)(variables["params"])
        return logits, grads, stats
    return jax.jit(run)


def _loads(stats):
    return {k: v for k, v in jax.tree_util.tree_flatten_with_path(stats)[0]
            if "loads" in jax.tree_util.keystr(k)}


def main():
    full = "--all" in sys.argv[1:]
    cfg = dataclasses.replace(tiny(), dtype=jnp.float32, **({} if full else dict(num_layers=3)))
    model = Transformer(cfg)
    tokens, seg = _batch()
    boxed = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)
    variables = jax.jit(lambda *a: nn.unbox(model.init(*a)))(jax.random.PRNGKey(0), tokens)
    logits_ref, grads_ref, stats_ref = _step(model)(variables, tokens, seg)
    loads_ref = _loads(stats_ref)
    out = {}
    for name, axes in MESHES.items():
        if not full and name not in FAST_MESHES:
            continue
        start = time.time()
        mesh = make_mesh(**axes)
        placed = shard_params(variables, logical_axes(boxed), mesh)
        with use_mesh(mesh):
            logits, grads, stats = _step(model)(placed, tokens, seg)
        grad_err = jax.tree.map(rel_rmse, grads, grads_ref)
        loads = _loads(stats)
        worst = max(jax.tree_util.tree_flatten_with_path(grad_err)[0], key=lambda kv: kv[1])
        out[name] = {
            "fwd": rel_rmse(logits, logits_ref),
            "grad": worst[1],
            "worst_grad_leaf": jax.tree_util.keystr(worst[0]),
            "loads_equal": all(bool(jnp.all(loads[k] == loads_ref[k])) for k in loads_ref),
            "ep_dropped": sum(int(jnp.sum(v)) for k, v in jax.tree_util.tree_flatten_with_path(stats)[0]
                              if "ep_dropped" in jax.tree_util.keystr(k)),
            "seconds": round(time.time() - start, 1),
        }
    mesh = make_mesh(data=2, expert=4)
    init_sharded, _ = sharded_init(model.init, mesh, jax.random.PRNGKey(0), tokens)
    # Same key, same values: jit(init) on one device vs jit(init, out_shardings) on the mesh.
    out["sharded_init_equal"] = jax.tree.structure(init_sharded) == jax.tree.structure(variables) and all(
        bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(init_sharded), jax.tree.leaves(variables)))
    w1 = init_sharded["params"]["layers_1"]["moe"]["w1"]
    out["w1_shard_shape"] = list(w1.addressable_shards[0].data.shape)
    emit(out)


if __name__ == "__main__":
    main()
