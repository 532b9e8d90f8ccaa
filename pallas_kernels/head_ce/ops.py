"""Public ops: one chunk's output-head logits and their logsumexp, ``chunk_logits_lse``, or instead of
the logits their exponentials shifted by a per-row value, ``chunk_exponentials_lse``.

``implementation``: ``"xla"`` is the reference (one matmul, then XLA's logsumexp: a max pass and a
Σ exp pass over the stored logits); ``"pallas"`` the Mosaic GPU kernel of :mod:`kernel_gpu`, whose
matmul epilogue emits per-tile partials that a small XLA op combines (no pass over the logits);
it needs a Hopper GPU (or ``interpret=True``), bf16/f16 features and shapes the tiling divides;
``None`` takes the kernel where it can run, else XLA. Not differentiable: ``k3jax.train.loss``
forms the gradients itself (from the shifted exponentials, or ``softmax − onehot``), so no VJP
is wired here.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.head_ce import reference
from pallas_kernels.target import current_target

IMPLEMENTATIONS = (None, "xla", "pallas")
_KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)


def _kernel():
    """Imported lazily so CPU-only installs never load Mosaic."""
    from pallas_kernels.head_ce import kernel_gpu

    return kernel_gpu


def resolve_implementation(implementation, interpret: bool, dtype, d: int, v: int, tiling=None) -> str:
    """"xla" or "pallas": which path computes a chunk of ``[·, d] @ [d, v]`` in ``dtype``."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "xla":
        return "xla"
    why = None
    if not (interpret or current_target().hopper):
        why = f"needs a Hopper GPU or interpret=True; compiling for {current_target().device_kind!r}"
    elif jnp.dtype(dtype) not in _KERNEL_DTYPES:
        why = f"needs bfloat16 or float16 features, got {jnp.dtype(dtype)}"
    else:
        tiling = tiling or _kernel().HEAD_TILING
        why = _kernel().check_shapes(tiling.tile_m, d, v, tiling)
    if why and implementation == "pallas":
        raise ValueError(f"implementation='pallas': the head logits kernel {why}")
    return "xla" if why else "pallas"


def chunk_logits_lse(f: Float[Array, "C D"], w: Float[Array, "D V"], logits_dtype=None, *,
                     implementation: str | None = None, interpret: bool = False, tiling=None):
    """(``f @ w`` in ``logits_dtype`` (None: fp32), logsumexp over V of the stored logits in fp32 ``[C]``).

    ``w`` is cast to ``f``'s dtype; the matmul accumulates in fp32 either way. ``tiling``: the
    kernel's ``GpuTiling`` (None: ``kernel_gpu.HEAD_TILING``, read at trace time).
    """
    (c, d), v = f.shape, w.shape[1]
    if implementation == "xla" or resolve_implementation(implementation, interpret, f.dtype, d, v, tiling) == "xla":
        return reference.chunk_logits_lse(f, w, logits_dtype)
    k = _kernel()
    tiling = tiling or k.HEAD_TILING
    pad = -c % tiling.tile_m
    fp = jnp.pad(f, ((0, pad), (0, 0))) if pad else f
    logits, pmax, psum = k.logits_partials(fp, w.astype(f.dtype), logits_dtype=jnp.dtype(logits_dtype or jnp.float32),
                                           tiling=tiling, interpret=interpret)
    lse = reference.combine_partials(pmax, psum)
    return (logits[:c], lse[:c]) if pad else (logits, lse)


def chunk_exponentials_lse(f: Float[Array, "C D"], w: Float[Array, "D V"], shift: Float[Array, "C"],
                           labels: Int[Array, "C"], logits_dtype=None, *, implementation: str | None = None,
                           interpret: bool = False, tiling=None):
    """(``reference.shifted_exponentials`` of the logits ``f @ w`` in ``f``'s dtype, their logsumexp
    ``[C]`` and row max ``[C]`` in fp32). The logits are rounded to ``logits_dtype`` (None: fp32)
    first, as ``chunk_logits_lse`` stores them; the kernel never stores them. Where a row's max
    exceeds its shift by more than ``reference.CLAMP`` the kernel's exponentials differ from the
    reference's (both are capped, per vocabulary tile in the kernel): callers check the row max."""
    (c, d), v = f.shape, w.shape[1]
    wide = reference.wide(f.dtype)
    shift, labels = shift.astype(wide), labels.astype(jnp.int32)
    if implementation == "xla" or resolve_implementation(implementation, interpret, f.dtype, d, v, tiling) == "xla":
        x = reference.chunk_logits(f, w, logits_dtype).astype(wide)
        exps = reference.shifted_exponentials(x, shift, labels, f.dtype)
        return exps, jax.nn.logsumexp(x, axis=-1), jnp.max(x, axis=-1)
    k = _kernel()
    tiling = tiling or k.HEAD_TILING
    pad = -c % tiling.tile_m
    if pad:  # padded rows: shift +inf, all zeros
        f, shift, labels = jnp.pad(f, ((0, pad), (0, 0))), jnp.pad(shift, (0, pad), constant_values=jnp.inf), \
            jnp.pad(labels, (0, pad))
    exps, pmax, psum = k.logits_partials(f, w.astype(f.dtype), shift, labels,
                                         logits_dtype=jnp.dtype(logits_dtype or jnp.float32), tiling=tiling,
                                         interpret=interpret)
    lse, top = reference.combine_partials(pmax, psum), jnp.max(pmax, axis=0)
    return (exps[:c], lse[:c], top[:c]) if pad else (exps, lse, top)


__all__ = ["IMPLEMENTATIONS", "chunk_exponentials_lse", "chunk_logits_lse", "resolve_implementation"]
