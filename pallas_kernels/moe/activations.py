"""Gated activations of the Kimi K3 MLPs (SPEC §4): the jnp forms every MLP shares, and the ops that
run them as a Pallas-Triton pass on CUDA GPUs (:mod:`pallas_kernels.moe.activation_gpu`, whose
reference these jnp forms are).

SiTU-GLU is the K3 activation (K3 technical report, "Kimi K3: Open Frontier Intelligence"):
``act(g, u) = [β1·tanh(g/β1)·σ(g)] · [β2·tanh(u/β2)]``, bounded by β1·β2 = 100 and equal to
SwiGLU ``silu(g)·u`` to first order near zero. Both run in at least float32 (SPEC §10): the
result has dtype ``promote_types(input, float32)`` (float64 stays float64) and the caller casts
it back to the matmul dtype.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from pallas_kernels.target import current_target

_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
IMPLEMENTATIONS = (None, "xla", "pallas")
# The default takes the pass from this many elements up. Below it the pass saves a few microseconds of
# arithmetic at most and costs a launch and XLA's fusion of the activation with the slices and casts
# around it: device-less, small()'s decode step at batch 64 ran 477 kernels with the pass against 441
# without (benchmarks/decode_kernels.py, stop 46). The shapes it was timed to win at on the H200 hold
# 50 M elements and more (RESULTS.md, stop 45); every training shape of small() and K3 is above this.
MIN_ELEMENTS = 1 << 23


def kernel_tiles(rows: int, cols: int, dtype, implementation: str | None = None, interpret: bool = False):
    """The tiles of the Pallas-Triton pass (:mod:`pallas_kernels.moe.activation_gpu`) over ``[rows,
    cols]`` operands of ``dtype`` when it runs, else None (the jnp forms here run).

    ``implementation``: None takes the pass when compiling for a CUDA GPU outside a mesh that XLA
    partitions (it would replicate a custom call's operands; inside ``shard_map`` every axis is
    manual) for shapes it tiles of at least ``MIN_ELEMENTS``; ``"xla"`` never; ``"pallas"`` always
    (any size), or raises ``ValueError`` (it needs a CUDA GPU or ``interpret=True``, a float dtype of
    at most 32 bits and a shape that tiles).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "xla":
        return None
    from pallas_kernels.moe.activation_gpu import tiles_for

    tiles, fits_dtype = tiles_for(rows, cols), jnp.dtype(dtype) in _KERNEL_DTYPES
    if implementation == "pallas":
        if not (interpret or current_target().cuda):
            raise ValueError("implementation='pallas' needs a CUDA GPU (or interpret=True); "
                             f"compiling for {current_target().platform!r}")
        if not fits_dtype or tiles is None:
            raise ValueError(f"implementation='pallas' needs bfloat16, float16 or float32 [rows, F] operands whose "
                             f"F has a power-of-two factor >= 128 dividing the rows' tiles, got {jnp.dtype(dtype)} "
                             f"[{rows}, {cols}]")
        return tiles
    mesh = jax.sharding.get_abstract_mesh()
    if not current_target().cuda or not fits_dtype or (not mesh.empty and not mesh.are_all_axes_manual):
        return None
    if rows * cols < MIN_ELEMENTS:
        return None
    return tiles


def _compute_dtype(*xs) -> jnp.dtype:
    return jnp.promote_types(jnp.result_type(*xs), jnp.float32)


def situ_glu(
    g: Float[Array, "*B F"],
    u: Float[Array, "*B F"],
    beta1: float = 4.0,
    beta2: float = 25.0,
) -> Float[Array, "*B F"]:
    """SiTU-GLU of gate ``g`` and up ``u`` (SPEC §4), computed in >= float32."""
    if g.shape != u.shape:
        raise ValueError(f"u.shape must equal g.shape={g.shape}, got {u.shape}")
    if beta1 <= 0 or beta2 <= 0:
        raise ValueError(f"beta1, beta2 must be > 0, got {beta1=}, {beta2=}")
    dt = _compute_dtype(g, u)
    g = g.astype(dt)
    u = u.astype(dt)
    gate = beta1 * jnp.tanh(g / beta1) * jax.nn.sigmoid(g)
    return gate * (beta2 * jnp.tanh(u / beta2))


def swiglu(g: Float[Array, "*B F"], u: Float[Array, "*B F"]) -> Float[Array, "*B F"]:
    """SwiGLU ``silu(g)·u`` (Shazeer 2020, "GLU Variants Improve Transformer"), in >= float32."""
    if g.shape != u.shape:
        raise ValueError(f"u.shape must equal g.shape={g.shape}, got {u.shape}")
    dt = _compute_dtype(g, u)
    return jax.nn.silu(g.astype(dt)) * u.astype(dt)


def _activation_fn(activation: str, situ_beta: float, situ_linear_beta: float):
    if activation == "situ":
        return functools.partial(situ_glu, beta1=situ_beta, beta2=situ_linear_beta)
    if activation == "swiglu":
        return swiglu
    raise ValueError(f"activation must be 'situ' or 'swiglu', got {activation!r}")


