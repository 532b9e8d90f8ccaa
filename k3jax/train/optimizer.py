"""Per-head Muon for matrices, AdamW for everything else, global-norm clipping (SPEC §7).

Muon (Jordan 2024; Moonlight, Liu et al., arXiv 2502.16982) as ``optax.contrib.muon`` builds it
(its partition, momentum, Newton–Schulz and shape scaling; only the NS storage dtype is ours):
Nesterov momentum, 5 quintic Newton–Schulz steps (3.4445, −4.7750, 2.0315), update RMS matched to
AdamW by ``0.2·√max(fan_in, fan_out)`` (``consistent_rms``), decoupled weight decay ``lr·λ·W``.
Per-head Muon (Kimi K3 report): every axis of a weight that is neither its reduction nor its output
axis is a *batch* axis that optax orthogonalises independently (vmap), so storing q/k/v/gate/o
projections with an explicit ``heads`` axis and expert stacks with an ``experts`` axis gives one
Newton–Schulz per head / per expert. The dimension numbers come from the logical axis names the
model attaches to each parameter (``docs/params.md``).

Which optimiser a parameter gets:
  1. Muon: linear kernels and expert stacks (leaf named ``kernel``, ``w1``, ``w2``, ``w3``) of rank
     ≥ 2 without a ``vocab`` axis. ``heads``/``experts`` axes are batch axes when at least two other
     axes remain (``b_proj [D, H]`` and the router ``[D, E]`` stay whole matrices); the scanned
     stack's ``layers`` axis always is one (its matrices are those of the per-layer tree). Of the rest, the
     first axis is the reduction (input) axis and the others the output axes (weights are ``[in, out]``).
  2. AdamW: embeddings and the head (``vocab`` axis; these also get weight decay), norms, biases,
     A_log, dt_bias, conv taps, AttnRes queries/norms (no weight decay).

Mixed precision [ours, SPEC §10]: master parameters and both optimisers' moments are fp32
(``ModelConfig.param_dtype``); the model casts to bf16 (``ModelConfig.dtype``) for matmuls, so
gradients arrive in fp32. Newton–Schulz alone stores its iterate in ``OptimizerConfig.ns_dtype``
(bf16 by default, as Jordan's Muon runs it): the fp32 Nesterov momentum is cast to bf16, every NS
product is a bf16 matrix (fp32 accumulation inside the matmul under ``ns_precision``), and the
orthogonalised result is cast back to fp32 before the shape scaling, decay and learning rate. That
bf16 iteration is ``newton_schulz`` (the quintic factored as ``(aI + A(bI + cA))X``, coefficients in
fp32, where optax's would round them to (3.4375, −4.78125, 2.03125)): its updates sit 0.023–0.027
from the fp32 ones (optax's bf16 iteration: 0.061–0.065), and both sit 0.19 from the exact polar
factor (``tests/tolerances.py``).
"""

import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers, MuonState
from optax.contrib import _muon  # its NS iteration and shape scaling are not exported in optax 0.2.8

from k3jax.train.config import OptimizerConfig

MUON_LEAVES = ("kernel", "w1", "w2", "w3")
BATCH_AXES = ("heads", "experts")
LAYER_AXIS = "layers"  # the scanned stack's leading axis: always a batch axis (one matrix per layer)
DECAYED_ADAMW_AXES = ("vocab",)


