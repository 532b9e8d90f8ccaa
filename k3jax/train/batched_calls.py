"""Independent calls of one function, made as one vmapped call: fewer, wider kernels to compile.

A model of L identical layers traces L copies of every per-layer computation that has no data
dependence between layers, and XLA compiles each copy as its own kernels. Two such places dominate
the compile of k3jax's init and step:

- The parameter init: flax draws every parameter from its own key (``fold_in`` of the root key
  with a hash of the parameter's path), so each parameter is a ``jax.random`` call whose threefry
  rounds XLA compiles separately (small(): 110 s of init compile on the H200).
  `batch_random_draws` makes each stage of same-shaped draws one vmapped draw over the stacked
  keys. JAX's random functions give the same bits for a key whether or not they are vmapped, so
  the values are those of the op-by-op flax init, bit for bit, with the same tree.
- Per-head Muon: ``optax.contrib.muon`` runs Newton–Schulz as one ``scan`` per parameter (small():
  2880 matmuls in the update). `batch_scans` runs same-shaped ones as one scan over a stack.

How: trace ``fn`` to a jaxpr, drop what the outputs do not need (the init forward pass), inline
every ``jit``/``remat`` call except the batchable ones, give each batchable call a *stage* (1 + the
latest stage among the batchable calls it depends on), then evaluate stage by stage: the plain
equations first, then the stage's batchable calls grouped by (callee, argument types), each group
as one vmapped call.
"""

from __future__ import annotations

import collections
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.extend.core import Literal, primitives
from jax._src.interpreters.partial_eval import dce_jaxpr  # no public DCE in JAX 0.11

_DRAW_PRIMITIVES = (primitives.random_bits_p, primitives.random_fold_in_p, primitives.random_split_p)
_INLINED = (primitives.jit_p, primitives.remat_p)


def _takes_key(eqn) -> bool:
    return any(jnp.issubdtype(v.aval.dtype, jax.dtypes.prng_key) for v in eqn.invars
               if hasattr(v.aval, "dtype"))


def _is_draw(eqn) -> bool:
    return (eqn.primitive in _DRAW_PRIMITIVES or eqn.primitive is primitives.jit_p) and _takes_key(eqn)


def _bind(eqn, *args):
    out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(eqn.params))
    return out if eqn.primitive.multiple_results else [out]


def _is_scan(eqn) -> bool:
    return eqn.primitive.name == "scan"


def _inline(jaxpr, consts, args, batchable) -> list:
    """Evaluate ``jaxpr`` in the current trace with its non-batchable ``jit``/``remat`` calls inlined."""
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, Literal) else env[v]
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        if eqn.primitive in _INLINED and not batchable(eqn):
            sub = eqn.params["jaxpr"]
            sub_jaxpr, sub_consts = (sub.jaxpr, sub.consts) if hasattr(sub, "consts") else (sub, [])
            outs = _inline(sub_jaxpr, sub_consts, invals, batchable)
        else:
            outs = _bind(eqn, *invals)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _signature(eqn) -> Any:
    """Equations with equal signatures compute the same function of same-typed inputs."""
    try:
        params = tuple(sorted(eqn.params.items()))
        hash(params)
    except TypeError:
        return id(eqn)
    return eqn.primitive, params, tuple(v.aval for v in eqn.invars)


def _structural_signature(eqn) -> Any:
    """As `_signature`, comparing sub-jaxprs by their text: each scan is traced on its own."""
    if any(getattr(v, "consts", None) for v in eqn.params.values()):
        return id(eqn)  # the text of a closed jaxpr omits its constants' values
    params = tuple(sorted((k, str(v)) for k, v in eqn.params.items()))
    return eqn.primitive, params, tuple(v.aval for v in eqn.invars)


def _stages(jaxpr, batchable) -> dict[int, tuple[list, list]]:
    """stage → (plain equations, batchable calls) such that a stage's inputs are ready before it runs."""
    level: dict[Any, int] = {}
    stages = collections.defaultdict(lambda: ([], []))
    for eqn in jaxpr.eqns:
        s = max((level.get(v, 0) for v in eqn.invars if not isinstance(v, Literal)), default=0)
        batched = batchable(eqn)
        stages[s][1 if batched else 0].append(eqn)
        level.update((v, s + batched) for v in eqn.outvars)
    return stages


