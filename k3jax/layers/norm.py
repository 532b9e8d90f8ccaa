"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization").

``rms(x; w, eps) = x / sqrt(mean(x²) + eps) · w``, computed in fp32 (or wider: a float64 model
stays float64) and cast back to the compute dtype (SPEC §10: all norms' variance in fp32).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from k3jax.layers.linear import param


def rms_norm(x: Float[Array, "*B D"], scale: Float[Array, "D"], eps: float, wide_dtype) -> Float[Array, "*B D"]:
    """RMS-normalise the last axis in ``wide_dtype`` and multiply by ``scale``; result in ``wide_dtype``."""
    x = x.astype(wide_dtype)
    inv = jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
    return x * inv * scale.astype(wide_dtype)


def l2_normalize(x: Float[Array, "*B K"], eps: float = 1e-6) -> Float[Array, "*B K"]:
    """``x / sqrt(Σx² + eps)`` on the last axis: fla's ``l2norm_fwd`` (eps inside the sqrt,
    unlike ``F.normalize``, which clamps the norm at eps)."""
    return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True) + eps)


class RMSNorm(nn.Module):
    """RMSNorm over the last axis with a learned ``scale`` (init 1) of logical axis ``axis``."""

    eps: float
    dtype: Any  # output (compute) dtype
    wide_dtype: Any  # dtype of the variance and the product
    param_dtype: Any
    axis: str = "embed"

    @nn.compact
    def __call__(self, x: Float[Array, "*B D"]) -> Float[Array, "*B D"]:
        scale = param(self, "scale", nn.initializers.ones, (x.shape[-1],), (self.axis,), self.param_dtype)
        return rms_norm(x, scale, self.eps, self.wide_dtype).astype(self.dtype)


def norm(cfg, name: str | None, *, eps: float | None = None, axis: str = "embed", wide_param: bool = False,
         out_dtype: Any = None) -> RMSNorm:
    """An ``RMSNorm`` with the config's dtypes (eps defaults to ``cfg.rms_norm_eps``)."""
    param_dtype = jnp.promote_types(cfg.param_dtype, jnp.float32) if wide_param else cfg.param_dtype
    return RMSNorm(
        eps=cfg.rms_norm_eps if eps is None else eps,
        dtype=cfg.compute_dtype if out_dtype is None else out_dtype,
        wide_dtype=cfg.fp32_dtype, param_dtype=param_dtype, axis=axis, name=name,
    )
