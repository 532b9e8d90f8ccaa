"""The LatentMoE tail of a decode step on the GPU in one Pallas-Triton kernel (``MoEConfig.
decode_implementation="pallas-fused"``): the routed experts' combine, the latent RMSNorm, ``up_proj`` and
(with shared experts) their down product and the layer's sum.

After the gather kernel (``kernel_gpu_decode.expert_blocks``: each routed expert's output as fp32
partial sums over ``F/block_f`` blocks), XLA compiles the rest of ``W_up RMSNorm(Σ_s w_s E_s(u))`` at
batch 1 to 4 kernels a layer: the epilogue (block sums, each expert's rounding, the weights), the
norm's sum of squares, the normalised latent, and ``up_proj``'s matrix-vector product. Here program
``(t, j)`` recomputes token ``t``'s whole latent (``L`` = 512 wide in ``small()``: the partial sums are
256 KB, read from L2 by every program) and writes block ``j`` of ``block_d`` outputs of ``up_proj``:

1. ``y_s = Σ_blocks parts[t, s]`` in fp32, rounded to ``dtype``; ``y = Σ_s w_s y_s`` in fp32, rounded
   to ``dtype`` (``moe_decode.gathered_experts``' result);
2. ``n = y · rsqrt(Σ y² / L + eps) · scale`` in fp32, rounded to ``dtype`` (``k3jax.layers.norm``);
3. ``out[j-block] = W_up[j-block, :] · n``, products and sum in fp32, rounded to ``dtype`` (``Proj``
   with the decode layout's output-first ``kernel_t`` ``[D, L]``);
4. with the shared experts (``h``, their activation from ``kernel_gpu_decode_head``, and their down
   matrix ``[D, F]`` output axis first): ``+ W_sd[j-block, :] · h`` (fp32, rounded), the sum rounded
   (``MoE``'s ``y + MLP(x)``, in ``dtype``). One kernel then replaces 5 (the shared ``down`` too).

These are the model code's rounding points, which the reference (the XLA code it replaces: the
epilogue of ``kernel_gpu_decode.gathered_experts_pallas``, ``norm.rms_norm``, the ``up_proj`` einsum)
spells. XLA's batch-1 compile departs from them twice (device-less H200 HLO): it keeps ``y`` in fp32
into the norm (excess precision), and its strength-reduced ``up_proj`` rounds each product to bf16
before summing in fp32; the kernel follows the definition (and the forward's GEMM) instead. fp32
summation orders differ too. ``interpret=True`` runs it in the CPU interpreter.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float

from pallas_kernels.triton_blocks import is_block_dim


SHARED_CHUNK = 256  # columns of the shared down matrix per step of its product


@dataclasses.dataclass(frozen=True)
class TailTiles:
    """``block_d``: ``up_proj`` outputs per program (D/block_d programs a token); ``num_warps``."""

    block_d: int = 32  # small(): 32 programs, each 32 KB of W_up and the 256 KB of partial sums
    num_warps: int = 8


def check_inputs(parts, weights, scale, w_up, h=None, w_shared_down=None, tiles: TailTiles = TailTiles()) -> None:
    """Raise ``ValueError`` naming the argument when the kernel cannot take these inputs."""
    if parts.ndim != 4 or weights.shape != parts.shape[:2]:
        raise ValueError(f"parts must be [T, k, NF, L] and weights [T, k], got parts {parts.shape}, "
                         f"weights {weights.shape}")
    T, k, nf, L = parts.shape
    if scale.shape != (L,) or w_up.ndim != 2 or w_up.shape[1] != L:
        raise ValueError(f"scale must be [L] and w_up [D, L] (output axis first) with L = parts.shape[3]={L}, "
                         f"got scale {scale.shape}, w_up {w_up.shape}")
    if not is_block_dim(L) or nf & (nf - 1):
        raise ValueError(f"the tail kernel needs L and NF (parts.shape[2:]) powers of two, L >= 16, got {(nf, L)}")
    D = w_up.shape[0]
    if not is_block_dim(tiles.block_d) or D % tiles.block_d:
        raise ValueError(f"tiles.block_d={tiles.block_d} must be a power of two >= 16 dividing D={D}")
    if (h is None) != (w_shared_down is None):
        raise ValueError("h and w_shared_down must be given together (the shared experts) or both be None")
    chunk = None if h is None else min(h.shape[-1], SHARED_CHUNK)
    if h is not None and (h.ndim != 2 or h.shape[0] != T or w_shared_down.shape != (D, h.shape[1])
                          or not is_block_dim(chunk) or h.shape[1] % chunk):
        raise ValueError(f"h must be [T, F] and w_shared_down [D, F] (output axis first) with T={T}, D={D}, F a power "
                         f"of two >= 16 or a multiple of {SHARED_CHUNK}, got h {h.shape}, w_shared_down "
                         f"{w_shared_down.shape}")
    if any(jnp.dtype(a.dtype) == jnp.float64 for a in (parts, weights, scale, w_up)):
        raise ValueError("the tail kernel takes no float64 input (Triton); use decode_implementation='pallas'")


def _shared_down(h_ref, w_ref):
    """``W_sd[block, :] · h`` in fp32, over F in chunks (a whole ``[block_d, F]`` tile would spill)."""
    f32 = jnp.float32
    F = h_ref.shape[0]
    chunk = min(F, SHARED_CHUNK)

    def step(c, acc):
        cols = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
        return acc + jnp.sum(h_ref[cols].astype(f32)[None, :] * w_ref[:, cols].astype(f32), axis=1)

    return jax.lax.fori_loop(0, F // chunk, step, jnp.zeros((w_ref.shape[0],), f32))


def _kernel(parts_ref, weights_ref, scale_ref, w_ref, *refs, eps: float, dtype):
    f32 = jnp.float32
    out_ref = refs[-1]
    rnd = lambda a: a.astype(dtype).astype(f32)
    k, _, L = parts_ref.shape
    y = jnp.zeros((L,), f32)
    for s in range(k):
        y = y + rnd(jnp.sum(parts_ref[s, :, :], axis=0)) * weights_ref[s]  # [L]
    y = rnd(y)
    inv = jax.lax.rsqrt(jnp.sum(y * y) / L + eps)
    n = rnd(y * inv * scale_ref[...].astype(f32))  # [L]
    out = jnp.sum(n[None, :] * w_ref[...].astype(f32), axis=1)  # [BD]
    if len(refs) == 3:  # the shared experts' down product, added in dtype
        out = rnd(out) + rnd(_shared_down(*refs[:2]))
    out_ref[...] = out.astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "dtype", "tiles", "interpret"))
def decode_tail_pallas(parts: Float[Array, "T k NF L"], weights: Float[Array, "T k"], scale: Float[Array, "L"],
                       w_up: Float[Array, "D L"], h: Float[Array, "T F"] | None = None,
                       w_shared_down: Float[Array, "D F"] | None = None, *, eps: float, dtype,
                       tiles: TailTiles = TailTiles(), interpret: bool = False) -> Float[Array, "T D"]:
    """``W_up RMSNorm(Σ_s weights[t,s] · round(Σ parts[t,s]))`` (``+ W_sd h`` with the shared experts) in
    ``dtype``, rounded as the model code rounds."""
    check_inputs(parts, weights, scale, w_up, h, w_shared_down, tiles)
    T, k, nf, L = parts.shape
    D = w_up.shape[0]
    shared = () if h is None else (h, w_shared_down)
    shared_specs = [] if h is None else [pl.BlockSpec((None, h.shape[1]), lambda t, j: (t, 0)),
                                         pl.BlockSpec((tiles.block_d, h.shape[1]), lambda t, j: (j, 0))]
    return pl.pallas_call(
        functools.partial(_kernel, eps=eps, dtype=jnp.dtype(dtype)),
        grid=(T, D // tiles.block_d),
        in_specs=[pl.BlockSpec((None, k, nf, L), lambda t, j: (t, 0, 0, 0)),
                  pl.BlockSpec((None, k), lambda t, j: (t, 0)),
                  pl.BlockSpec((L,), lambda t, j: (0,)),
                  pl.BlockSpec((tiles.block_d, L), lambda t, j: (j, 0))] + shared_specs,
        out_specs=pl.BlockSpec((None, tiles.block_d), lambda t, j: (t, j)),
        out_shape=jax.ShapeDtypeStruct((T, D), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=interpret, name="moe_decode_tail",
    )(parts, weights.astype(jnp.float32), scale, w_up, *shared)


__all__ = ["TailTiles", "check_inputs", "decode_tail_pallas"]
