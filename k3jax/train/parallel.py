"""The train state and batches on a device mesh, by the logical-axis rule tables of ``sharding/``.

Parameters and the balancer biases are placed by their logical names (``sharding.shardings_for``);
every optimizer moment mirrors its parameter (``optax.tree_utils.tree_map_params``); counters are
replicated; batches split ``[B, T]`` as the logical ``(batch, length)``. Checks that the config
fits the mesh run here, before anything is compiled.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from k3jax.train.config import TrainConfig


def _is_names(x) -> bool:
    return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)


def _specs(axes: Any) -> Any:
    return jax.tree.map(lambda names: PartitionSpec(*names), axes, is_leaf=_is_names)


def train_rules(cfg: TrainConfig, mesh):
    import sharding

    if cfg.mesh.rules is None:
        return sharding.rules_for_mesh(mesh)
    if cfg.mesh.rules not in sharding.STRATEGIES:
        raise ValueError(f"mesh.rules={cfg.mesh.rules!r} must be None or one of {sorted(sharding.STRATEGIES)}")
    return sharding.STRATEGIES[cfg.mesh.rules]


def make_train_mesh(cfg: TrainConfig, devices=None):
    """The mesh of ``cfg.mesh`` (None when it has no axes), after checking the config fits it."""
    if not cfg.mesh.axes:
        return None
    import sharding
    from sharding.rules import mesh_axes_of

    if devices is None:
        sharding.maybe_initialize_distributed()  # multi-host: before the first look at the devices
        devices = jax.devices()
    unknown = [name for name, _ in cfg.mesh.axes if name not in sharding.AXES]
    if unknown:
        raise ValueError(f"mesh.axes names {unknown}; axes must be among {sharding.AXES}")
    if cfg.mesh.num_devices != len(devices):
        raise ValueError(f"mesh.axes={cfg.mesh.axes} spans {cfg.mesh.num_devices} devices but "
                         f"{len(devices)} are available; the product of the sizes must equal the device count")
    mesh = sharding.make_mesh(**dict(cfg.mesh.axes), devices=devices)
    rules = train_rules(cfg, mesh)
    size = lambda logical: _axes_size(mesh, mesh_axes_of(rules, logical))
    if cfg.micro_batch_size % size("batch"):
        raise ValueError(f"batch_size/micro_batches={cfg.micro_batch_size} must be divisible by the "
                         f"{size('batch')} devices that split the batch on mesh {cfg.mesh.axes}")
    if cfg.seq_len % size("length"):
        raise ValueError(f"seq_len={cfg.seq_len} must be divisible by the {size('length')} devices that "
                         f"split the sequence on mesh {cfg.mesh.axes}")
    experts = size("experts")
    if experts > 1 and cfg.model.moe.num_experts % experts:
        raise ValueError(f"model.moe.num_experts={cfg.model.moe.num_experts} must be divisible by the "
                         f"expert axis size {experts} of mesh {cfg.mesh.axes}")
    if experts > 1 and cfg.model.moe.redundant_experts:
        from sharding.moonep_placement import check_layout

        check_layout(cfg.model.moe.num_experts, cfg.model.moe.redundant_experts, experts)
    return mesh


def _axes_size(mesh, names) -> int:
    n = 1
    for name in names:
        n *= int(mesh.shape.get(name, 1))
    return n


def mirror_shardings(opt_state: Any, params: Any, param_shardings: Any, default) -> Any:
    """A sharding per optimizer-state leaf: its parameter's where the leaf's key path ends in that
    parameter's path with the same shape (moments), ``default`` otherwise (counters).

    (``optax.tree_utils.tree_map_params`` cannot be used: Muon's labels depend on the params' structure.)
    """
    by_path = {}
    for (path, leaf), (_, sh) in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                     jax.tree_util.tree_flatten_with_path(param_shardings)[0]):
        by_path[tuple(path)] = (tuple(leaf.shape), sh)

    def pick(path, leaf):
        for start in range(len(path)):
            hit = by_path.get(tuple(path[start:]))
            if hit is not None and hit[0] == tuple(leaf.shape):
                return hit[1]
        return default

    return jax.tree_util.tree_map_with_path(pick, opt_state)


def state_and_batch_shardings(trainer, mesh) -> dict[str, Any]:
    """``{"state": TrainState of NamedShardings, "batch": …, "replicated": …}`` for ``trainer``."""
    import sharding
    from k3jax.train.step import TrainState

    rules = train_rules(trainer.cfg, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    params = sharding.shardings_for(trainer.abstract["params"], _specs(trainer.axes["params"]), mesh, rules)
    balance = sharding.shardings_for(trainer.abstract["balance"], _specs(trainer.axes["balance"]), mesh, rules)
    opt = mirror_shardings(jax.eval_shape(trainer.tx.init, trainer.abstract["params"]),
                           trainer.abstract["params"], params, replicated)
    state = TrainState(step=replicated, params=params, opt_state=opt, balance=balance,
                       nonfinite_streak=replicated, nonfinite_total=replicated)
    batch = NamedSharding(mesh, sharding.rules.spec(rules, "batch", "length"))
    return {"state": state, "batch": {k: batch for k in ("tokens", "segment_ids", "labels", "loss_mask")},
            "replicated": replicated, "rules": rules}