def gated_activation(
    g: Float[Array, "*B F"],
    u: Float[Array, "*B F"],
    activation: str,
    situ_beta: float = 4.0,
    situ_linear_beta: float = 25.0,
) -> Float[Array, "*B F"]:
    """Dispatch on the activation name used by ``moe_ffn`` ("situ" | "swiglu")."""
    return _activation_fn(activation, situ_beta, situ_linear_beta)(g, u)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5, 6))
def packed_gated_activation(
    gu: Float[Array, "*B F2"],
    activation: str,
    situ_beta: float = 4.0,
    situ_linear_beta: float = 25.0,
    out_dtype=None,
    implementation: str | None = None,
    interpret: bool = False,
) -> Float[Array, "*B F"]:
    """``gated_activation(g, u)`` of the packed product ``gu = [g | u]`` (last axis 2F), cast to
    ``out_dtype`` (default ``gu.dtype``); ``implementation`` / ``interpret`` as :func:`kernel_tiles`
    (on a CUDA GPU the forward, with its stored derivatives, is the Pallas-Triton pass).

    The forward pass also stores the activation's two partial derivatives ``∂a/∂g`` and ``∂a/∂u``
    (computed in >= float32, stored in ``gu.dtype``), and the backward is one concatenate
    ``[da·∂a/∂g | da·∂a/∂u]`` in ``gu.dtype``. Left to itself XLA shares the backward's
    recomputation with the forward and has the forward write those terms in float32 (twice the
    bytes; 0.46 + 0.49 ms per ``small()`` MoE layer on the H200, against 0.54 + 0.31 ms this way);
    autodiff of two slices of ``gu`` adds two zero-padded half-gradients, and ``jnp.split``
    materialises both halves. In bf16 the stored derivatives add one rounding (2⁻⁹ relative) before
    the gradient's own bf16 rounding. (Recomputing them in the backward from ``gu``, as
    ``split_gated_activation`` does, made XLA write the backward's ``tanh`` terms to float32 buffers
    of their own ahead of the concatenate: small()'s micro-batch glue 202.5 → 220.8 GB device-less,
    stop 40; the split products have no concatenate and gain.)
    """
    F, out_dtype = gu.shape[-1] // 2, gu.dtype if out_dtype is None else out_dtype
    rows = math.prod(gu.shape[:-1])
    if kernel_tiles(rows, F, gu.dtype, implementation, interpret) is not None:
        from pallas_kernels.moe.activation_gpu import activation_forward

        flat = gu.reshape(rows, 2 * F)
        a = activation_forward(flat, flat, activation=activation, beta1=situ_beta, beta2=situ_linear_beta,
                               out_dtype=out_dtype, cols=F, interpret=interpret)
        return a.reshape(gu.shape[:-1] + (F,))
    a = gated_activation(gu[..., :F], gu[..., F:], activation, situ_beta, situ_linear_beta)
    return a.astype(out_dtype)


def _value_and_partials(g, u, activation, situ_beta, situ_linear_beta):
    """``(a, ∂a/∂g, ∂a/∂u)`` of the activation in >= float32."""
    fn = _activation_fn(activation, situ_beta, situ_linear_beta)
    one, zero = jnp.ones_like(g), jnp.zeros_like(g)
    a, d_g = jax.jvp(fn, (g, u), (one, zero))  # elementwise: the tangent is ∂a/∂g itself
    return a, d_g, jax.jvp(fn, (g, u), (zero, one))[1]


def _with_derivatives(g, u, activation, situ_beta, situ_linear_beta, out_dtype, stored_dtype):
    """The activation cast to ``out_dtype`` and its partial derivatives stored in ``stored_dtype``."""
    a, d_g, d_u = _value_and_partials(g, u, activation, situ_beta, situ_linear_beta)
    # the barrier keeps the stored dtype: XLA (excess precision allowed) would fold the cast pair
    return a.astype(out_dtype), jax.lax.optimization_barrier((d_g.astype(stored_dtype), d_u.astype(stored_dtype)))


def _packed_fwd(gu, activation, situ_beta, situ_linear_beta, out_dtype, implementation, interpret):
    F = gu.shape[-1] // 2
    rows = math.prod(gu.shape[:-1])
    out_dtype = gu.dtype if out_dtype is None else out_dtype
    if kernel_tiles(rows, F, gu.dtype, implementation, interpret) is not None:
        from pallas_kernels.moe.activation_gpu import activation_with_partials

        a, d_g, d_u = activation_with_partials(gu.reshape(rows, 2 * F), activation=activation, beta1=situ_beta,
                                               beta2=situ_linear_beta, out_dtype=out_dtype, interpret=interpret)
        shape = gu.shape[:-1] + (F,)
        return a.reshape(shape), (d_g.reshape(shape), d_u.reshape(shape))
    return _with_derivatives(gu[..., :F], gu[..., F:], activation, situ_beta, situ_linear_beta, out_dtype, gu.dtype)


def _packed_bwd(activation, situ_beta, situ_linear_beta, out_dtype, implementation, interpret, res, da):
    d_g, d_u = res
    wide = jnp.promote_types(d_g.dtype, jnp.float32)
    da = da.astype(wide)
    return (jnp.concatenate([da * d_g.astype(wide), da * d_u.astype(wide)], axis=-1).astype(d_g.dtype),)


