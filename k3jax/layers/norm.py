"""RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization").

``rms(x; w, eps) = x / sqrt(mean(x²) + eps) · w``, computed in fp32 (or wider: a float64 model
stays float64) and cast back to the compute dtype (SPEC §10: all norms' variance in fp32).

The backward is written out (``_rms_norm_bwd``) so that it keeps only ``x`` in its own dtype and
the per-row ``1/rms``: autodiff kept three fp32 copies of the row (``x``, ``x/rms``, ``x/rms·w``),
1.1 GiB per 96-head KDA output norm and 0.66 GiB per 7168-wide norm at 8 K tokens
(``benchmarks/bench_layer.py --residuals``), written by the forward and read back by the backward.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from k3jax.layers.linear import param


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rms_norm(x: Float[Array, "*B D"], scale: Float[Array, "D"], eps: float, wide_dtype) -> Float[Array, "*B D"]:
    """RMS-normalise the last axis in ``wide_dtype`` and multiply by ``scale``; result in ``wide_dtype``."""
    return _rms_norm_fwd(x, scale, eps, wide_dtype)[0]


def _inv_rms(xw, eps):
    return jax.lax.rsqrt(jnp.mean(jnp.square(xw), axis=-1, keepdims=True) + eps)


def _rms_norm_fwd(x, scale, eps, wide_dtype):
    xw = x.astype(wide_dtype)
    inv = _inv_rms(xw, eps)
    return xw * inv * scale.astype(wide_dtype), (x, inv, scale)


def _rms_norm_bwd(eps, wide_dtype, res, dy):
    """``dx = inv · (dŷ − x̂ · mean(dŷ · x̂))`` with ``x̂ = x · inv``, ``dŷ = dy · w``; ``dw = Σ dy · x̂``."""
    x, inv, scale = res
    xhat = x.astype(wide_dtype) * inv
    dy = dy.astype(wide_dtype)
    dxhat = dy * scale.astype(wide_dtype)
    dx = inv * (dxhat - xhat * jnp.mean(dxhat * xhat, axis=-1, keepdims=True))
    dscale = jnp.sum((dy * xhat).reshape(-1, x.shape[-1]), axis=0)
    return dx.astype(x.dtype), dscale.astype(scale.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


@functools.partial(jax.checkpoint, static_argnums=(3, 4, 5))
def gated_rms_norm(x: Float[Array, "*B D"], scale: Float[Array, "D"], logits: Float[Array, "*B D"], eps: float,
                   wide_dtype, out_dtype) -> Float[Array, "*B D"]:
    """``rms_norm(x) · sigmoid(logits)`` in ``wide_dtype``, cast to ``out_dtype`` (KDA's output, SPEC §2).

    One checkpointed region: the backward keeps ``x`` (which the norm's backward reads anyway) and
    the logits, and recomputes the normed row inside its own pass. Normed, then gated by
    ``gates.sigmoid_gate``, the forward wrote the wide normed ``x`` for the gate's backward to read
    (``f32[8192, 96, 128]``, 0.4 GB each way per K3 KDA layer at 8 K tokens)."""
    normed = rms_norm(x, scale, eps, wide_dtype)
    return (normed * jax.nn.sigmoid(logits.astype(wide_dtype))).astype(out_dtype)


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
    def __call__(self, x: Float[Array, "*B D"], gate: Float[Array, "*B D"] | None = None) -> Float[Array, "*B D"]:
        """``gate``: output-gate logits, giving ``rms(x) · sigmoid(gate)`` (``gated_rms_norm``)."""
        scale = param(self, "scale", nn.initializers.ones, (x.shape[-1],), (self.axis,), self.param_dtype)
        if gate is not None:
            return gated_rms_norm(x, scale, gate, self.eps, self.wide_dtype, self.dtype)
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
