"""Decode caches (SPEC §2 "Decode", §3; DESIGN "One decode step").

Per layer kind:

- KDA: the recurrent state ``S [B,H,K,V]`` (fp32) and the last ``W-1`` inputs of the q, k, v short
  convs ``[3,B,W-1,H·K]`` (fp32), i.e. a constant size per sequence whatever its length.
- MLA: the compressed rows ``[RMSNorm(c_kv), k_r]`` ``[B,Tmax,Rkv+dr]`` (compute dtype), pre-allocated
  to ``Tmax``, and each sequence's length ``[B]``. Decode absorbs ``W_kvb`` into the query and
  output, so nothing per head is ever cached.

``Cache`` bundles one per-layer cache with the per-sequence lengths.

Rollback (speculative verification): ``Transformer.decode(..., keep_steps=True)`` returns each KDA
layer as ``KDASteps`` (the state after every one of the T new tokens, and the conv inputs of all of
them) and ``select_step(StepCache, n)`` makes the ``Cache`` after each row's first ``n`` of them, no
model call needed. Per KDA layer that costs ``T`` states, ``B·T·H·K·V·4`` bytes (plus the conv window
``3·B·(W-1+T)·H·K·4``), against one state for plain decode; MLA layers rewind just their lengths.
"""

from __future__ import annotations

import typing

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from k3jax.config import LayerKind, ModelConfig
from k3jax.layers import mla
from k3jax.layers.kda import KDASteps, conv_tail
from k3jax.layout import scan_plan


# The caches are pytrees that JAX rebuilds with other leaves (ShapeDtypeStructs under eval_shape,
# PartitionSpecs and shardings on a mesh), so their field annotations document the arrays a cache
# holds and are not checked when one is built (``no_type_check``: pytest's run-time checks skip them).
@typing.no_type_check
@flax.struct.dataclass
class KDACache:
    # A leading [repeats] axis (``*layers``) where the cache belongs to a scanned run of layers.
    state: Float[Array, "*layers B H K V"]  # fp32 recurrent state
    conv: Float[Array, "*layers 3 B Wm1 C"]  # last W-1 short-conv inputs of q, k, v (oldest first), C = H·K


@typing.no_type_check
@flax.struct.dataclass
class MLACache:
    latent: Float[Array, "*layers B S C"]  # [RMSNorm(c_kv), k_rope] per cached token, C = Rkv + dr
    lengths: Int[Array, "*layers B"]  # tokens cached per sequence


@typing.no_type_check
@flax.struct.dataclass
class Cache:
    # One KDACache / MLACache per decoder layer; each scanned run of layers (``k3jax.layout``) is one
    # entry in its place: a tuple with one cache per offset of its unit, stacked [repeats, ...].
    layers: tuple
    lengths: Int[Array, "B"]  # tokens consumed per sequence (all layers agree)

    @property
    def max_len(self) -> int:
        return next(c.latent.shape[-2] for c in jax.tree.leaves(self.layers, is_leaf=_is_layer_cache)
                    if isinstance(c, MLACache))


def _is_layer_cache(x) -> bool:
    return isinstance(x, (KDACache, MLACache, KDASteps))


@flax.struct.dataclass
class StepCache:
    """A ``Cache`` after T new tokens per row that ``select_step`` rolls back to any ``n in [1, T]``."""

    layers: tuple  # KDASteps per KDA layer, MLACache (all T rows written) per MLA layer
    start: Int[Array, "B"]  # tokens consumed per sequence before the T new ones


def select_step(steps: StepCache, n: Int[Array, "B"]) -> Cache:
    """The cache after each row's first ``n[b]`` tokens of the call (``1 <= n[b] <= T``).

    KDA: the state after token ``n`` and the conv inputs ``n .. n+W-2`` of the window (the last
    W-1 inputs up to token ``n``). MLA: the length rewinds to ``start + n``; the rows past it are
    stale but out of every later query's reach, and the next call overwrites them.
    """
    n = jnp.asarray(n, jnp.int32)
    layers = []
    for c in steps.layers:
        if isinstance(c, tuple):  # a scanned run: each offset's caches stacked on a leading axis
            layers.append(tuple(jax.vmap(lambda one: _select_one(one, n, steps.start))(o) for o in c))
        else:
            layers.append(_select_one(c, n, steps.start))
    return Cache(layers=tuple(layers), lengths=steps.start + n)