packed_gated_activation.defvjp(_packed_fwd, _packed_bwd)


def _derivatives(g, u, activation, situ_beta, situ_linear_beta, da):
    """``(da·∂a/∂g, da·∂a/∂u)`` in >= float32, recomputed from the saved ``g``, ``u``. Callers pass
    them through an ``optimization_barrier`` first (XLA would otherwise share the recomputation with
    the forward and keep its float32 terms), and only arrays already in memory (a barrier on slices
    makes XLA copy them out)."""
    _, d_g, d_u = _value_and_partials(g, u, activation, situ_beta, situ_linear_beta)
    da = da.astype(d_g.dtype)
    return da * d_g, da * d_u


def split_gated_activation(
    g: Float[Array, "*B F"],
    u: Float[Array, "..."],  # g's shape: checked below, with the ValueError the other activations raise
    activation: str,
    situ_beta: float = 4.0,
    situ_linear_beta: float = 25.0,
    out_dtype=None,
    implementation: str | None = None,
    interpret: bool = False,
) -> Float[Array, "*B F"]:
    """``gated_activation(g, u)`` cast to ``out_dtype`` (default ``g.dtype``) for a gate and an up
    product made apart (the dense and shared MLPs, the routed experts' split products). The backward
    keeps ``g`` and ``u`` (the products, already in memory) and recomputes ``∂a/∂g``, ``∂a/∂u`` in
    >= float32 (behind an ``optimization_barrier`` in jnp); on a CUDA GPU both directions are the
    Pallas-Triton pass (``implementation`` / ``interpret`` as :func:`kernel_tiles`). Autodiff kept
    seven float32 ``[T, F]`` terms instead (1.3 GiB per K3 shared-expert MLP at 8 K tokens,
    ``benchmarks/bench_layer.py --residuals``). Until stop 40 the forward wrote the two derivatives
    in ``g.dtype`` as residuals (as ``packed_gated_activation`` still does): 1.6 GB more glue per K3
    routed-expert layer at 8 K tokens device-less (``layer_glue.py``) for the same residual bytes,
    and one more bf16 rounding of the gradient.

    Computed on ``[rows, F]`` views: on the ``[B, T, F]`` outputs of ``[B·T, D]`` GEMMs XLA (H200
    compile) wrote both ``tanh`` terms to fp32 ``[B·T, F]`` buffers in fusions of their own and read
    them back (1.41 against 0.50 GB per K3 shared-expert forward); same values."""
    if g.shape != u.shape:
        raise ValueError(f"u.shape must equal g.shape={g.shape}, got {u.shape}")
    if g.dtype != u.dtype and implementation == "pallas":
        raise ValueError(f"implementation='pallas' needs g and u of one dtype, got {g.dtype} and {u.dtype}")
    rows = lambda x: x.reshape(-1, x.shape[-1])
    return _split_gated_rows(rows(g), rows(u), activation, situ_beta, situ_linear_beta, out_dtype, implementation,
                             interpret).reshape(g.shape)


def _split_pass(g, u, implementation, interpret) -> bool:
    """Whether the Pallas-Triton pass runs ``[rows, F]`` views ``g``, ``u``."""
    return g.dtype == u.dtype and kernel_tiles(*g.shape, g.dtype, implementation, interpret) is not None


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7))
def _split_gated_rows(g, u, activation, situ_beta, situ_linear_beta, out_dtype, implementation, interpret):
    out_dtype = g.dtype if out_dtype is None else out_dtype
    if _split_pass(g, u, implementation, interpret):
        from pallas_kernels.moe.activation_gpu import activation_forward

        return activation_forward(g, u, activation=activation, beta1=situ_beta, beta2=situ_linear_beta,
                                  out_dtype=out_dtype, interpret=interpret)
    return gated_activation(g, u, activation, situ_beta, situ_linear_beta).astype(out_dtype)


def _split_fwd(g, u, activation, situ_beta, situ_linear_beta, out_dtype, implementation, interpret):
    if g.shape != u.shape:
        raise ValueError(f"u.shape must equal g.shape={g.shape}, got {u.shape}")
    args = (activation, situ_beta, situ_linear_beta, out_dtype, implementation, interpret)
    return _split_gated_rows(g, u, *args), (g, u)


def _split_bwd(activation, situ_beta, situ_linear_beta, out_dtype, implementation, interpret, res, da):
    g, u = res
    if _split_pass(g, u, implementation, interpret):
        from pallas_kernels.moe.activation_gpu import activation_backward

        return tuple(activation_backward(g, u, da, activation=activation, beta1=situ_beta, beta2=situ_linear_beta,
                                         interpret=interpret))
    g, u = jax.lax.optimization_barrier(res)
    dg, du = _derivatives(g, u, activation, situ_beta, situ_linear_beta, da)
    return dg.astype(g.dtype), du.astype(u.dtype)


_split_gated_rows.defvjp(_split_fwd, _split_bwd)
