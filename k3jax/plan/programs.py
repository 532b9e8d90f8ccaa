"""The three programs a plan compiles, from abstract state only (``jax.eval_shape``: no weights).

- ``train``: ``k3jax.train.step.Trainer``'s donated step (forward, backward, per-head Muon, QK-Clip,
  Quantile Balancing) on its own state and batch shardings.
- ``prefill``: ``k3jax.infer.decode.prefill`` (the prompt in chunks into the cache).
- ``decode``: ``k3jax.infer.decode.forward_cached`` for one new token per sequence.
- ``forward``: the training model's forward over whole rows with the training layout, context
  parallel (KDA and MLA) when the mesh has a sequence axis, and the head on each row's last token:
  what a prefill of one long prompt computes, without writing a cache. The cached prefill splits
  the batch, not the tokens, so a prompt longer than one device holds (K3 at 1 M tokens) is planned
  with this program.

Inference parameters are stored in ``param_dtype`` of the config (``--param-dtype bfloat16`` for
serving), or with the routed experts as MXFP4 (``experts="mxfp4"``: the ``mxfp4`` collection of
``k3jax.layers.mxfp4``, placed like the experts it encodes); the cache rows are batch-sharded like
the activations. Everything is traced inside
``sharding.use_mesh`` on the topology's devices, so the kernel ops pick the target's kernels.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from k3jax.config import ModelConfig
from k3jax.infer.cache import KDACache, MLACache, init_cache
from k3jax.layers import mxfp4
from k3jax.model import Transformer
from k3jax.train.config import MeshConfig, TrainConfig


@dataclasses.dataclass(frozen=True)
class Shape:
    """What one program processes: ``batch`` sequences of ``seq`` tokens (train: per step; prefill:
    the prompt; decode: the cache length), ``micro`` micro-batches, ``chunk`` prefill tokens per call."""

    batch: int
    seq: int
    micro: int = 1
    chunk: int = 2048
    remat: str = "layer"


def _abstract(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def lower_train(cfg: ModelConfig, mesh_axes: tuple, devices, shape: Shape):
    """``(lowered, mesh)`` of the train step for ``shape.batch × shape.seq`` tokens per step."""
    from k3jax.train.parallel import make_train_mesh
    from k3jax.train.step import Trainer

    tcfg = TrainConfig(model=cfg, batch_size=shape.batch, seq_len=shape.seq, micro_batches=shape.micro,
                       remat=shape.remat, mesh=MeshConfig(axes=mesh_axes))
    mesh = make_train_mesh(tcfg, devices)
    trainer = Trainer(tcfg, mesh)
    state = trainer.abstract_state()
    batch = {k: jax.ShapeDtypeStruct((shape.batch, shape.seq), jnp.int32, sharding=s)
             for k, s in trainer.shardings["batch"].items()}
    with trainer._context():
        return trainer._jit_step.lower(state, batch, trainer.horizon), mesh


EXPERTS = ("param", "mxfp4")  # the routed experts in the config's param_dtype, or as MXFP4


def _variables(cfg: ModelConfig, mesh, rules, experts: str = "param"):
    """Abstract ``{"params", "balance"}`` placed by their logical names; ``experts="mxfp4"``: the
    routed experts moved to the ``mxfp4`` collection as the uint8 pairs ``quantize_experts`` makes."""
    import sharding

    from pallas_kernels.target import compile_for

    with compile_for(mesh.devices.flat[0]):  # traced outside the mesh context (one short row)
        boxed = jax.eval_shape(Transformer(cfg).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    abstract, logical = nn.unbox(boxed), sharding.logical_axes(boxed)
    if experts == "mxfp4":
        abstract, logical = mxfp4.quantized_shapes(abstract), mxfp4.quantized_axes(logical)
    shardings = sharding.shardings_for(abstract, logical, mesh, rules)
    return _abstract(abstract, jax.tree.map(_one_split, shardings, is_leaf=_is_mxfp4))


def _is_mxfp4(x) -> bool:
    return isinstance(x, mxfp4.Mxfp4)


def _one_split(s):
    """An encoded matrix's bytes and exponents split alike: both take the scale's placement (fitted to
    its 32× shorter ``in`` axis; every split of it divides the packed bytes' ``in`` axis, 16× longer),
    so a shard decodes its own columns."""
    return mxfp4.Mxfp4(packed=s.scale, scale=s.scale) if _is_mxfp4(s) else s


def _cache_shardings(cache, mesh, rules):
    """Cache rows split like the activations: batch, and the KDA state's heads. The scanned stack's
    caches (a tuple, one per layer of its unit) carry a leading ``layers`` axis, kept whole."""
    import sharding

    def names(layer_cache, *lead):
        if isinstance(layer_cache, tuple):  # the scanned unit's layers, stacked over its repeats
            return tuple(names(c, "layers") for c in layer_cache)
        if isinstance(layer_cache, KDACache):
            return KDACache(state=PartitionSpec(*lead, "batch", "heads", None, None),
                            conv=PartitionSpec(*lead, None, "batch", None, "heads"))
        return MLACache(latent=PartitionSpec(*lead, "batch", None, None), lengths=PartitionSpec(*lead, "batch"))

    logical = cache.replace(layers=tuple(names(c) for c in cache.layers), lengths=PartitionSpec("batch"))
    return sharding.shardings_for(cache, logical, mesh, rules)


def lower_infer(step: str, cfg: ModelConfig, mesh_axes: tuple, devices, shape: Shape, experts: str = "param"):
    """``(lowered, mesh)`` of ``prefill`` (a ``shape.seq``-token prompt) or ``decode`` (one token
    per sequence against a cache of ``shape.seq``); ``experts`` (``EXPERTS``): the routed experts'
    format, ``"mxfp4"`` the release's 4.25 bits a weight (``k3jax.layers.mxfp4``)."""
    import sharding
    from k3jax.infer.decode import forward_cached, prefill
    from k3jax.train.parallel import make_train_mesh, train_rules

    tcfg = TrainConfig(model=cfg, batch_size=shape.batch, seq_len=1 if step == "decode" else shape.seq,
                       mesh=MeshConfig(axes=mesh_axes))
    mesh = make_train_mesh(tcfg, devices)
    rules = train_rules(tcfg, mesh)
    variables = _variables(cfg, mesh, rules, experts)
    cache = jax.eval_shape(lambda: init_cache(cfg, shape.batch, shape.seq))
    cache = _abstract(cache, _cache_shardings(cache, mesh, rules))
    batch = NamedSharding(mesh, sharding.rules.spec(rules, "batch", None))
    if step == "prefill":
        tokens = jax.ShapeDtypeStruct((shape.batch, shape.seq), jnp.int32, sharding=batch)
        lengths = jax.ShapeDtypeStruct((shape.batch,), jnp.int32, sharding=NamedSharding(mesh, PartitionSpec(*batch.spec[:1])))
        fn = jax.jit(lambda v, t, n, c: prefill(v, cfg, t, n, c, chunk=shape.chunk), donate_argnums=3)
        args: tuple[Any, ...] = (variables, tokens, lengths, cache)
    else:
        tokens = jax.ShapeDtypeStruct((shape.batch, 1), jnp.int32, sharding=batch)
        fn = jax.jit(lambda v, t, c: forward_cached(v, cfg, t, c), donate_argnums=2)
        args = (variables, tokens, cache)
    with sharding.use_mesh(mesh, rules):
        return fn.lower(*args), mesh


def lower_forward(cfg: ModelConfig, mesh_axes: tuple, devices, shape: Shape):
    """``(lowered, mesh)`` of the forward over ``shape.batch`` rows of ``shape.seq`` tokens, split
    like training's batch (rows over the batch axes, tokens over ``sequence``); it returns each
    row's next-token logits ``[B, V]``."""
    import sharding
    from k3jax.train.parallel import make_train_mesh, train_rules

    tcfg = TrainConfig(model=cfg, batch_size=shape.batch, seq_len=shape.seq, mesh=MeshConfig(axes=mesh_axes))
    mesh = make_train_mesh(tcfg, devices)  # checks that the batch and the tokens divide their axes
    rules = train_rules(tcfg, mesh)
    variables = _variables(cfg, mesh, rules)
    tokens = jax.ShapeDtypeStruct((shape.batch, shape.seq), jnp.int32,
                                  sharding=NamedSharding(mesh, sharding.rules.spec(rules, "batch", "length")))
    model = Transformer(cfg)

    def forward(v, t):
        features, _ = model.apply(v, t, method="features")  # "stats" not mutable: max_logit is not sown
        return model.apply(v, features[:, -1:], method="logits")[:, 0]

    with sharding.use_mesh(mesh, rules):
        return jax.jit(forward).lower(variables, tokens), mesh


def lower(step: str, cfg: ModelConfig, mesh_axes: tuple, devices, shape: Shape, experts: str = "param"):
    """Lower one program ("train", "prefill", "decode" or "forward"); ``experts="mxfp4"`` for the
    cached inference steps only."""
    if experts not in EXPERTS:
        raise ValueError(f"experts={experts!r} must be one of {', '.join(EXPERTS)}")
    if experts != "param" and step in ("train", "forward"):
        raise ValueError(f"experts={experts!r} is an inference format (--step prefill or decode): the {step} "
                         "step runs the experts in param_dtype (experts='param')")
    if step == "train":
        return lower_train(cfg, mesh_axes, devices, shape)
    if step in ("prefill", "decode"):
        return lower_infer(step, cfg, mesh_axes, devices, shape, experts)
    if step == "forward":
        return lower_forward(cfg, mesh_axes, devices, shape)
    raise ValueError(f"step={step!r} must be 'train', 'prefill', 'decode' or 'forward'")
