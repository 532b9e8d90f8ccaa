"""MXFP4 routed-expert weights for inference: the release's own format, dequantised on the fly.

K3 ships its routed experts as MXFP4 (``k3jax.convert.mxfp4``: two E2M1 codes per byte and one
E8M0 exponent per 32 input columns, 4.25 bits a weight, about a quarter of bf16's bytes). Decode
at small batch reads weights, not FLOPs, so keeping the experts in that format cuts the bytes a
step reads; the values are decoded inside the fusion that uses them (``k3jax.layers.moe_decode``).

``quantize_experts(variables)`` moves every MoE's ``w1, w3, w2`` out of ``params`` into the
``mxfp4`` collection as :class:`Mxfp4` pairs in the release's ``[out, in]`` layout per expert
(``w1, w3``: ``[E, F, L/2]``; ``w2``: ``[E, L, F/2]``); the MoE layer reads them from there.
Every decoded value is exact in bfloat16, so dequantised weights are the quantised model exactly.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, UInt8

from k3jax.convert import mxfp4 as codec

COLLECTION = "mxfp4"
EXPERT_WEIGHTS = ("w1", "w3", "w2")
_E8M0_BIAS = 127


@flax.struct.dataclass
class Mxfp4:
    """One stack of MXFP4 matrices ``[..., out, in]`` (``in`` the contraction axis)."""

    packed: UInt8[Array, "*lead O I2"]  # two E2M1 codes per byte, the low nibble the even column
    scale: UInt8[Array, "*lead O G"]  # one E8M0 exponent per 32 input columns

    def take(self, ids: Int[Array, "*idx"]) -> "Mxfp4":
        """The matrices ``ids`` of the leading (expert) axis."""
        return Mxfp4(packed=self.packed[ids], scale=self.scale[ids])

    def dequantize(self, dtype) -> Float[Array, "*lead O I"]:
        """The encoded matrices in ``dtype`` (exact for bfloat16 and wider)."""
        return dequantize(self.packed, self.scale, dtype)


def _pow2(scale: UInt8[Array, "*s"]) -> Float[Array, "*s"]:
    """``2^(scale - 127)`` exactly: the exponent field of a float32 (code 0 is the subnormal 2^-127)."""
    normal = jax.lax.bitcast_convert_type(scale.astype(jnp.uint32) << 23, jnp.float32)
    return jnp.where(scale == 0, jnp.float32(2.0 ** -_E8M0_BIAS), normal)


def dequantize(packed: UInt8[Array, "*lead O I2"], scale: UInt8[Array, "*lead O G"], dtype) -> Float[Array, "*lead O I"]:
    """JAX twin of ``k3jax.convert.mxfp4.decode`` over any leading axes (fuses into its consumer)."""
    codes = jnp.stack([packed & 0x0F, packed >> 4], axis=-1)  # [..., O, I/2, 2]: even column first
    *lead, rows, half = packed.shape
    values = jnp.asarray(codec.CODE_VALUES, jnp.float32)[codes.astype(jnp.int32)]
    values = values.reshape(*lead, rows, scale.shape[-1], codec.GROUP) * _pow2(scale)[..., None]
    return values.reshape(*lead, rows, 2 * half).astype(dtype)


def _encode_stack(w: np.ndarray) -> Mxfp4:
    """MXFP4 of a stack ``[..., in, out]`` (the model's kernel layout) as ``[..., out, in]`` matrices."""
    w = np.swapaxes(np.asarray(w, np.float32), -1, -2)  # [..., out, in]
    lead = w.shape[:-1]
    packed, scale = codec.encode(w.reshape(-1, w.shape[-1]))
    return Mxfp4(packed=jnp.asarray(packed.reshape(*lead, -1)), scale=jnp.asarray(scale.reshape(*lead, -1)))


def quantize_experts(variables: dict) -> dict:
    """``variables`` with every MoE's routed expert weights encoded as MXFP4 (``COLLECTION``).

    Works on the unrolled and the scanned layouts alike: a MoE is any params dict holding
    ``w1, w3, w2``; its leading (layer, expert) axes are kept.
    """
    if "params" not in variables:
        raise ValueError("variables must hold a 'params' collection")
    quantized = {}

    def walk(params: dict, path: tuple) -> dict:
        if all(name in params for name in EXPERT_WEIGHTS):
            node = quantized
            for key in path:
                node = node.setdefault(key, {})
            node.update({name: _encode_stack(jax.device_get(params[name])) for name in EXPERT_WEIGHTS})
            return {k: v for k, v in params.items() if k not in EXPERT_WEIGHTS}
        return {k: walk(v, path + (k,)) if isinstance(v, dict) else v for k, v in params.items()}

    params = walk(dict(variables["params"]), ())
    if not quantized:
        raise ValueError("variables['params'] holds no MoE expert weights (w1, w3, w2) to quantise")
    return {**variables, "params": params, COLLECTION: quantized}


def dequantize_experts(variables: dict, dtype) -> dict:
    """The inverse layout of :func:`quantize_experts`: plain ``params`` with the decoded weights."""
    def walk(params: dict, quantized: dict) -> dict:
        out = dict(params)
        for key, node in quantized.items():
            if isinstance(node, Mxfp4):
                out[key] = jnp.swapaxes(node.dequantize(dtype), -1, -2)  # back to [..., in, out]
            else:
                out[key] = walk(params.get(key, {}), node)
        return out

    rest = {k: v for k, v in variables.items() if k != COLLECTION}
    return {**rest, "params": walk(variables["params"], variables[COLLECTION])}