def _select_one(c, n: Int[Array, "B"], start: Int[Array, "B"]):
    if isinstance(c, KDASteps):
        state = jnp.take_along_axis(c.states, (n - 1)[:, None, None, None, None], axis=1)[:, 0]
        conv = conv_tail(c.window, n, c.window.shape[2] - c.states.shape[1])
        return KDACache(state=state, conv=conv)
    return c.replace(lengths=start + n)


def cache_length(max_len: int) -> int:
    """The allocated MLA length: ``max_len``, rounded up to whole key blocks when longer than one."""
    if max_len <= mla.KEY_BLOCK:
        return max_len
    return -(-max_len // mla.KEY_BLOCK) * mla.KEY_BLOCK


def init_cache(cfg: ModelConfig, batch: int, max_len: int, *, dtype=None) -> Cache:
    """Empty caches for ``batch`` sequences of up to ``max_len`` tokens (MLA rows in ``dtype``,
    default the compute dtype; KDA state and conv tails in fp32)."""
    if not isinstance(batch, (int, np.integer)) or batch < 1:
        raise ValueError(f"batch={batch!r} must be a positive int")
    if not isinstance(max_len, (int, np.integer)) or not 1 <= max_len <= cfg.max_position:
        raise ValueError(f"max_len={max_len!r} must be an int in [1, max_position={cfg.max_position}]")
    dtype = cfg.compute_dtype if dtype is None else jnp.dtype(dtype)
    lengths = jnp.zeros((batch,), jnp.int32)
    one = lambda l: _empty(cfg, cfg.layer_kinds[l], batch, max_len, dtype)
    plan = scan_plan(cfg)
    if plan is None:
        return Cache(layers=tuple(one(l) for l in range(cfg.num_layers)), lengths=lengths)
    stack = lambda run, c: jax.tree.map(lambda x: jnp.zeros((run.repeats,) + x.shape, x.dtype), c)
    stacked = lambda run: tuple(stack(run, one(run.start + j)) for j in range(run.unit))
    return Cache(layers=tuple(one(e) if isinstance(e, int) else stacked(e) for e in plan.entries), lengths=lengths)


def _empty(cfg: ModelConfig, kind: LayerKind, batch: int, max_len: int, dtype):
    """One layer's empty cache."""
    if kind is LayerKind.KDA:
        c, wide = cfg.kda, cfg.fp32_dtype
        return KDACache(state=jnp.zeros((batch, c.num_heads, c.head_dim, c.head_dim), wide),
                        conv=jnp.zeros((3, batch, c.conv_size - 1, c.num_heads * c.head_dim), wide))
    return MLACache(latent=jnp.zeros((batch, cache_length(max_len), cfg.mla.cache_width), dtype),
                    lengths=jnp.zeros((batch,), jnp.int32))


def bytes_per_token(cfg: ModelConfig, dtype=None) -> dict[str, int]:
    """Cache bytes per token per layer by kind: MLA ``(Rkv+dr)·itemsize`` (grows with T); KDA is a
    constant ``(H·K·V + 3·(W-1)·H·K)·4`` per sequence, reported under ``kda_per_sequence``."""
    dtype = cfg.compute_dtype if dtype is None else jnp.dtype(dtype)
    out = {"mla": cfg.mla.cache_width * jnp.dtype(dtype).itemsize}
    if cfg.kda is not None:
        c = cfg.kda
        wide = jnp.dtype(cfg.fp32_dtype).itemsize
        out["kda_per_sequence"] = (c.num_heads * c.head_dim * c.head_dim + 3 * (c.conv_size - 1) * c.num_heads * c.head_dim) * wide
    return out


def tree_bytes(tree) -> int:
    """Bytes held by the arrays of a pytree."""
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))
