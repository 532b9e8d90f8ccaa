"""A scanned run of decoder layers (``k3jax.layout.ScanRun``): one traced unit, ``nn.scan`` over its repeats.

The model holds one such module per run of its ``scan_plan`` (named ``stack_{start}``). The unit is
``run.unit`` consecutive ``DecoderLayer``s, one per offset; ``nn.scan`` stacks each
offset's variables (params, balance biases, the stats it sows) on a leading axis of ``repeats``,
named ``layers`` for the sharding rules, and XLA sees the unit once however deep the stack.

AttnRes bookkeeping is traced here: the carry is a ``StackedStream`` (the block sums in one
``[N, B, T, D]`` buffer and a traced count), and a layer starts a block where its index, traced
from the repetition, is a multiple of the block size (static when it is so for every repetition).
Decode carries the run's caches (offset j's stacked ``[repeats, …]``) through the scan: repetition r
reads its slice and writes the new one back in place, so a decode step moves only the rows it
changes. (As scanned inputs and outputs, XLA wrote every stacked cache out whole on every step: the
output stack is a new buffer.) ``keep_steps`` returns the per-token KDA states as scanned outputs
instead, the carried caches untouched (``k3jax.infer.cache.select_step`` then picks one).
``remat="layer"`` rematerialises each unit (its input stream is all a repetition saves).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Int

from k3jax.config import ModelConfig
from k3jax.layers.attn_res import ResidualStream, StackedStream
from k3jax.layers.block import DecoderLayer
from k3jax.layout import ScanRun, offset_name

SCANNED_COLLECTIONS = ("params", "balance", "stats", "intermediates", "mxfp4")


def push_flag(cfg: ModelConfig, run: ScanRun, offset: int, repeat: Int[Array, ""]) -> bool | Bool[Array, ""]:
    """Whether repetition ``repeat``'s layer at ``offset`` starts an AttnRes block."""
    if cfg.attn_res is None:
        return False
    size = cfg.attn_res.block_size
    starts = [l % size == 0 for l in run.layers(offset)]
    if all(starts) or not any(starts):
        return starts[0]
    return (run.start + offset + run.unit * repeat) % size == 0


def _slice(tree, repeat: Int[Array, ""]):
    """Repetition ``repeat``'s slice of a stacked cache."""
    return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, repeat, 0, keepdims=False), tree)


def _write(tree, new, repeat: Int[Array, ""]):
    """``tree`` with repetition ``repeat``'s slice replaced by ``new`` (in place inside the scan's loop)."""
    return jax.tree.map(lambda x, y: lax.dynamic_update_index_in_dim(x, y.astype(x.dtype), repeat, 0), tree, new)


class LayerUnit(nn.Module):
    """One repetition of the unit: ``((stream, stacked caches or None), repeat index, …) -> (carry, steps)``;
    ``steps`` is the new caches of ``keep_steps`` (per-token KDA states), else None."""

    cfg: ModelConfig
    run: ScanRun
    remat_moe: bool = False

    @nn.compact
    def __call__(self, carry: tuple, repeat: Int[Array, ""], segment_ids: Int[Array, "B T"] | None,
                 valid: Bool[Array, "B T"] | None, keep_steps: bool = False):
        cfg, run = self.cfg, self.run
        stream, caches = carry
        new_caches = []
        for j in range(run.unit):
            layer = DecoderLayer(cfg, run.start + j, remat_moe=self.remat_moe, name=offset_name(j))
            push = push_flag(cfg, run, j, repeat)
            if caches is None:
                stream = layer(stream, segment_ids, push=push)
            else:
                stream, cache = layer(stream, cache=_slice(caches[j], repeat), valid=valid, keep_steps=keep_steps,
                                      push=push)
                new_caches.append(cache)
        if caches is None or keep_steps:
            return (stream, caches), None if caches is None else tuple(new_caches)
        # Every read of the old slices feeds the barrier, so the writes below follow all of them and
        # XLA updates the stacked caches in place (without it, fusions that re-read an old slice stay
        # unordered against the write and copy insertion copies each stacked cache every repetition).
        stream, new_caches = lax.optimization_barrier((stream, new_caches))
        return (stream, tuple(_write(c, n, repeat) for c, n in zip(caches, new_caches))), None


def layer_stack(cfg: ModelConfig, run: ScanRun, *, remat: str) -> nn.Module:
    """The scanned run as a module (name it ``run.name``; call it through `run_stack`)."""
    unit = nn.remat(LayerUnit, prevent_cse=False, static_argnums=(5,)) if remat == "layer" else LayerUnit
    scanned = nn.scan(unit, variable_axes={c: 0 for c in SCANNED_COLLECTIONS}, split_rngs={"params": True},
                      in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast), length=run.repeats,
                      metadata_params={nn.PARTITION_NAME: "layers"})
    return scanned(cfg, run, remat_moe=remat == "moe")


def run_stack(stack: nn.Module, cfg: ModelConfig, run: ScanRun, stream: ResidualStream,
              segment_ids=None, valid=None, caches: tuple | None = None, keep_steps: bool = False):
    """Run ``stack`` on a static stream: ``(static stream after the run, new caches or None)``."""
    inner = stream if cfg.attn_res is None else StackedStream.of(stream)
    (inner, carried), steps = stack((inner, caches), jnp.arange(run.repeats), segment_ids, valid, keep_steps)
    caches = steps if keep_steps else carried
    if cfg.attn_res is None:
        return inner, caches
    pushed = -(-run.stop // cfg.attn_res.block_size)  # layers 0, S, 2S, … below stop started blocks
    return inner.unstack(pushed), caches