def logical_axes(boxed_params: Any) -> Any:
    """Tree of logical axis-name tuples (one per leaf) from params boxed by ``nn.with_logical_partitioning``.

    Unboxed leaves get ``None`` names per axis. The result has the structure of ``nn.unbox(boxed)``.
    """

    def names(leaf):
        if isinstance(leaf, nn.LogicallyPartitioned) or isinstance(leaf, nn.Partitioned):
            return tuple(leaf.names)
        return (None,) * jnp.ndim(leaf)

    return jax.tree.map(names, boxed_params, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def _leaf_name(path) -> str:
    last = path[-1]
    return str(getattr(last, "key", getattr(last, "name", last)))


def muon_dimension_numbers(params: Any, axes: Any) -> Any:
    """``MuonDimensionNumbers`` per Muon leaf, ``None`` per AdamW leaf (see the module docstring)."""

    def dims(path, leaf, names):
        names = tuple(names)
        if len(names) != jnp.ndim(leaf):
            raise ValueError(f"params at {jax.tree_util.keystr(path)} have shape {jnp.shape(leaf)} "
                             f"but {len(names)} logical axis names {names}")
        if _leaf_name(path) not in MUON_LEAVES or len(names) < 2 or "vocab" in names:
            return None
        layers = [i for i, n in enumerate(names) if n == LAYER_AXIS]
        batch = [i for i, n in enumerate(names) if n in BATCH_AXES]
        if len(names) - len(layers) - len(batch) < 2:
            batch = []
        rest = [i for i in range(len(names)) if i not in batch + layers]
        return MuonDimensionNumbers(reduction_axis=(rest[0],), output_axis=tuple(rest[1:]))

    return jax.tree_util.tree_map_with_path(dims, params, axes)


def optimizer_labels(params: Any, axes: Any) -> Any:
    """"muon" / "adamw" per leaf (for reports and tests)."""
    dims = muon_dimension_numbers(params, axes)
    return jax.tree.map(lambda d, _: "adamw" if d is None else "muon", dims, params,
                        is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))


class _DecayState(NamedTuple):
    count: jax.Array


def _decoupled_decay(learning_rate: optax.Schedule, rate: float, mask: Any) -> optax.GradientTransformation:
    """Adds ``−lr(t)·rate·W`` to the masked leaves' (already lr-scaled) updates: AdamW's decay for the
    embedding and head, which ``optax.contrib.muon`` cannot mask for its AdamW branch."""

    def init(params):
        del params
        return _DecayState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params=None):
        lr = learning_rate(state.count)
        updates = jax.tree.map(lambda u, p, m: u - lr * rate * p if m else u, updates, params, mask)
        return updates, _DecayState(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init, update)


def _is_dims(x) -> bool:
    return x is None or isinstance(x, MuonDimensionNumbers)


def newton_schulz(x: jax.Array, coeffs: jax.Array, ns_steps: int, eps: float, dtype) -> jax.Array:
    """Frobenius-normalised quintic Newton–Schulz on one ``[m, n]`` matrix, iterated in ``dtype``.

    The same polynomial as optax's step ``a·X + (b·A + c·A²)·X`` with ``A = X Xᵀ``, factored as
    ``(a·I + A (b·I + c·A)) X``: each sum is an operand of the next matmul, which XLA fuses into
    that matmul's kernel, so a step is three matmuls and no elementwise pass over the ``[m, m]``
    products (optax's form costs two such passes a step). The norm is taken and the coefficients
    applied in fp32 (optax rounds them to the iterate's dtype); the matmuls take and return
    ``dtype`` (their accumulation follows ``OptimizerConfig.ns_precision``). A ``fori_loop`` as
    optax's, so `batch_scans` stacks the same-shaped ones. Wide rows are transposed as optax does."""
    if x.shape[0] > x.shape[1]:
        return newton_schulz(x.T, coeffs, ns_steps, eps, dtype).T
    wide = jnp.promote_types(x.dtype, jnp.float32)
    x = x.astype(wide)
    x = (x / (jnp.linalg.norm(x) + eps)).astype(dtype)
    a, b, c = (coeffs[i].astype(wide) for i in range(3))

    def step(_, x):
        eye = jnp.eye(x.shape[0], dtype=wide)
        gram = x @ x.T
        poly = gram @ (b * eye + c * gram.astype(wide)).astype(dtype)
        return (a * eye + poly.astype(wide)).astype(dtype) @ x

    return jax.lax.fori_loop(0, ns_steps, step, x, unroll=True)


