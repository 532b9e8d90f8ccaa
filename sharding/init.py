"""Sharded initialisation and placement of loaded parameters.

Initialising a 2.8 T-parameter model on one device is impossible, so ``sharded_init`` never
materialises the whole tree anywhere (flax examples/lm1b ``setup_initial_state`` pattern):

1. ``jax.eval_shape(init)`` gives the abstract tree with every leaf's logical axis names;
2. the rules turn names into ``PartitionSpec``s (a mesh axis that does not divide its dim moves to
   another dim it divides, or is dropped);
3. ``jax.jit(init, out_shardings=…)`` creates each shard directly on its device.

``shard_params`` places an existing (e.g. loaded from safetensors) tree the same way.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import flax.linen as nn
import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from sharding.rules import Rules, rules_for_mesh

logger = logging.getLogger(__name__)


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def logical_axes(boxed_tree: Any) -> Any:
    """Tree of logical ``PartitionSpec``s (unboxed structure); ``PartitionSpec()`` for unnamed leaves."""
    return nn.get_partition_spec(boxed_tree)


def _fit(mesh_spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh | AbstractMesh,
         fixed: tuple[int, ...] = ()) -> PartitionSpec:
    """Keep only mesh axes whose product divides the dimension. An axis left out moves to the largest
    other dimension that is still unsharded, not in ``fixed``, and divisible by it (else the array is
    replicated over it): K3's ``embed`` = 7168 = 7·1024 takes fsdp=64 of fsdp × expert = 64 × 32,
    and expert=32 goes to the weight's head or MLP width instead of holding 32 copies."""
    out, left = [], []
    for dim, axes in zip(shape, tuple(mesh_spec) + (None,) * (len(shape) - len(mesh_spec))):
        names = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
        kept, size = [], 1
        for name in names:
            if dim % (size * mesh.shape[name]) == 0:
                kept.append(name)
                size *= mesh.shape[name]
            else:
                left.append(name)
        out.append(None if not kept else (kept[0] if len(kept) == 1 else tuple(kept)))
    for name in left:
        free = [i for i, d in enumerate(shape) if out[i] is None and i not in fixed and d % mesh.shape[name] == 0]
        to = max(free, key=lambda i: shape[i]) if free else None
        if to is not None:
            out[to] = name
        logger.debug("a dim of %s does not split over %s; it goes to dim %s", shape, name, to)
    return PartitionSpec(*out)


def fitted_spec(names: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh | AbstractMesh,
                rules: Rules) -> PartitionSpec:
    """The ``PartitionSpec`` an array with these logical dim names gets on ``mesh`` (`_fit` of the
    rules' spec; dims whose name the rules pin to None, e.g. the scanned stack's layers, never take
    a left-over axis)."""
    pinned = {n for n, axes in rules if axes is None}
    fixed = tuple(i for i, n in enumerate(names) if n in pinned)
    return _fit(nn.logical_to_mesh_axes(tuple(names), rules), tuple(shape), mesh, fixed)


def shardings_for(abstract: Any, logical: Any, mesh: Mesh, rules: Rules | None = None) -> Any:
    """``NamedSharding`` per leaf of ``abstract`` (shapes) from its logical names ``logical``."""
    rules = rules_for_mesh(mesh) if rules is None else rules

    def one(names: PartitionSpec, leaf) -> NamedSharding:
        return NamedSharding(mesh, fitted_spec(tuple(names), tuple(leaf.shape), mesh, rules))

    return jax.tree.map(one, logical, abstract, is_leaf=_is_spec)


def sharded_init(
    init_fn: Callable[..., Any], mesh: Mesh, *args, rules: Rules | None = None, **kwargs
) -> tuple[Any, Any]:
    """``init_fn(*args, **kwargs)`` (e.g. ``model.init``) created shard by shard on ``mesh``.

    Returns ``(variables, shardings)``: the unboxed variables, each leaf a sharded ``jax.Array``,
    and the ``NamedSharding`` tree (reuse it for optimizer state and checkpoint restore).
    """
    boxed = jax.eval_shape(init_fn, *args, **kwargs)
    logical = logical_axes(boxed)
    abstract = nn.unbox(boxed)
    shardings = shardings_for(abstract, logical, mesh, rules)
    unboxed_init = lambda *a, **k: nn.unbox(init_fn(*a, **k))
    with jax.set_mesh(mesh):
        variables = jax.jit(unboxed_init, out_shardings=shardings)(*args, **kwargs)
    return variables, shardings


def shard_params(tree: Any, logical: Any, mesh: Mesh, rules: Rules | None = None) -> Any:
    """Place a plain array tree (a loaded checkpoint) on ``mesh`` by its logical names.

    ``logical`` is the tree :func:`logical_axes` returns for the boxed abstract variables
    (``jax.eval_shape(model.init, ...)``); only that structure's leaves are needed.
    """
    shardings = shardings_for(tree, logical, mesh, rules)
    return jax.tree.map(jax.device_put, tree, shardings)
