"""Public MoE ops: ``grouped_matmul`` (``jax.lax.ragged_dot`` semantics) and ``moe_ffn``.

``implementation``: ``None`` picks the Pallas kernel where one exists for the target the code is
compiled for (Hopper GPU, TPU; :func:`pallas_kernels.target.current_target`: the mesh in context,
else the default device), the tile loop of :mod:`pallas_kernels.moe.tiled` on CPU (whose XLA
backend expands ``ragged_dot`` to every group) and ``ragged_dot`` elsewhere; ``"xla"`` is always
sort + ``ragged_dot`` (the reference); ``"pallas"``
needs a GPU/TPU, or ``interpret=True`` on CPU (``kernel_backend`` then names which kernel the
interpreter runs, "gpu" or "tpu"). Pallas gradients are wired through ``jax.custom_vjp``:
``dlhs`` is the grouped product with each expert's transposed weight and ``drhs[e]`` the
product of group ``e``'s rows, ``lhs_eᵀ · dout_e`` (zero for empty groups).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int

from pallas_kernels.moe import validate
from pallas_kernels.moe.activations import packed_gated_activation, split_gated_activation
from pallas_kernels.moe.dispatch import combine, permute
from pallas_kernels.moe.reference import grouped_matmul_ragged
from pallas_kernels.moe.tiled import grouped_matmul_tiled
from pallas_kernels.target import current_target


# Mosaic TPU has no float16 vector loads (libtpu 0.0.48, v4 to TPU7x), so the TPU kernel takes bf16 only.
_KERNEL_DTYPES = {"gpu": (jnp.bfloat16, jnp.float16), "tpu": (jnp.bfloat16,)}


def _hopper_gpu() -> bool:
    return current_target().hopper


def resolve_implementation(implementation, interpret: bool, kernel_backend: str | None, dtype=jnp.bfloat16) -> str:
    """Return "xla", "tiled", "gpu" or "tpu": which code path runs (the GPU kernels take bf16/f16,
    the TPU kernel bf16)."""
    if implementation not in (None, "xla", "pallas"):
        raise ValueError(f"implementation must be None, 'xla' or 'pallas', got {implementation!r}")
    if kernel_backend not in (None, "gpu", "tpu"):
        raise ValueError(f"kernel_backend must be None, 'gpu' or 'tpu', got {kernel_backend!r}")
    if implementation == "xla":
        return "xla"
    platform = current_target().platform
    fallback = "tiled" if platform == "cpu" else "xla"
    if interpret:
        path = kernel_backend or ("tpu" if platform == "tpu" else "gpu")
    elif platform == "tpu" or (platform == "gpu" and _hopper_gpu()):
        path = platform
    elif implementation == "pallas":
        raise ValueError(
            f"implementation='pallas' needs a Hopper GPU or a TPU, or interpret=True; compiling for {platform!r}"
        )
    else:
        return fallback
    if jnp.dtype(dtype) not in _KERNEL_DTYPES[path]:
        if implementation == "pallas":
            names = " or ".join(jnp.dtype(d).name for d in _KERNEL_DTYPES[path])
            raise ValueError(f"implementation='pallas': the {path} kernel needs {names} inputs, got {jnp.dtype(dtype)}")
        return fallback
    return path


def _kernel_module(path: str):
    """Imported lazily so CPU-only installs never load Mosaic."""
    if path == "gpu":
        from pallas_kernels.moe import kernel_gpu as k
    else:
        from pallas_kernels.moe import kernel_tpu as k
    return k


def _pad_to(x, axis: int, multiple: int):
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def _kernels(path: str, interpret: bool, tgmm_tiling=None):
    """(gmm, tgmm) of one backend, zero-padding K and N to the kernels' tile multiple."""
    k = _kernel_module(path)
    mult = k.required_multiple()
    if tgmm_tiling is not None and path == "gpu":  # K and N are tgmm's output tile dims
        mult = math.lcm(mult, tgmm_tiling.tile_k, tgmm_tiling.cta_n())

    def gmm(lhs, rhs, group_sizes, transpose_rhs=False):
        n_out = rhs.shape[1] if transpose_rhs else rhs.shape[2]
        lhs_p = _pad_to(lhs, 1, mult)
        rhs_p = _pad_to(_pad_to(rhs, 1, mult), 2, mult)
        out = k.gmm(lhs_p, rhs_p, group_sizes, transpose_rhs=transpose_rhs, interpret=interpret)
        return out[:, :n_out]

    def tgmm(lhs, dout, group_sizes, num_groups):
        kk, n = lhs.shape[1], dout.shape[1]
        out = k.tgmm(
            _pad_to(lhs, 1, mult), _pad_to(dout, 1, mult), group_sizes, num_groups=num_groups,
            tiling=tgmm_tiling, interpret=interpret,
        )
        return out[:, :kk, :n]

    return gmm, tgmm


