"""Where a patch is: the learned position grid resampled to the image, time sin/cos, and 2-D RoPE.

MoonViT adds three kinds of position information (SGLang ``kimi_k3_vl.py``, vLLM ``kimi_k25``):

1. A learned ``[Gh, Gw, W]`` grid (64 x 64 in the releases) resampled to the image's patch grid
   with PyTorch's ``F.interpolate(mode, align_corners=False)`` (bilinear for K3, bicubic with
   A = -0.75 and clamped borders for K2.5). Resampling is separable and linear in the grid, so each
   patch's embedding is a weighted sum of a few grid cells: ``taps`` (2 x 2 bilinear, 4 x 4 bicubic)
   computed here in numpy from the static image sizes and applied inside ``jit`` as a gather (the
   gradient reaches exactly the cells the image uses).
2. Fixed sin/cos over the frame index of a clip (``[sin(t·ω), cos(t·ω)]``, ω = 10⁴^(-i/(W/2))),
   added only when the clip has more than one frame.
3. 2-D RoPE inside attention (θ = 10⁴): the head dim is split into complex pairs, pair ``2i``
   rotated by ``col · θ^(-4i/d)`` and pair ``2i+1`` by ``row · θ^(-4i/d)`` (SGLang's interleaved
   x/y ``freqs_cis``, applied as a complex product on adjacent elements).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

CUBIC_A = -0.75  # PyTorch's bicubic convolution constant


def _cubic_weights(t: float) -> list[float]:
    a = CUBIC_A

    def near(x):  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    return [far(t + 1), near(t), near(1 - t), far(2 - t)]


def interp_taps_1d(out_size: int, in_size: int, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """``(index [out, k], weight [out, k])``: output ``i`` = Σ weight·input[index] along one axis.

    PyTorch's ``align_corners=False`` source coordinate ``(i + 0.5)·in/out − 0.5``; bilinear clamps
    it at 0, bicubic clamps its taps to the border.
    """
    scale = in_size / out_size
    taps = 2 if mode == "bilinear" else 4
    index = np.zeros((out_size, taps), np.int32)
    weight = np.zeros((out_size, taps), np.float64)
    for i in range(out_size):
        src = (i + 0.5) * scale - 0.5
        if mode == "bilinear":
            src = max(src, 0.0)
            i0 = min(int(math.floor(src)), in_size - 1)
            lam = src - i0 if i0 < in_size - 1 else 0.0
            index[i] = (i0, min(i0 + 1, in_size - 1))
            weight[i] = (1 - lam, lam)
        else:
            i0 = int(math.floor(src))
            index[i] = [min(max(i0 - 1 + j, 0), in_size - 1) for j in range(4)]
            weight[i] = _cubic_weights(src - i0)
    return index, weight


def grid_taps(rows: np.ndarray, cols: np.ndarray, h: int, w: int, grid: tuple[int, int],
              mode: str) -> tuple[np.ndarray, np.ndarray]:
    """Taps of patches at ``(rows, cols)`` of an ``h x w`` image into the flattened position grid:
    ``(index [n, k²] into Gh·Gw, weight [n, k²])``."""
    ih, wh = interp_taps_1d(h, grid[0], mode)
    iw, ww = interp_taps_1d(w, grid[1], mode)
    index = ih[rows][:, :, None] * grid[1] + iw[cols][:, None, :]  # [n, k, k]
    weight = wh[rows][:, :, None] * ww[cols][:, None, :]
    n = len(rows)
    return index.reshape(n, -1), weight.reshape(n, -1)


def time_sincos(num_frames: int, width: int) -> np.ndarray:
    """``[num_frames, width]`` fixed temporal embedding: ``[sin(t·ω), cos(t·ω)]``."""
    omega = 1.0 / 10000 ** (np.arange(width // 2, dtype=np.float64) / (width / 2.0))
    angle = np.arange(num_frames, dtype=np.float64)[:, None] * omega[None]
    return np.concatenate([np.sin(angle), np.cos(angle)], axis=1)


def rope_2d(x: Float[Array, "B N H K"], rows: Int[Array, "B N"], cols: Int[Array, "B N"], theta: float,
            wide_dtype) -> Float[Array, "B N H K"]:
    """Rotate adjacent pairs of the head dim by the patch's column (even pairs) and row (odd pairs)."""
    K = x.shape[-1]
    freqs = 1.0 / theta ** (np.arange(0, K, 4, dtype=np.float64)[: K // 4] / K)  # [K/4]
    pos = jnp.stack([cols, rows], axis=-1).astype(wide_dtype)  # [B, N, 2]
    angle = (pos[..., None, :] * jnp.asarray(freqs, wide_dtype)[:, None]).reshape(pos.shape[:2] + (K // 2,))
    cos, sin = jnp.cos(angle)[:, :, None], jnp.sin(angle)[:, :, None]  # [B, N, 1, K/2]
    pairs = x.astype(wide_dtype).reshape(x.shape[:-1] + (K // 2, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    return jnp.stack([re * cos - im * sin, re * sin + im * cos], axis=-1).reshape(x.shape)
