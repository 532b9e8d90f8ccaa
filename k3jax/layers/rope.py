"""Rotary position embedding with YaRN scaling, DeepSeek-V3 style (Kimi K2's MLA only).

RoPE: Su et al. 2021, "RoFormer"; YaRN: Peng et al. 2023, "YaRN: Efficient Context Window
Extension of Large Language Models". K3 and Kimi-Linear are NoPE and never call this module.

DeepSeek-V3's reference de-interleaves the rope slice (``[x0, x2, …, x1, x3, …]``) before a
rotate-half rotation; that rotates the pairs ``(x_{2i}, x_{2i+1})`` by frequency ``i``. We rotate the
pairs in place: q·k is unchanged because queries and keys get the same permutation.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from k3jax.config import RopeConfig


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _correction_dim(num_rotations: float, dim: int, theta: float, max_pos: int) -> float:
    """The rotary dimension whose wavelength fits ``num_rotations`` times into ``max_pos``."""
    return dim * math.log(max_pos / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))


def inverse_frequencies(rope: RopeConfig, dim: int) -> np.ndarray:
    """``[dim/2]`` inverse frequencies: plain RoPE, or YaRN's blend of interpolated (low frequency)
    and extrapolated (high frequency) ones with a linear ramp between the correction dims."""
    extra = 1.0 / rope.theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if rope.yarn_factor is None or rope.yarn_factor <= 1:
        return extra
    inter = extra / rope.yarn_factor
    lo = max(math.floor(_correction_dim(rope.yarn_beta_fast, dim, rope.theta, rope.yarn_original_max_position)), 0)
    hi = min(math.ceil(_correction_dim(rope.yarn_beta_slow, dim, rope.theta, rope.yarn_original_max_position)),
             dim - 1)
    hi = hi + 0.001 if lo == hi else hi
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - lo) / (hi - lo), 0.0, 1.0)
    keep = 1.0 - ramp  # 1: extrapolate (high frequency), 0: interpolate
    return inter * (1.0 - keep) + extra * keep


def rotation_scale(rope: RopeConfig) -> float:
    """YaRN's magnitude factor on cos/sin (1 without YaRN)."""
    if rope.yarn_factor is None:
        return 1.0
    return _yarn_mscale(rope.yarn_factor, rope.yarn_mscale) / _yarn_mscale(rope.yarn_factor, rope.yarn_mscale_all_dim)


def softmax_scale_factor(rope: RopeConfig | None) -> float:
    """Multiplier on the attention scale ``(dn+dr)^-1/2``: YaRN's ``mscale_all_dim`` squared."""
    if rope is None or rope.yarn_factor is None or not rope.yarn_mscale_all_dim:
        return 1.0
    return _yarn_mscale(rope.yarn_factor, rope.yarn_mscale_all_dim) ** 2


def apply_rope(x: Float[Array, "B T *H R"], positions: Array, rope: RopeConfig, wide_dtype) -> Float[Array, "B T *H R"]:
    """Rotate the pairs ``(x_{2i}, x_{2i+1})`` of the last axis by ``positions · inv_freq_i``.

    ``positions`` is ``[B, T]`` (or broadcastable to it); the result is in ``wide_dtype``.
    """
    dim = x.shape[-1]
    inv = jnp.asarray(inverse_frequencies(rope, dim), wide_dtype)
    angle = positions.astype(wide_dtype)[..., None] * inv  # [B, T, R/2]
    angle = angle.reshape(angle.shape[:2] + (1,) * (x.ndim - 3) + angle.shape[-1:])
    cos = jnp.cos(angle) * rotation_scale(rope)
    sin = jnp.sin(angle) * rotation_scale(rope)
    pairs = x.astype(wide_dtype).reshape(x.shape[:-1] + (dim // 2, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
    return rotated.reshape(x.shape)