def _gmm_sum_kernel(path: str, interpret: bool):
    """``Σ_p lhss[p] · rhss[p]ᵀ`` per group (the backend's ``gmm_sum`` with ``transpose_rhs``),
    zero-padding each pair's K and the shared N to the kernels' tile multiple."""
    k = _kernel_module(path)
    mult = k.required_multiple()

    def gmm_sum(lhss, rhss, group_sizes):
        n_out = rhss[0].shape[1]
        lhss = [_pad_to(x, 1, mult) for x in lhss]
        rhss = [_pad_to(_pad_to(w, 1, mult), 2, mult) for w in rhss]
        return k.gmm_sum(lhss, rhss, group_sizes, transpose_rhs=True, interpret=interpret)[:, :n_out]

    return gmm_sum


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gmm_pallas(lhs, rhs, group_sizes, path, interpret, tgmm_tiling):
    gmm, _ = _kernels(path, interpret, tgmm_tiling)
    return gmm(lhs, rhs, group_sizes)


def _gmm_pallas_fwd(lhs, rhs, group_sizes, path, interpret, tgmm_tiling):
    return _gmm_pallas(lhs, rhs, group_sizes, path, interpret, tgmm_tiling), (lhs, rhs, group_sizes)


def _gmm_pallas_bwd(path, interpret, tgmm_tiling, res, g):
    lhs, rhs, group_sizes = res
    gmm, tgmm = _kernels(path, interpret, tgmm_tiling)
    g = g.astype(lhs.dtype)
    dlhs = gmm(g, rhs, group_sizes, transpose_rhs=True)  # [M, K]
    drhs = tgmm(lhs, g, group_sizes, rhs.shape[0])  # [E, K, N]
    return dlhs, drhs.astype(rhs.dtype), None


