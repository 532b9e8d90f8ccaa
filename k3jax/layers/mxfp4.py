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

import typing

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int, UInt8

from k3jax.convert import mxfp4 as codec

COLLECTION = "mxfp4"
EXPERT_WEIGHTS = ("w1", "w3", "w2")
_E8M0_BIAS = 127


# JAX rebuilds an Mxfp4 with other leaves (ShapeDtypeStructs under eval_shape, logical names and
# shardings when a plan places it), so the field annotations document the arrays and are not
# checked when one is built (as for the caches of ``k3jax.infer.cache``).
@typing.no_type_check
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


def _e2m1(codes: UInt8[Array, "*s"]) -> Float[Array, "*s"]:
    """The E2M1 value of each 4-bit code, by arithmetic: |value| = (2·[e > 0] + m) · 2^(max(e, 1) - 2)
    for the exponent bits e and the mantissa bit m, bit 3 the sign. Exactly ``codec.CODE_VALUES``
    (tested, signed zero included). A lookup in that table is a gather, which XLA:TPU did not fuse:
    on a TPU mesh it kept fp32 and int32 copies of every decoded expert stack alive (4.5 GB of
    temporaries where bf16 experts need 0.2 GB, ``tests/k3jax/plan/test_plan_mxfp4.py``)."""
    c = codes.astype(jnp.int32)
    e, m = (c >> 1) & 3, c & 1
    twice = (2 * (e > 0) + m) << (jnp.maximum(e, 1) - 1)  # 2·|value|: 0, 1, 2, 3, 4, 6, 8, 12
    magnitude = twice.astype(jnp.float32) * 0.5
    return jnp.where(c & 8, -magnitude, magnitude)  # code 8 is -0.0, as in the table


def dequantize(packed: UInt8[Array, "*lead O I2"], scale: UInt8[Array, "*lead O G"], dtype) -> Float[Array, "*lead O I"]:
    """JAX twin of ``k3jax.convert.mxfp4.decode`` over any leading axes. Each nibble is decoded and
    scaled elementwise straight into ``dtype``; only the interleave of the even and odd columns is
    a relayout (on TPU one ``dtype`` copy of the stack, no fp32 one)."""
    *lead, rows, half = packed.shape
    # each byte's exponent: the scale of its group of 16 bytes (32 columns)
    step = jnp.broadcast_to(_pow2(scale)[..., None], (*lead, rows, scale.shape[-1], codec.GROUP // 2))
    step = step.reshape(*lead, rows, half)
    even, odd = ((_e2m1(nibbles) * step).astype(dtype) for nibbles in (packed & 0x0F, packed >> 4))
    return jnp.stack([even, odd], axis=-1).reshape(*lead, rows, 2 * half)  # even column first


def _encode_stack(w: np.ndarray) -> Mxfp4:
    """MXFP4 of a stack ``[..., in, out]`` (the model's kernel layout) as ``[..., out, in]`` matrices."""
    w = np.swapaxes(np.asarray(w, np.float32), -1, -2)  # [..., out, in]
    lead = w.shape[:-1]
    packed, scale = codec.encode(w.reshape(-1, w.shape[-1]))
    return Mxfp4(packed=jnp.asarray(packed.reshape(*lead, -1)), scale=jnp.asarray(scale.reshape(*lead, -1)))


def _move_experts(variables: dict, encode) -> dict:
    """``variables`` with every MoE's ``w1, w3, w2`` taken out of ``params`` and put, as
    ``encode(leaf)``, at the same path of ``COLLECTION``. A MoE is any params dict holding all
    three, in the unrolled and the scanned layouts alike (leading layer and expert axes kept)."""
    if "params" not in variables:
        raise ValueError("variables must hold a 'params' collection")
    moved = {}

    def walk(params: dict, path: tuple) -> dict:
        if all(name in params for name in EXPERT_WEIGHTS):
            node = moved
            for key in path:
                node = node.setdefault(key, {})
            node.update({name: encode(params[name]) for name in EXPERT_WEIGHTS})
            return {k: v for k, v in params.items() if k not in EXPERT_WEIGHTS}
        return {k: walk(v, path + (k,)) if isinstance(v, dict) else v for k, v in params.items()}

    params = walk(dict(variables["params"]), ())
    if not moved:
        raise ValueError("variables['params'] holds no MoE expert weights (w1, w3, w2) to quantise")
    return {**variables, "params": params, COLLECTION: moved}


def quantize_experts(variables: dict) -> dict:
    """``variables`` with every MoE's routed expert weights encoded as MXFP4 (``COLLECTION``)."""
    return _move_experts(variables, lambda w: _encode_stack(jax.device_get(w)))


def _encoded_shapes(w: jax.ShapeDtypeStruct) -> Mxfp4:
    *lead, cols, rows = w.shape  # the kernel layout [..., in, out]
    if cols % codec.GROUP:
        raise ValueError(f"an expert weight of shape {w.shape} has {cols} input columns: MXFP4 needs a "
                         f"multiple of {codec.GROUP}")
    u8 = lambda *shape: jax.ShapeDtypeStruct(tuple(shape), jnp.uint8)
    return Mxfp4(packed=u8(*lead, rows, cols // 2), scale=u8(*lead, rows, cols // codec.GROUP))


def _encoded_axes(names: PartitionSpec) -> Mxfp4:
    *lead, cols, rows = tuple(names)  # the matrices are stored [out, in]; a scale group stays in its row
    return Mxfp4(packed=PartitionSpec(*lead, rows, cols), scale=PartitionSpec(*lead, rows, cols))


def quantized_shapes(variables: dict) -> dict:
    """What :func:`quantize_experts` returns, for abstract variables (``ShapeDtypeStruct`` leaves, e.g.
    from ``jax.eval_shape(model.init, …)``): plans compile the MXFP4 program of a model too large to
    hold, without real-size arrays."""
    return _move_experts(variables, _encoded_shapes)


def quantized_axes(logical: dict) -> dict:
    """The logical axis names of :func:`quantize_experts`' output, from those of the variables
    (``sharding.logical_axes``): an encoded matrix keeps its weight's names, its last two swapped to
    the ``[out, in]`` layout; ``packed`` and ``scale`` share them (their ``in`` axes are the
    weight's, halved and divided by 32: whether a mesh axis still divides them is the placement's
    business, ``sharding.init.fitted_spec``)."""
    return _move_experts(logical, _encoded_axes)


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