def _orthogonalize(x: jax.Array, coeffs: jax.Array, ns_steps: int, eps: float, dims: MuonDimensionNumbers,
                   ns_dtype: str | None, names: tuple[str | None, ...] | None = None) -> jax.Array:
    """Per-head Newton–Schulz of ``x`` with products stored in ``ns_dtype``: optax's own when that is
    ``x``'s dtype or None (bit for bit; float64 runs keep float64), else ``newton_schulz``.
    ``names``: ``x``'s logical axis names; on a mesh they let each device orthogonalise its own
    matrices (`_per_matrix`)."""
    if ns_dtype is None or x.dtype == jnp.float64 or x.dtype == jnp.dtype(ns_dtype):
        return _muon.orthogonalize_via_newton_schulz(x, coeffs, ns_steps, "frobenius", eps, dims)
    if dims is None or x.ndim == 2:
        dims = MuonDimensionNumbers(reduction_axis=0, output_axis=1)
    one = lambda m: newton_schulz(m, coeffs, ns_steps, eps, jnp.dtype(ns_dtype))
    return _per_matrix(one, x, dims, names).astype(x.dtype)


def _per_matrix(fn, x: jax.Array, dims: MuonDimensionNumbers, names: tuple[str | None, ...] | None = None
                ) -> jax.Array:
    """``fn`` on every ``[reduction, output]`` matrix of ``x``, one ``vmap`` per batch axis.

    optax merges the batch axes into one (a reshape): a scanned stack's expert leaf ``[layers,
    experts, L, F]`` then becomes ``[layers·experts, …]``, which cannot keep the ``experts`` axis's
    sharding, so XLA gathers every expert of every layer onto every device for Newton–Schulz (K3:
    34 GB per device per expert leaf). Separate vmaps keep each batch axis, and its sharding.
    On a mesh, with ``names``, ``sharding.map_matrices`` hands each device whole matrices of its
    own: stored, an expert's width is split over fsdp, and every fsdp rank would repeat its
    Newton–Schulz (K3 on fsdp=64: 64 times, with an all-reduce of the Gram product each iteration).
    """
    reduction, output = _muon._normalize_axes(x, dims)
    batch = tuple(a for a in range(x.ndim) if a not in reduction + output)
    order = batch + reduction + output
    y = x.transpose(order)
    lead = y.shape[:len(batch)]
    y = y.reshape(lead + (math.prod(x.shape[a] for a in reduction), math.prod(x.shape[a] for a in output)))
    spread = None
    if names is not None and batch:
        import sharding

        one = lambda axes: names[axes[0]] if len(axes) == 1 else None
        spread = sharding.map_matrices(fn, y, tuple(names[a] for a in batch) + (one(reduction), one(output)))
    if spread is not None:
        y = spread
    else:
        for _ in batch[1:]:
            fn = jax.vmap(fn)
        # The leading batch axis (a scanned stack's layers) one slice at a time: Newton–Schulz's Gram
        # products of all K3's stacked experts at once were 23 GB per device.
        y = (jax.lax.map(fn, y) if len(batch) > 1 else jax.vmap(fn)(y) if batch else fn(y))
    y = y.reshape(lead + tuple(x.shape[a] for a in reduction + output))
    return y.transpose(tuple(sorted(range(x.ndim), key=lambda i: order[i])))


def _scale_by_muon(ns_steps: int, beta: float, eps: float, dims: Any,
                   ns_dtype: str | None, names: Any = None) -> optax.GradientTransformation:
    """``optax.contrib.scale_by_muon`` (Nesterov, Frobenius preconditioning, momentum in the params'
    dtype) with the Newton–Schulz iterate stored in ``ns_dtype``; its init, state and momentum formula
    are optax 0.2.8's, so ``ns_dtype=None`` gives optax's update bit for bit. ``dims``: the masked
    dimension numbers (`MaskedNode` on AdamW leaves); ``names``: the Muon leaves' logical axis names
    (same masking; None: none known)."""
    init = optax.contrib.scale_by_muon(ns_steps=ns_steps, beta=beta, eps=eps).init

    def update(updates, state, params=None):
        del params
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                              optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                              optax.tree.bias_correction(updates, beta, count))
        named = jax.tree.map(lambda d: None, dims, is_leaf=_is_dims) if names is None else names
        updates = jax.tree.map(lambda x, d, n: _orthogonalize(x, state.ns_coeffs, ns_steps, eps, d, ns_dtype, n),
                               mu_hat, dims, named, is_leaf=lambda x: isinstance(x, MuonDimensionNumbers))
        return updates, MuonState(count=count, mu=mu, ns_coeffs=state.ns_coeffs)

    return optax.GradientTransformation(init, update)


