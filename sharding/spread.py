"""Independent matrices spread over every device: Muon's Newton–Schulz computed once per matrix.

A stack of weight matrices ``[*batch, r, o]`` is stored sharded for the model: K3's expert leaf
``[layers, experts, L, F]`` has its experts over ``expert`` and its width ``L`` over ``fsdp``.
Newton–Schulz needs whole ``[r, o]`` matrices, so run on that layout every ``fsdp`` rank holds the
same experts and repeats the same iterations (K3 on fsdp=64: each expert matrix orthogonalised 64
times per step, its Gram products all-reduced over fsdp at every iteration). :func:`map_matrices`
moves the mesh axes that split the matrices (and those that replicate them) onto the batch instead:
one all-to-all in, one out, and each device orthogonalises its own whole matrices.

Callers give logical names (``sharding/rules.py``); the mesh axes are resolved here.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from sharding.context import current
from sharding.init import fitted_spec


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def map_matrices(fn: Callable[[jax.Array], jax.Array], x: jax.Array,
                 names: tuple[str | None, ...]) -> jax.Array | None:
    """``fn`` on every trailing ``[r, o]`` matrix of ``x`` (``[*batch, r, o]``, dims named ``names``),
    each matrix on one device; None without an active multi-device mesh (call ``fn`` as usual).

    Under ``shard_map`` on ``x``'s stored layout: a device's batch block stays where it is; an
    all-to-all over each mesh axis that splits ``r`` or ``o`` trades those slices for whole matrices
    (the block's matrices padded with zero matrices to a multiple of the axes' size; ``fn`` must map
    zeros to finite values, its results on them are dropped); each mesh axis that replicates ``x``
    takes its share of those where they divide evenly (an all-gather afterwards). Then the same
    exchanges backwards: the result has ``x``'s layout.
    """
    ctx = current()
    if ctx is None or ctx.mesh.size == 1:
        return None
    if len(names) != x.ndim or x.ndim < 3:
        raise ValueError(f"names={names} must name the {x.ndim} dims of x {x.shape} ([*batch, r, o], batch ≥ 1)")
    mesh = ctx.mesh
    entries = (tuple(fitted_spec(names, x.shape, mesh, ctx.rules)) + (None,) * x.ndim)[:x.ndim]
    used = {a for e in entries for a in _axes(e)}
    # minor axis first: device (f, e) of r split over (fsdp, expert) holds slice f·E + e
    rows, cols = _axes(entries[-2])[::-1], _axes(entries[-1])[::-1]
    split = math.prod(mesh.shape[a] for a in rows + cols)
    spare = tuple(a for a, n in mesh.shape.items() if n > 1 and a not in used)

    def body(block):
        m = block.reshape(-1, *block.shape[-2:])
        count = m.shape[0]
        m = jnp.pad(m, ((0, -(-count // split) * split - count), (0, 0), (0, 0)))
        for a in rows:
            m = jax.lax.all_to_all(m, a, 0, 1, tiled=True)
        for a in cols:
            m = jax.lax.all_to_all(m, a, 0, 2, tiled=True)
        shared = []
        for a in spare:  # replicas of x: each takes an equal share of the matrices, where that divides
            if m.shape[0] % mesh.shape[a] == 0:
                k = m.shape[0] // mesh.shape[a]
                m = jax.lax.dynamic_slice_in_dim(m, jax.lax.axis_index(a) * k, k, 0)
                shared.append(a)
        m = jax.vmap(fn)(m)
        for a in reversed(shared):
            m = jax.lax.all_gather(m, a, axis=0, tiled=True)
        for a in reversed(cols):
            m = jax.lax.all_to_all(m, a, 2, 0, tiled=True)
        for a in reversed(rows):
            m = jax.lax.all_to_all(m, a, 1, 0, tiled=True)
        return m[:count].reshape(block.shape)

    spec = PartitionSpec(*entries)
    return jax.shard_map(body, mesh=mesh, in_specs=(spec,), out_specs=spec, check_vma=False)(x)