_gmm_pallas.defvjp(_gmm_pallas_fwd, _gmm_pallas_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _gate_up_pallas(lhs, w1, w3, group_sizes, path, interpret, tgmm_tiling):
    """``(lhs·W1, lhs·W3)`` per group as two products: no ``[W1 | W3]`` copy in the forward. The
    backward is the packed product's, value for value, with no ``[dg | du]`` or ``[W1 | W3]`` copy
    either: ``dlhs = dg·W1ᵀ + du·W3ᵀ`` in one float32 accumulator over F, then F (``gmm_sum``: the
    K steps of the packed product over 2F, in its order; the TPU kernel still concatenates),
    ``dW1``, ``dW3`` one ``tgmm`` each (each element's sum over its group's rows as the packed
    ``tgmm`` makes it), so no ``[E, L, 2F]`` gradient is split."""
    gmm, _ = _kernels(path, interpret, tgmm_tiling)
    return gmm(lhs, w1, group_sizes), gmm(lhs, w3, group_sizes)


def _gate_up_pallas_fwd(lhs, w1, w3, group_sizes, path, interpret, tgmm_tiling):
    return _gate_up_pallas(lhs, w1, w3, group_sizes, path, interpret, tgmm_tiling), (lhs, w1, w3, group_sizes)


def _gate_up_pallas_bwd(path, interpret, tgmm_tiling, res, cts):
    lhs, w1, w3, group_sizes = res
    _, tgmm = _kernels(path, interpret, tgmm_tiling)
    dg, du = (c.astype(lhs.dtype) for c in cts)
    dlhs = _gmm_sum_kernel(path, interpret)([dg, du], [w1, w3], group_sizes)  # [T·k, L]
    dw1 = tgmm(lhs, dg, group_sizes, w1.shape[0])
    dw3 = tgmm(lhs, du, group_sizes, w3.shape[0])
    return dlhs, dw1.astype(w1.dtype), dw3.astype(w3.dtype), None


_gate_up_pallas.defvjp(_gate_up_pallas_fwd, _gate_up_pallas_bwd)


def grouped_matmul(
    lhs: Float[Array, "M K"],
    rhs: Float[Array, "E K N"],
    group_sizes: Int[ArrayLike, "E"],
    *,
    implementation: str | None = None,
    interpret: bool = False,
    kernel_backend: str | None = None,
    checked: bool = False,
    tgmm_tiling=None,
) -> Float[Array, "M N"]:
    """Rows ``[start_e, start_e + group_sizes[e])`` of ``lhs`` times ``rhs[e]``; rows past
    ``sum(group_sizes)`` are zero. Accumulates in >= float32; output in ``lhs.dtype``.

    ``checked=True`` adds ``checkify`` checks of traced group sizes (>= 0, sum <= M).
    ``tgmm_tiling``: the Pallas kernel's tiling of the weight gradient (``tgmm``; a
    ``kernel_gpu.GpuTiling`` / ``kernel_tpu`` tiling), None for the kernel's default.
    """
    validate.check_grouped_matmul_args(lhs, rhs, group_sizes, checked=checked)
    group_sizes = jnp.asarray(group_sizes, jnp.int32)
    path = resolve_implementation(implementation, interpret, kernel_backend, lhs.dtype)
    if path == "xla":
        return grouped_matmul_ragged(lhs, rhs, group_sizes)
    if path == "tiled":
        return grouped_matmul_tiled(lhs, rhs, group_sizes)
    return _gmm_pallas(lhs, rhs, group_sizes, path, interpret, tgmm_tiling)


def gate_up_matmul(
    lhs: Float[Array, "M L"],
    w1: Float[Array, "E L F"],
    w3: Float[Array, "E L F"],
    group_sizes: Int[ArrayLike, "E"],
    *,
    implementation: str | None = None,
    interpret: bool = False,
    kernel_backend: str | None = None,
) -> tuple[Float[Array, "M F"], Float[Array, "M F"]]:
    """``(grouped_matmul(lhs, w1), grouped_matmul(lhs, w3))``. On the Hopper GPU kernel the backward's
    input gradient is one ``dg·W1ᵀ + du·W3ᵀ`` (``_gate_up_pallas``: one float32 accumulator, no
    ``[dg | du]`` or ``[W1 | W3]`` copy; the packed product's values) instead of two products rounded
    apart and added by XLA. Elsewhere the two grouped matmuls as they are: the TPU ``gmm_sum``
    would copy both operands into their concatenation."""
    if w3.shape != w1.shape:
        raise ValueError(f"w3.shape must equal w1.shape={w1.shape}, got {w3.shape}")
    validate.check_grouped_matmul_args(lhs, w1, group_sizes)
    path = resolve_implementation(implementation, interpret, kernel_backend, lhs.dtype)
    if path == "gpu":
        return _gate_up_pallas(lhs, w1, w3, jnp.asarray(group_sizes, jnp.int32), path, interpret, None)
    gmm = functools.partial(grouped_matmul, implementation=implementation, interpret=interpret,
                            kernel_backend=kernel_backend)
    return gmm(lhs, w1, group_sizes), gmm(lhs, w3, group_sizes)


def moe_ffn(
    x: Float[Array, "T L"],
    topk_ids: Int[Array, "T k"],
    topk_weights: Float[Array, "T k"],
    w1: Float[Array, "E L F"],
    w3: Float[Array, "E L F"],
    w2: Float[Array, "E F L"],
    *,
    activation: str = "situ",
    situ_beta: float = 4.0,
    situ_linear_beta: float = 25.0,
    implementation: str | None = None,
    interpret: bool = False,
    kernel_backend: str | None = None,
    checked: bool = False,
    gate_up: str = "packed",
) -> Float[Array, "T L"]:
    """Routed expert FFN of SPEC §4: ``Σ_s w_ts · W2_e act(W1_e x_t, W3_e x_t)``, ``e = ids_ts``.

    Steps: 1. permute the T·k assignments into expert order; 2. gate and up as one grouped
    matmul with ``[W1 | W3]``; 3. activation in >= float32 (SiTU-GLU or SwiGLU), cast to
    ``x.dtype``; 4. down grouped matmul; 5. router-weighted combine summed in float32. Output in
    ``x.dtype``; float64 inputs stay float64 throughout.

    ``gate_up``: "packed" concatenates ``[W1 | W3]`` (a copy of both stacks each call, free when it
    fuses into a cast of wider stored weights) and splits the weight gradient; "split" (Pallas
    paths) runs the two products apart and its backward's input gradient as one
    ``gmm_sum`` of ``(dg, W1)`` and ``(du, W3)``: no stack or ``[dg | du]`` copy forward or backward
    on the GPU (the TPU ``gmm_sum`` still concatenates). Same values either way
    (``tests/pallas_kernels/moe/test_gate_up.py``, ``test_gmm_sum.py``).
    """
    if gate_up not in ("packed", "split"):
        raise ValueError(f"gate_up must be 'packed' or 'split', got {gate_up!r}")
    validate.check_moe_ffn_args(x, topk_ids, topk_weights, w1, w3, w2, activation, checked=checked)
    gmm = functools.partial(
        grouped_matmul, implementation=implementation, interpret=interpret, kernel_backend=kernel_backend
    )
    with jax.named_scope("moe_permute"):
        xs, group_sizes, inverse = permute(x, topk_ids, w1.shape[0])  # [T·k, L]
    with jax.named_scope("moe_experts"):
        # packed: gate and up as one product of width 2F, one kernel each way; split: two forward
        # products; either way the backward's two input gradients come out of one dlhs product
        path = resolve_implementation(implementation, interpret, kernel_backend, xs.dtype)
        if gate_up == "split" and path in ("gpu", "tpu"):
            g, u = _gate_up_pallas(xs, w1, w3, jnp.asarray(group_sizes, jnp.int32), path, interpret, None)
            a = split_gated_activation(g, u, activation, situ_beta, situ_linear_beta, x.dtype)
        else:
            gu = gmm(xs, jnp.concatenate([w1, w3], axis=2), group_sizes)  # [T·k, 2F]
            a = packed_gated_activation(gu, activation, situ_beta, situ_linear_beta, x.dtype)
        y = gmm(a, w2, group_sizes)  # [T·k, L]
    with jax.named_scope("moe_combine"):
        return combine(y, inverse, topk_weights)
