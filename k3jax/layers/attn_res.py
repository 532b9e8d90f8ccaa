"""Block Attention Residuals (SPEC §5; the K3 technical report).

A layer's input is a softmax mix over the stored block sums and the running partial sum of the
current block, instead of a plain residual: with sources ``v_1..v_N``,
``k_n = v_n / sqrt(mean(v_n²) + eps)``, ``logit_n = Σ_d k_nd γ_d w_d`` (the RMSNorm weight γ and the
pseudo-query w fold into one vector; no 1/√D), ``h = Σ_n softmax(logit)_n v_n``, all in fp32.

Bookkeeping is static: ``ResidualStream`` holds the finished block sums as a tuple (their number
is known at trace time) and the ``partial`` sum of the current block. Separate arrays, not one
``[Nmax,B,T,D]`` buffer, so no zero buffer is written and a read of block n differentiates into
block n alone. The mix has an explicit backward (`_mix_bwd`) so that XLA's fusions of the blocks'
cotangents stay elementwise (`benchmarks/RESULTS.md`, stop 15).
Plain pre-norm residual models use the same stream with no blocks.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from k3jax.layers.linear import constrain, param

HIDDEN_AXES = ("batch", "length", "embed")


@flax.struct.dataclass
class ResidualStream:
    """What flows between decoder layers."""

    partial: Float[Array, "B T D"]  # current block's running sum (plain residual: the hidden state)
    stored: tuple = ()  # finished block sums [B, T, D], oldest first
    max_blocks: int = flax.struct.field(pytree_node=False, default=0)

    @classmethod
    def start(cls, embeddings: Float[Array, "B T D"], max_blocks: int) -> "ResidualStream":
        return cls(partial=constrain(embeddings, HIDDEN_AXES), max_blocks=max_blocks)

    @property
    def count(self) -> int:
        return len(self.stored)

    @property
    def blocks(self) -> Float[Array, "N B T D"] | None:
        """The block sums as one ``[max_blocks, B, T, D]`` array, zeros past ``count`` (None without AttnRes)."""
        if self.max_blocks == 0:
            return None
        unused = [jnp.zeros_like(self.partial)] * (self.max_blocks - self.count)
        return jnp.stack(list(self.stored) + unused)

    def push(self) -> "ResidualStream":
        """Store the partial sum as a finished block and start a new, empty one."""
        if self.count >= self.max_blocks:
            raise ValueError(f"push: all max_blocks={self.max_blocks} AttnRes blocks are already stored")
        return self.replace(partial=jnp.zeros_like(self.partial), stored=self.stored + (self.partial,))

    def add(self, y: Float[Array, "B T D"]) -> "ResidualStream":
        return self.replace(partial=constrain(self.partial + y.astype(self.partial.dtype), HIDDEN_AXES))


def attn_res_mix(blocks, count: int, partial: Float[Array, "B T D"],
                 direction: Float[Array, "D"], eps: float, wide_dtype) -> Float[Array, "B T D"]:
    """Softmax mix of ``blocks[:count]`` and ``partial`` along ``direction`` (= γ ⊙ w), in ``wide_dtype``.

    ``blocks``: a ``[N, B, T, D]`` array or a sequence of ``[B, T, D]`` arrays; ``count`` is static,
    so entries past it are never read (they would get weight 0). Each source is widened where it
    is read, one at a time: a stacked ``[count+1, B, T, D]`` fp32 copy made XLA write and re-read
    it and reduce over its leading axis; here the logits are row reductions and the mix is one
    elementwise sum over the sources. The gradient is `_mix`'s explicit backward.
    """
    sources = tuple(blocks[n] for n in range(count)) + (partial,)
    return _mix(sources, direction.astype(wide_dtype), eps, jnp.dtype(wide_dtype))


def _mix_terms(sources, d, eps, wide):
    """Per source ``[N, B, T]``: ``s = v·d``, ``r = 1/rms(v)``, and the softmax weights of ``s·r``."""
    s = jnp.stack([jnp.sum(v.astype(wide) * d, axis=-1) for v in sources])
    r = jnp.stack([jax.lax.rsqrt(jnp.mean(jnp.square(v.astype(wide)), axis=-1) + eps) for v in sources])
    return s, r, jax.nn.softmax(s * r, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _mix(sources: tuple, d: Float[Array, "D"], eps: float, wide) -> Float[Array, "B T D"]:
    """``Σ_n softmax_n(logit)·v_n`` with ``logit_n = (v_n·d)/rms(v_n)``, in ``wide``."""
    p = _mix_terms(sources, d, eps, wide)[2]
    return sum(p[n][..., None] * v.astype(wide) for n, v in enumerate(sources))


def _mix_fwd(sources, d, eps, wide):
    s, r, p = _mix_terms(sources, d, eps, wide)
    return sum(p[n][..., None] * v.astype(wide) for n, v in enumerate(sources)), (sources, d, s, r, p)


def _mix_bwd(eps, wide, res, dh):
    """With ``g_n = dh·v_n`` and ``ℓ_n = p_n (g_n − Σ_m p_m g_m)`` (the softmax's backward):
    ``dv_n = p_n dh + ℓ_n (r_n d − s_n r_n³ v_n / D)`` and ``dd = Σ_n (ℓ_n r_n)ᵀ v_n``.

    Autodiff of the forward gives the same sums, but XLA fuses every later mix's share of a stored
    block's cotangent together with the ``dd`` column sums into one ~90-operand reduction fusion
    that ran at a fifth of the H200's bandwidth (9.3 ms per small() step in three such fusions).
    Here ``dd`` is a matrix product of its own, so the cotangents stay elementwise (loop fusions)."""
    sources, d, s, r, p = res
    dh = dh.astype(wide)
    D = dh.shape[-1]
    g = jnp.stack([jnp.sum(dh * v.astype(wide), axis=-1) for v in sources])
    dlogit = p * (g - jnp.sum(p * g, axis=0))
    on_d, on_v = dlogit * r, dlogit * s * r ** 3 / D
    dsources = tuple((p[n][..., None] * dh + on_d[n][..., None] * d - on_v[n][..., None] * v.astype(wide)).astype(v.dtype)
                     for n, v in enumerate(sources))
    dd = sum(jnp.dot(on_d[n].reshape(-1), v.reshape(-1, D).astype(wide)) for n, v in enumerate(sources))
    return dsources, dd


_mix.defvjp(_mix_fwd, _mix_bwd)


class AttnResMix(nn.Module):
    """One mixing point: its pseudo-query ``query`` (init 0: uniform mixing) and key-norm weight ``norm``."""

    eps: float
    dtype: Any
    wide_dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, stream: ResidualStream) -> Float[Array, "B T D"]:
        D = stream.partial.shape[-1]
        query = param(self, "query", nn.initializers.zeros, (D,), ("embed",), self.param_dtype)
        norm = param(self, "norm", nn.initializers.ones, (D,), ("embed",), self.param_dtype)
        if stream.count == 0:  # the only source is the partial sum: its mix is itself
            return stream.partial
        direction = norm.astype(self.wide_dtype) * query.astype(self.wide_dtype)
        h = attn_res_mix(stream.stored, stream.count, stream.partial, direction, self.eps, self.wide_dtype)
        return h.astype(self.dtype)


def attn_res(cfg, name: str | None) -> AttnResMix:
    """An ``AttnResMix`` with the config's eps and dtypes."""
    return AttnResMix(cfg.attn_res.eps, cfg.compute_dtype, cfg.fp32_dtype, cfg.param_dtype, name=name)