class _Env:
    """Values of the flat jaxpr's variables; a batched call's output stays a row of its batch until read."""

    def __init__(self, jaxpr, consts, args):
        self.values = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
        self.rows: dict[Any, tuple[jax.Array, int]] = {}

    def read(self, v):
        if isinstance(v, Literal):
            return v.val
        if v not in self.values:
            batch, j = self.rows[v]
            self.values[v] = batch[j]
        return self.values[v]

    def stacked(self, vs: list) -> jax.Array:
        """``vs``' values stacked; rows of one earlier batch are gathered, not re-stacked."""
        rows = [self.rows.get(v) if not isinstance(v, Literal) else None for v in vs]
        if all(r is not None and r[0] is rows[0][0] for r in rows):
            idx = [j for _, j in rows]
            batch = rows[0][0]
            return batch if idx == list(range(batch.shape[0])) else batch[jnp.array(idx)]
        return jnp.stack([self.read(v) for v in vs])

    def run(self, eqn):
        self.values.update(zip(eqn.outvars, _bind(eqn, *map(self.read, eqn.invars))))

    def run_batched(self, group: list):
        stacked = [self.stacked([e.invars[i] for e in group]) for i in range(len(group[0].invars))]
        # The barrier stores the batch once: without it XLA fuses the (elementwise) draw into every
        # slice that reads it, compiling the threefry rounds once per parameter again. It also keeps
        # XLA from folding the initialiser's scale into the draw, so every value is bit-identical to
        # the op-by-op (un-jitted) flax init, singletons included.
        outs = jax.lax.optimization_barrier(jax.vmap(functools.partial(_bind, group[0]))(*stacked))
        for j, eqn in enumerate(group):
            self.rows.update((v, (o, j)) for v, o in zip(eqn.outvars, outs))


def _out_bytes(eqn) -> int:
    return sum(math.prod(v.aval.shape) * getattr(v.aval.dtype, "itemsize", 8) for v in eqn.outvars)


def _chunks(group: list, max_bytes: int) -> list[list]:
    """``group`` split into runs whose outputs total at most ``max_bytes`` (one member at least)."""
    chunks, size = [[]], 0
    for eqn in group:
        n = _out_bytes(eqn)
        if chunks[-1] and size + n > max_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append(eqn)
        size += n
    return chunks


def _eval_batched(jaxpr, consts, args, batchable, signature, max_bytes: int) -> list:
    env = _Env(jaxpr, consts, args)
    stages = _stages(jaxpr, batchable)
    for s in sorted(stages):
        plain, calls = stages[s]
        for eqn in plain:
            env.run(eqn)
        groups = collections.defaultdict(list)
        for eqn in calls:
            groups[signature(eqn)].append(eqn)
        for group in groups.values():
            for chunk in _chunks(group, max_bytes):
                env.run_batched(chunk)
    return [env.read(v) for v in jaxpr.outvars]


def _batch_calls(fn: Callable, batchable, signature, max_batch_bytes: int) -> Callable:
    @functools.wraps(fn)
    def wrapped(*args):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        pruned, _ = dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=True)
        flat_args = jax.tree.leaves(args)
        flat = jax.make_jaxpr(lambda *a: _inline(pruned, closed.consts, a, batchable))(*flat_args)
        outs = _eval_batched(flat.jaxpr, flat.consts, flat_args, batchable, signature, max_batch_bytes)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return wrapped


def batch_random_draws(fn: Callable, max_batch_bytes: int = 1 << 30) -> Callable:
    """``fn`` (a pure function of arrays/keys, e.g. a flax ``init``) with its random calls batched.

    A batch is stored whole before it is sliced into parameters, so it costs its size in transient
    memory (unsharded, in the worst case, under a mesh): ``max_batch_bytes`` caps it, and a draw larger
    than the cap stays on its own. The wrapper traces ``fn`` on every call; use it inside ``jax.jit``.
    """
    return _batch_calls(fn, _is_draw, _signature, max_batch_bytes)


def batch_scans(fn: Callable, max_batch_bytes: int = 1 << 30) -> Callable:
    """``fn`` with its independent, identical ``scan``s (Muon's Newton–Schulz) run as one vmapped scan.

    Same caveats as `batch_random_draws`; the stacked operands are a transient copy of the inputs.
    """
    return _batch_calls(fn, _is_scan, _structural_signature, max_batch_bytes)
