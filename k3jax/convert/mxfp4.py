"""MXFP4 (OCP Microscaling FP4) for the routed experts of the Kimi K3 release (SPEC §12).

Layout of compressed-tensors' ``mxfp4-pack-quantized`` format, as shipped:

- ``weight_packed`` uint8 ``[out, in/2]``: two E2M1 codes per byte, the low nibble holds the even
  column. A code is ``s e e m`` (bit 3 = sign): magnitudes ``{0, .5, 1, 1.5, 2, 3, 4, 6}``.
- ``weight_scale`` uint8 ``[out, in/32]``: one E8M0 exponent per 32 consecutive input columns,
  ``value = code_value * 2^(scale - 127)``.

Every decoded value has at most two significant bits, so it is exact in bfloat16 (and wider).
"""

from __future__ import annotations

import numpy as np

GROUP = 32
_E8M0_BIAS = 127
_E8M0_NAN = 255
# E2M1 magnitudes by the low three bits of a code.
_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
# All 16 codes: bit 3 flips the sign (also the JAX decoder's table, k3jax.layers.mxfp4).
CODE_VALUES = np.concatenate([_MAGNITUDES, -_MAGNITUDES])


def _check_pair(packed: np.ndarray, scale: np.ndarray, name: str) -> tuple[int, int]:
    if packed.dtype != np.uint8 or scale.dtype != np.uint8:
        raise ValueError(f"{name}: weight_packed/weight_scale must be uint8, got {packed.dtype}/{scale.dtype}")
    if packed.ndim != 2 or scale.ndim != 2:
        raise ValueError(f"{name}: weight_packed/weight_scale must be 2-D, got {packed.shape}/{scale.shape}")
    rows, half = packed.shape
    cols = 2 * half
    if cols % GROUP or scale.shape != (rows, cols // GROUP):
        raise ValueError(
            f"{name}: weight_scale shape {scale.shape} must be (out, in/{GROUP}) = {(rows, cols // GROUP)} "
            f"for weight_packed {packed.shape} (in = {cols}, a multiple of {GROUP})")
    if np.any(scale == _E8M0_NAN):
        raise ValueError(f"{name}: weight_scale holds the E8M0 NaN code {_E8M0_NAN}")
    return rows, cols


def decode(packed: np.ndarray, scale: np.ndarray, *, name: str = "mxfp4") -> np.ndarray:
    """The float32 matrix ``[out, in]`` that MXFP4 ``packed [out, in/2]`` + ``scale [out, in/32]`` encode."""
    rows, cols = _check_pair(packed, scale, name)
    codes = np.empty((rows, cols), dtype=np.uint8)
    codes[:, 0::2] = packed & 0x0F
    codes[:, 1::2] = packed >> 4
    values = CODE_VALUES[codes].reshape(rows, cols // GROUP, GROUP)
    # ldexp multiplies by an exact power of two: no rounding anywhere.
    exponents = scale.astype(np.int32)[..., None] - _E8M0_BIAS
    return np.ldexp(values, exponents).reshape(rows, cols)


def _round_to_codes(x: np.ndarray) -> np.ndarray:
    """Nearest E2M1 code of each (already scaled) value, ties to the even code, saturating at ±6."""
    mag = np.minimum(np.abs(x), _MAGNITUDES[-1])
    # Midpoints between consecutive magnitudes; ties go to the code with an even mantissa bit.
    mids = (_MAGNITUDES[1:] + _MAGNITUDES[:-1]) / 2
    idx = np.searchsorted(mids, mag, side="left")  # mag <= mid -> lower code
    on_mid = (idx < len(mids)) & (mag == mids[np.minimum(idx, len(mids) - 1)])
    idx = np.where(on_mid & (idx % 2 == 1), idx + 1, idx)
    # The sign bit is kept on zero codes: the release stores -0 (decoded to bf16 -0.0) as such.
    sign = np.signbit(x).astype(np.uint8) << 3
    return idx.astype(np.uint8) | sign


def encode(w: np.ndarray, *, name: str = "mxfp4") -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 ``(packed [out, in/2], scale [out, in/32])`` of a matrix ``w [out, in]``.

    The shared exponent of each group of 32 is ``floor(log2(amax)) - 2`` (OCP MX v1.0 §6.3: the
    largest E2M1 exponent is 2), so matrices that are exactly MXFP4-representable round-trip
    exactly through ``decode(encode(w))``; others are rounded to nearest, ties to even.
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % GROUP:
        raise ValueError(f"{name}: shape {w.shape} must be [out, in] with in a multiple of {GROUP}")
    if not np.all(np.isfinite(w)):
        raise ValueError(f"{name}: weights must be finite to encode as MXFP4")
    rows, cols = w.shape
    groups = w.reshape(rows, cols // GROUP, GROUP)
    amax = np.max(np.abs(groups), axis=-1)  # [out, in/32]
    _, exp2 = np.frexp(np.where(amax > 0, amax, 1.0))  # amax = m * 2^exp2, m in [0.5, 1)
    shared = np.where(amax > 0, exp2 - 1 - 2, -_E8M0_BIAS)
    scale = np.clip(shared + _E8M0_BIAS, 0, _E8M0_NAN - 1).astype(np.uint8)
    scaled = np.ldexp(groups, -(scale.astype(np.int32)[..., None] - _E8M0_BIAS))
    codes = _round_to_codes(scaled).reshape(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, scale
