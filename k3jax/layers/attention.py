"""The fast path of MLA's training / prefill attention (SPEC §3): which path runs, and the flash op.

``MLAConfig.attention_implementation``: ``None`` runs the flash kernel
(:mod:`pallas_kernels.mla_attention`) on a CUDA GPU when the compute dtype is bf16/f16 and the
XLA attention of :mod:`k3jax.layers.mla` otherwise (CPU, float32/float64 models); ``"xla"``
always runs the XLA attention; ``"pallas"`` the kernel, or a ValueError at trace time. The
kernel takes bf16 matmul operands with fp32 softmax and outputs (SPEC §10), the rope key once
per token (not per head), and returns the exact ``max_logit`` (QK-Clip, SPEC §7).

Under a data/tensor-parallel mesh the kernel runs per shard (``shard_map`` over batch and heads;
attention never mixes either). Context parallel runs the same kernel with each shard's query
offset (:mod:`sharding.cp_attention`, called by the layer); decode keeps its own path.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from pallas_kernels.mla_attention import mla_attention, resolve_implementation
from sharding import current as parallel_context
from sharding.context import ParallelConfig
from sharding.rules import mesh_axes_of


def _shards(ctx: ParallelConfig, logical: str) -> int:
    return math.prod(ctx.axis_size(a) for a in mesh_axes_of(ctx.rules, logical))


def use_flash(implementation: str | None, dtype, batch: int, heads: int) -> bool:
    """Whether MLA's non-cached attention runs the flash kernel (context parallel included)."""
    if resolve_implementation(implementation, dtype) == "xla":
        return False
    ctx = parallel_context()
    if ctx is None or ctx.sequence_parallel:  # context parallel: heads stay whole, batch is checked there
        return True
    fits = batch % _shards(ctx, "batch") == 0 and heads % _shards(ctx, "heads") == 0
    if not fits and implementation == "pallas":
        raise ValueError(f"attention_implementation='pallas' needs batch B={batch} and heads H={heads} divisible "
                         f"by their shards ({_shards(ctx, 'batch')}, {_shards(ctx, 'heads')})")
    return fits


def flash_attention(q_nope: Float[Array, "B T H N"], q_rope: Float[Array, "B T H R"],
                    k_nope: Float[Array, "B T H N"], k_rope: Float[Array, "B T R"], v: Float[Array, "B T H V"],
                    segment_ids: Int[Array, "B T"] | None, *, scale: float,
                    interpret: bool = False) -> tuple[Float[Array, "B T H V"], Float[Array, "H"]]:
    """Causal same-document attention by the flash kernel: ``(o [B,T,H,V] in the inputs' dtype, max_logit [H])``."""
    attend = functools.partial(mla_attention, scale=scale, implementation="pallas", interpret=interpret)
    ctx = parallel_context()
    if ctx is None:
        return attend(q_nope, q_rope, k_nope, k_rope, v, segment_ids)
    B, T = q_nope.shape[:2]
    seg = jnp.zeros((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    batch_axes = mesh_axes_of(ctx.rules, "batch")

    def body(qn, qr, kn, kr, vv, s):
        o, max_logit = attend(qn, qr, kn, kr, vv, s)
        return o, (lax.pmax(max_logit, batch_axes) if batch_axes else max_logit)

    heads = ctx.spec("batch", None, "heads", None)
    args = (q_nope, q_rope, k_nope, k_rope, v, seg)
    specs = (heads, heads, heads, ctx.spec("batch", None, None), heads, ctx.spec("batch", None))
    fn = jax.shard_map(body, mesh=ctx.mesh, check_vma=False, out_specs=(heads, ctx.spec("heads")),
                       in_specs=ctx.in_specs(specs, *args))
    return fn(*args)
