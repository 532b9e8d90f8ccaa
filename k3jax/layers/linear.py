"""Parameters with logical axis names, and the named-axis projection every layer is built from.

Kernels are stored ``[in, out]`` with the head axis explicit (``[D, H, K]``, ``[H, K, D]``;
docs/params.md), so one projection is one einsum whose string spells the SPEC axis letters.

Matmul precision: ``PRECISION`` is the module-level default handed to every einsum (``None``:
XLA's default, or whatever ``jax.default_matmul_precision`` sets). Golden float32 runs wrap the
call in ``jax.default_matmul_precision("highest")``, which also keys the jit cache.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig
from k3jax.layers.mixed_input import MixedInput, kernel_runs
from pallas_kernels.mix_matvec import kernel_gpu_tokens

PRECISION: jax.lax.Precision | str | None = None


def einsum(eq: str, *operands, preferred_element_type=None):
    """``jnp.einsum`` at the module's matmul precision."""
    return jnp.einsum(eq, *operands, precision=PRECISION, preferred_element_type=preferred_element_type)


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """Name an activation's logical axes for the sharding rules (a no-op outside a mesh context)."""
    return nn.with_logical_constraint(x, axes)


def wide_param_dtype(cfg: ModelConfig):
    """Storage dtype of the fp32 parameters (convs, gate biases, router): float32 or wider."""
    return jnp.promote_types(cfg.param_dtype, jnp.float32)


def param(module: nn.Module, name: str, init: Callable, shape: tuple[int, ...],
          axes: tuple[str | None, ...], dtype: Any):
    """A parameter annotated with logical axis names (for sharding rules and per-head Muon; None: an
    axis no rule shards)."""
    if len(axes) != len(shape):
        raise ValueError(f"axes={axes} must name every dimension of shape={shape}")
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


