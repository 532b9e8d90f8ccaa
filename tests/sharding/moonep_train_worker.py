"""MoonEP in the train step on 8 CPU devices (run by test_moonep.py in a subprocess; slow: it compiles a
sharded train step)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_default_matmul_precision", "highest")

from k3jax.train.config import MeshConfig  # noqa: E402
from k3jax.train.loop import make_data  # noqa: E402
from k3jax.train.parallel import make_train_mesh  # noqa: E402
from k3jax.train.step import Trainer  # noqa: E402
from tests.k3jax.train import toy  # noqa: E402
from tests.sharding.multidevice import emit  # noqa: E402


def check_placement_change():
    """A re-plan inside the train step, then a step: bit-identical to a run that starts from the same
    state with that placement and never changes it (a host round trip, as a checkpoint restore)."""
    import dataclasses


    from k3jax.train.config import MeshConfig
    from k3jax.train.loop import make_data
    from k3jax.train.parallel import make_train_mesh
    from k3jax.train.step import Trainer
    from tests.k3jax.train import toy

    base = toy.micro_train_config().model
    model = dataclasses.replace(base, dtype=jnp.float32,
                                moe=dataclasses.replace(base.moe, redundant_experts=8, placement_every=2))
    cfg = toy.micro_train_config(batch_size=8, model=model, mesh=MeshConfig(axes=(("expert", 8),)))
    trainer = Trainer(cfg, make_train_mesh(cfg))
    data = make_data(cfg)
    state = trainer.init_state(jax.random.key(0))
    plans, metrics = [], []
    for _ in range(2):  # the plan changes at the end of step 2
        plans.append(_plan(state))
        state, m = trainer.step(state, next(data))
        metrics.append(jax.device_get(m))
    restored = jax.device_put(jax.device_get(state), trainer.shardings["state"])
    batch = next(data)
    changed, m_changed = trainer.step(state, batch)
    kept, _ = trainer.step(restored, batch)
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), changed, kept)
    return {"bit_identical": all(jax.tree.leaves(same)), "plan_changed": _plan(changed) != plans[0],
            "replicas": int(m_changed["ep_replicas"]), "overflow": int(m_changed["ep_overflow"]),
            "received_max_mean": float(m_changed["ep_received_max_mean"]),
            "losses": [float(m["loss"]) for m in metrics] + [float(m_changed["loss"])]}


def _plan(state):
    leaves = jax.tree_util.tree_flatten_with_path(state.balance)[0]
    return [np.asarray(v).tolist() for p, v in leaves if "replica" in jax.tree_util.keystr(p)]


def main():
    emit(check_placement_change())


if __name__ == "__main__":
    main()
