"""Subprocess with 8 fake CPU devices: the gradients and one train step sharded (data × expert × fsdp = 2 × 2 × 2) vs on
one device; prints the max relative differences as JSON."""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import dataclasses  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from k3jax.train.config import MeshConfig  # noqa: E402
from k3jax.train.loop import make_data  # noqa: E402
from k3jax.train.parallel import make_train_mesh  # noqa: E402
from k3jax.train.step import Trainer  # noqa: E402
from tests.k3jax.train import toy  # noqa: E402


def run(cfg, step: bool):
    """Gradients and loss of one batch; with ``step``, one train step too (the sharded run: the
    single-device step would only compile the same update again)."""
    trainer = Trainer(cfg, make_train_mesh(cfg))
    state = trainer.init_state(jax.random.key(0))
    batch = next(make_data(cfg))

    def grads_and_loss(s, b):
        (grads, aux), denom, _ = trainer._grads(s, b)
        return grads, aux["ce"] / denom

    with trainer._context():
        grads, loss = jax.device_get(jax.jit(grads_and_loss)(state, batch))
    if step:
        state, metrics = trainer.step(state, batch)
        assert abs(float(metrics["loss"]) - float(loss)) <= 1e-5 * abs(float(loss)), (metrics["loss"], loss)
    shardings = {jax.tree_util.keystr(p): str(x.sharding.spec) for p, x in
                 jax.tree_util.tree_flatten_with_path(state.params)[0] if hasattr(x.sharding, "spec")}
    return grads, loss, shardings


def main():
    toy.use_compilation_cache()
    # float32 compute, so that only the sharding (not bf16 rounding of reordered sums) can differ
    model = dataclasses.replace(toy.micro_train_config().model, dtype=jnp.float32)
    single, loss_single, _ = run(toy.micro_train_config(batch_size=8, model=model), step=False)
    sharded, loss_sharded, specs = run(toy.micro_train_config(
        batch_size=8, model=model, mesh=MeshConfig(axes=(("data", 2), ("expert", 2), ("fsdp", 2)))), step=True)
    rel = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-30))
    flat = jax.tree_util.tree_flatten_with_path(single)[0]
    rels = sorted(((rel(a, b), jax.tree_util.keystr(p)) for a, (p, b) in zip(jax.tree.leaves(sharded), flat)
                   if np.any(b)), reverse=True)
    params = rels[0][0]
    print(json.dumps({"devices": jax.device_count(), "loss_single": float(loss_single), "loss_sharded": float(loss_sharded),
                      "grads_rel": params, "worst": rels[:4], "sharded_leaves": sum(s != "PartitionSpec()" for s in specs.values()),
                      "w1_spec": next(v for k, v in specs.items() if k.endswith("['w1']"))}))


if __name__ == "__main__":
    main()
