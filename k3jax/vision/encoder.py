"""MoonViT: patch embedding, pre-norm ViT blocks with 2-D RoPE, the 2 x 2 merge and temporal mean.

Algorithm (one row of packed patches, ``k3jax.vision.batch``):

1. ``x = pixels W_patch (+ b)`` (the 14 x 14 Conv2d as a matmul over ``(C, py, px)``), plus the
   resampled position grid, plus the time sin/cos of the patch's frame (clips of > 1 frame).
2. ``L`` blocks: ``x += W_o Attn(RoPE2d(q), RoPE2d(k), v)`` on ``norm0(x)`` with ``q, k, v`` from
   one fused ``W_qkv`` (``[3, H, K]`` per input: K3 has 12 heads of 128, so 1536 != width 1024);
   attention is bidirectional inside one image or clip (segment mask), fp32 softmax, scale K^-1/2;
   then ``x += fc1 GELU_tanh(fc0 norm1(x))``.
3. Final norm; the four patches of each 2 x 2 window side by side (``[4W]``), averaged over the
   frames of a clip (``sd2_tpool``).

Norms are RMSNorm without bias (K3) or LayerNorm with bias (K2.5), in fp32; matmuls take the
compute dtype (bf16). Logical axes: ``vision_embed`` (width, unsharded by the current rules),
``heads``/``head_dim``/``mlp`` (tensor parallel), activations ``(batch, patches, vision_embed)``.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from k3jax.layers.linear import constrain, einsum, param
from k3jax.layers.norm import RMSNorm
from k3jax.vision.batch import MediaBatch
from k3jax.vision.config import VisionConfig
from k3jax.vision.positions import rope_2d, time_sincos

ACT = ("batch", "patches", "vision_embed")


class LayerNorm(nn.Module):
    """LayerNorm over the last axis in ``wide_dtype`` (Kimi-VL / K2.5 towers), ``scale`` and ``bias``."""

    eps: float
    dtype: Any
    wide_dtype: Any
    param_dtype: Any
    axis: str = "vision_embed"

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        scale = param(self, "scale", nn.initializers.ones, (d,), (self.axis,), self.param_dtype)
        bias = param(self, "bias", nn.initializers.zeros, (d,), (self.axis,), self.param_dtype)
        x = x.astype(self.wide_dtype)
        mean = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + self.eps) * scale.astype(self.wide_dtype) + bias.astype(self.wide_dtype)
        return y.astype(self.dtype)


def vision_norm(cfg: VisionConfig, name: str, *, kind: str | None = None, eps: float | None = None,
                axis: str = "vision_embed", out_dtype=None) -> nn.Module:
    kind = cfg.norm if kind is None else kind
    eps = cfg.norm_eps if eps is None else eps
    cls = RMSNorm if kind == "rmsnorm" else LayerNorm
    return cls(eps=eps, dtype=cfg.compute_dtype if out_dtype is None else out_dtype, wide_dtype=cfg.fp32_dtype,
               param_dtype=cfg.param_dtype, axis=axis, name=name)


class Dense(nn.Module):
    """``einsum(eq, x, kernel) (+ bias)``, kernel of ``shape`` with logical ``axes``, in the compute dtype."""

    cfg: VisionConfig
    eq: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    bias: bool
    bias_dims: int = 1  # trailing kernel dims the bias spans

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        kernel = param(self, "kernel", nn.initializers.normal(cfg.initializer_range), self.shape, self.axes,
                       cfg.param_dtype)
        y = einsum(self.eq, x.astype(cfg.compute_dtype), kernel.astype(cfg.compute_dtype))
        if self.bias:
            shape, axes = self.shape[-self.bias_dims:], self.axes[-self.bias_dims:]
            y = y + param(self, "bias", nn.initializers.zeros, shape, axes, cfg.param_dtype).astype(y.dtype)
        return y


def segment_attention(q, k, v, segments: Int[Array, "B N"], wide_dtype):
    """Softmax attention restricted to equal segment ids (padding attends to padding), fp32 softmax."""
    scale = q.shape[-1] ** -0.5
    logits = jnp.einsum("BNHK,BMHK->BHNM", q, k, preferred_element_type=wide_dtype) * scale
    same = segments[:, None, :, None] == segments[:, None, None, :]  # [B, 1, N, M]
    probs = jax.nn.softmax(jnp.where(same, logits, -jnp.inf), axis=-1)
    return jnp.einsum("BHNM,BMHK->BNHK", probs.astype(v.dtype), v)


class Block(nn.Module):
    cfg: VisionConfig

    @nn.compact
    def __call__(self, x, segments, rows, cols):
        cfg = self.cfg
        W, H, K, F = cfg.hidden, cfg.num_heads, cfg.head_dim, cfg.mlp_dim
        h = vision_norm(cfg, "norm0")(x)
        qkv = Dense(cfg, "BNW,WSHK->BNSHK", (W, 3, H, K), ("vision_embed", None, "heads", "head_dim"), cfg.bias, 3,
                    name="wqkv")(h)  # [B, N, 3, H, K]
        q, k = (rope_2d(qkv[:, :, i], rows, cols, cfg.rope_theta, cfg.fp32_dtype).astype(cfg.compute_dtype)
                for i in (0, 1))
        o = segment_attention(q, k, qkv[:, :, 2], segments, cfg.fp32_dtype)  # [B, N, H, K]
        x = x + Dense(cfg, "BNHK,HKW->BNW", (H, K, W), ("heads", "head_dim", "vision_embed"), cfg.bias, name="wo")(o)
        x = constrain(x, ACT)
        h = vision_norm(cfg, "norm1")(x)
        h = Dense(cfg, "BNW,WF->BNF", (W, F), ("vision_embed", "mlp"), cfg.bias, name="fc0")(h)
        h = Dense(cfg, "BNF,FW->BNW", (F, W), ("mlp", "vision_embed"), cfg.bias, name="fc1")(
            jax.nn.gelu(h, approximate=True))
        return constrain(x + h, ACT)


class Encoder(nn.Module):
    cfg: VisionConfig

    @nn.compact
    def __call__(self, x, media: MediaBatch):
        for i in range(self.cfg.num_layers):
            x = Block(self.cfg, name=f"blocks_{i}")(x, media.segments, media.rows, media.cols)
        return vision_norm(self.cfg, "final_layernorm")(x)


class PatchEmbed(nn.Module):
    cfg: VisionConfig

    @nn.compact
    def __call__(self, media: MediaBatch) -> Float[Array, "B N W"]:
        cfg = self.cfg
        W, (gh, gw) = cfg.hidden, cfg.pos_grid
        x = Dense(cfg, "BNP,PW->BNW", (cfg.patch_features, W), ("patch", "vision_embed"), cfg.patch_bias,
                  name="proj")(media.pixels)
        grid = param(self, "pos_emb", nn.initializers.normal(cfg.initializer_range), (gh, gw, W),
                     ("pos_h", "pos_w", "vision_embed"), cfg.param_dtype)
        taps = grid.reshape(gh * gw, W).astype(cfg.fp32_dtype)[media.pos_index]  # [B, N, K, W]
        pos = jnp.einsum("BNK,BNKW->BNW", media.pos_weight.astype(cfg.fp32_dtype), taps)
        table = jnp.asarray(time_sincos(cfg.pos_time, W), cfg.fp32_dtype)
        time = jnp.where((media.frames >= 0)[..., None], table[jnp.maximum(media.frames, 0)], 0.0)
        return constrain((x.astype(cfg.fp32_dtype) + pos + time).astype(cfg.compute_dtype), ACT)


def merge_windows(x: Float[Array, "B N W"], media: MediaBatch) -> Float[Array, "B M F"]:
    """Merged tokens: each 2 x 2 window's patches side by side, averaged over a clip's frames (fp32)."""
    B, N, W = x.shape
    M = media.num_merged
    windows = x.reshape(B, -1, N // media.window_target.shape[1] * W).astype(jnp.promote_types(x.dtype, jnp.float32))
    windows = windows * media.window_weight[..., None].astype(windows.dtype)
    ids = (media.window_target + jnp.arange(B)[:, None] * (M + 1)).reshape(-1)
    summed = jax.ops.segment_sum(windows.reshape(-1, windows.shape[-1]), ids, num_segments=B * (M + 1))
    return summed.reshape(B, M + 1, -1)[:, :M]


class VisionTower(nn.Module):
    """Packed patches -> merged, time-pooled features ``[B, M, 4W]`` (before the projector)."""

    cfg: VisionConfig

    @nn.compact
    def __call__(self, media: MediaBatch) -> Float[Array, "B M F"]:
        media = jax.tree.map(jnp.asarray, media)  # pack_media's host arrays, when called outside jit
        x = PatchEmbed(self.cfg, name="patch_embed")(media)
        x = Encoder(self.cfg, name="encoder")(x, media)
        return constrain(merge_windows(x, media), ("batch", "length", "vision_merged"))