def _muon_and_adamw(cfg: OptimizerConfig, schedule: optax.Schedule, adam_schedule: optax.Schedule,
                    dims: Any, axes: Any) -> optax.GradientTransformation:
    """``optax.contrib.muon`` with these arguments (same partition, chain and state tree, so old
    checkpoints restore), its ``scale_by_muon`` swapped for `_scale_by_muon`."""
    labels = jax.tree.map(lambda d: "adam" if d is None else "muon", dims, is_leaf=_is_dims)
    masked = jax.tree.map(lambda d: optax.MaskedNode() if d is None else d, dims, is_leaf=_is_dims)
    names = jax.tree.map(lambda d, n: optax.MaskedNode() if d is None else tuple(n), dims, axes,
                         is_leaf=_is_dims)
    muon = optax.chain(
        _scale_by_muon(cfg.ns_steps, cfg.muon_beta, cfg.eps, masked, cfg.ns_dtype, names),
        _muon.scale_by_shape(weight_dimension_numbers=masked, consistent_rms=cfg.consistent_rms),
        optax.add_decayed_weights(cfg.weight_decay, None),
        optax.scale_by_learning_rate(schedule))
    adam = optax.adamw(learning_rate=adam_schedule, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.eps, eps_root=0.0,
                       weight_decay=0.0, mu_dtype=None, nesterov=True)
    return optax.partition({"muon": muon, "adam": adam}, labels)


def make_optimizer(cfg: OptimizerConfig, schedule: optax.Schedule, params: Any,
                   axes: Any) -> optax.GradientTransformation:
    """Clip by global norm → per-head Muon / AdamW, both on ``schedule`` (AdamW's scaled by
    ``adam_learning_rate / learning_rate`` when set).

    ``params`` (arrays or ``ShapeDtypeStruct``s) and ``axes`` (`logical_axes`) fix the partition.
    ``cfg.ns_dtype`` is the storage dtype of Newton–Schulz's iterate and products ("bfloat16":
    Jordan's Muon; the fp32 momentum is cast on the way in and the update cast back to fp32 on the
    way out; None: the momentum's own dtype, i.e. ``optax.contrib.muon`` bit for bit).
    """
    ratio = (cfg.adam_learning_rate or cfg.learning_rate) / cfg.learning_rate
    adam_schedule = schedule if ratio == 1 else (lambda step: ratio * schedule(step))
    decay_mask = jax.tree.map(lambda names: any(n in DECAYED_ADAMW_AXES for n in names), axes,
                              is_leaf=lambda x: isinstance(x, tuple))
    if cfg.muon:
        dims = muon_dimension_numbers(params, axes)
        main = _muon_and_adamw(cfg, schedule, adam_schedule, dims, axes)
        tail = [_decoupled_decay(adam_schedule, cfg.weight_decay, decay_mask)]
    else:
        matrices = jax.tree.map(lambda d: d is not None, muon_dimension_numbers(params, axes),
                                is_leaf=lambda x: x is None or isinstance(x, MuonDimensionNumbers))
        main = optax.adamw(adam_schedule, b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.eps,
                           weight_decay=cfg.weight_decay,
                           mask=jax.tree.map(lambda a, b: a or b, matrices, decay_mask))
        tail = []
    head = [optax.clip_by_global_norm(cfg.grad_clip_norm)] if cfg.grad_clip_norm else []
    return optax.chain(*head, main, *tail)