class Proj(nn.Module):
    """``y = einsum(eq, x, W)`` with ``W`` stored as ``kernel`` of ``shape`` and logical ``axes``.

    Operands are cast to ``dtype`` (the compute dtype, or a wide dtype for fp32 islands).

    Decode layout: where the ``decode`` collection holds ``kernel_t`` here (``k3jax.infer.decode.
    decode_layout`` moves ``OUTPUT_FIRST`` kernels there), that is the kernel with its one output axis
    moved first, contracted axes last, and the product reads it instead. At batch 1 XLA turns a
    matrix-vector product into a multiply and a sum over the contracted axes: over leading axes it
    wrote the weight-sized product out first (2 MB per ``small()`` ``o_proj``, 68 MB a step), over
    trailing axes it sums in the same kernel; and where it fuses the norm before a projection into
    it (a Triton block-level fusion, each program a tile of outputs), each program reads whole
    contiguous weight rows instead of a column slab of 32 bytes a row. Same sums, in another order.
    """

    eq: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    dtype: Any
    param_dtype: Any
    init_std: float = 0.02
    out_dtype: Any = None  # accumulate into and return this dtype (fp32 logits); None: ``dtype``
    decode_glue: str | None = None  # ``ModelConfig.decode_glue_implementation``: the token kernel at 5-64 rows

    @nn.compact
    def __call__(self, x: jax.Array | MixedInput, split: int | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
        """``split``: return the outputs of ``kernel[..., :split]`` and ``kernel[..., split:]`` as two
        products, for consumers that take the halves apart (a packed output would be copied into
        them, and their gradients joined back, at the activation's size; the weight's halves are
        copied instead)."""
        if self.has_variable("decode", "kernel_t"):
            if split is not None:
                raise ValueError(f"{self.name}: split={split} reads the kernel as stored, not a decode layout")
            inputs, rest = self.eq.split(",")
            w, out = rest.split("->")
            eq, kernel = f"{inputs},{w[-1] + w[:-1]}->{out}", self.get_variable("decode", "kernel_t")
        else:
            eq, kernel = self.eq, param(self, "kernel", nn.initializers.normal(self.init_std), self.shape, self.axes,
                                        self.param_dtype)
        if isinstance(x, MixedInput):  # the input computed inside the product's kernel
            x_axes, w_axes = eq.split("->")[0].split(",")
            contracted = len(w_axes) - 1  # decode_layout's [N, *in] against x's trailing axes
            if split is None and self.has_variable("decode", "kernel_t") and x_axes.endswith(w_axes[1:]):
                y = x.project((kernel.reshape(kernel.shape[0], -1),), self.dtype, self.out_dtype,
                              contracted=contracted)
                if y is not None:
                    return y
            x = x.materialize()
        elif split is None and self.has_variable("decode", "kernel_t"):
            y = self._token_product(x, eq, kernel)
            if y is not None:
                return y
        x, kernel = x.astype(self.dtype), kernel.astype(self.dtype)
        if split is None:
            return einsum(eq, x, kernel, preferred_element_type=self.out_dtype)
        return tuple(einsum(eq, x, w, preferred_element_type=self.out_dtype)
                     for w in (kernel[..., :split], kernel[..., split:]))

    def _token_product(self, x: jax.Array, eq: str, kernel: jax.Array) -> jax.Array | None:
        """The product by ``kernel_gpu_tokens.token_matmul`` where ``kernel_runs`` and it takes ``x``'s
        5-64 rows (16-bit, contracting x's trailing axes with ``kernel [N, *in]``); else None."""
        x_axes, w_axes = eq.split("->")[0].split(",")
        contracted = len(w_axes) - 1
        lead, N = x.shape[:-contracted], kernel.shape[0]
        rows = jax.ShapeDtypeStruct((math.prod(lead), math.prod(x.shape[-contracted:])), jnp.dtype(self.dtype))
        w = jax.ShapeDtypeStruct((N, rows.shape[1]), jnp.dtype(self.dtype))
        if not (x_axes.endswith(w_axes[1:]) and kernel_gpu_tokens.accepts(rows, (w,))
                and kernel_runs(self.decode_glue)):
            return None
        out = None if self.out_dtype is None else jnp.dtype(self.out_dtype)
        y = kernel_gpu_tokens.token_matmul(x.reshape(rows.shape).astype(self.dtype),
                                           (kernel.reshape(N, -1).astype(self.dtype),), out_dtype=out)
        return y.reshape(lead + (N,))


# Projections whose kernels decode reads output axis first (``Proj``, ``decode_layout``): those that
# contract a kernel's leading axes with a vector computed just before (the layers' output projections),
# and the input projections of one output axis, which XLA fuses with the norm before them (MLPs' gate
# and up, the router, MoE's latent down_proj; the packed inputs of KDA and MLA likewise, ``PACKED``).
OUTPUT_FIRST = ("o_proj", "down", "up_proj", "gate", "up", "router", "down_proj")


def proj(cfg: ModelConfig, eq: str, shape: tuple[int, ...], axes: tuple[str | None, ...], name: str | None,
         *, wide: bool = False, out_dtype: Any = None) -> Proj:
    """A ``Proj`` with the config's dtypes; ``wide=True`` stores and computes it in fp32 (or wider)."""
    dtype = cfg.fp32_dtype if wide else cfg.compute_dtype
    param_dtype = wide_param_dtype(cfg) if wide else cfg.param_dtype
    return Proj(eq, shape, axes, dtype, param_dtype, cfg.initializer_range, out_dtype, cfg.decode_glue_implementation,
                name=name)


# A module's input projections packed by ``decode_layout`` into one kernel: ``[N, D]`` under this name
# in its ``decode`` collection, the projections' flattened outputs concatenated in the order the
# module's ``packed_inputs(cfg)`` lists them ((projection name, output shape) pairs).
PACKED = "in_proj"


# The packed kernel's rows are padded with zero rows to a multiple of this, so the batch-64 product takes
# ``token_matmul``'s 16-row dot tiles (small()'s KDA inputs: 4232 -> 4256 rows, 133 programs of 32 columns).
# XLA ran the 4232-wide product as a split-K GEMM and its reduction, two kernels on the step's chain.
PACKED_ROWS = 32


def pack_kernels(kernels: Sequence[jax.Array], outs: Sequence[tuple[int, ...]]) -> jax.Array:
    """Kernels ``[*L, D, *out_i]`` (boxed or not) as one ``[*L, N, D]``: each output flattened, the
    outputs concatenated, output axis first (as ``OUTPUT_FIRST`` kernels are stored for decode), then zero
    rows up to a multiple of ``PACKED_ROWS`` (their outputs, zeros, are never read: ``split_packed``)."""
    flat = [k.reshape(k.shape[:-len(out)] + (-1,)) for k, out in zip(map(nn.meta.unbox, kernels), outs)]
    packed = jnp.concatenate(flat, axis=-1)
    pad = [(0, 0)] * (packed.ndim - 1) + [(0, -packed.shape[-1] % PACKED_ROWS)]
    return jnp.swapaxes(jnp.pad(packed, pad), -1, -2)


def packed_product(module: nn.Module, x: jax.Array | MixedInput, dtype: Any) -> jax.Array | None:
    """On ``decode_layout``'s tree: every input projection of ``x [..., D]`` as one product over the
    module's packed kernel (``PACKED``), ``[..., N]``; None where it holds none (the training tree:
    concatenating the kernels there would copy them on every call).

    At batch 1 XLA fuses the norm before these projections into each of them, one matrix-vector
    kernel per projection, each a few µs of latency for its 0.3-4 MB; packed, they are one kernel
    over the concatenated rows. Each output is the same sum over ``D`` (in another fp32 order)."""
    if not module.has_variable("decode", PACKED):
        return None
    w = module.get_variable("decode", PACKED)  # [N, D]
    y = x.project((w,), dtype) if isinstance(x, MixedInput) else None  # the input computed inside
    if y is None:
        x = x.materialize() if isinstance(x, MixedInput) else x
        y = einsum("...D,ND->...N", x.astype(dtype), w.astype(dtype))
    return y


def split_packed(y: jax.Array, outs: Sequence[tuple[str, tuple[int, ...]]]) -> dict[str, jax.Array]:
    """:func:`packed_product`'s output as ``{name: [..., *out]}``, in ``outs``' order."""
    ends = np.cumsum([int(np.prod(out)) for _, out in outs])
    parts = jnp.split(y[..., :ends[-1]], ends[:-1], -1)  # the padding rows' outputs dropped
    return {name: part.reshape(y.shape[:-1] + out) for (name, out), part in zip(outs, parts)}


def packed_products(module: nn.Module, x: jax.Array | MixedInput, outs: Sequence[tuple[str, tuple[int, ...]]],
                    dtype: Any) -> Mapping[str, jax.Array] | None:
    """:func:`packed_product` split into the projections ``outs``; None where the module holds no packed kernel."""
    y = packed_product(module, x, dtype)
    return None if y is None else split_packed(y, outs)