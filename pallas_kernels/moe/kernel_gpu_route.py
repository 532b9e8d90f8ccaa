"""The router of a decode step on the GPU in one Pallas-Triton kernel (``MoEConfig.decode_implementation=
"pallas-fused"``).

At batch 1 XLA compiles ``k3jax.layers.moe.MoE._router`` (``route`` without statistics) to 5 kernels a
layer: the fp32 matrix-vector product with the sigmoid, the bias add, the TopK custom call, the sum of
the chosen weights and the ``[:, :k]`` slice of the sorted ids. Here program ``t`` routes token ``t``:

1. ``s = sigmoid(x_t W_r)`` in fp32 (x cast to fp32, the product summed over D in ``block_d`` rows);
2. top-k of ``s + b`` by k rounds of argmax over the E experts, the lowest index first among equal
   values, as ``jax.lax.top_k`` orders them (an expert once chosen is masked by a flag, so a ``-inf``
   bias is never chosen twice);
3. the chosen unbiased scores, ``÷ (Σ + 1e-20)`` when ``renormalize``, × ``scaling``.

The reference is the XLA code it replaces (``k3jax.layers.moe.route`` on ``jax.nn.sigmoid`` of the
router product), which the tests compare it with. Only fp32 summation orders differ (the product
over D, the sum of the k weights), so ids agree unless two biased scores are within an fp32 rounding
of each other. ``interpret=True`` runs it in the CPU interpreter.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels.triton_blocks import is_block_dim

RENORM_EPS = 1e-20  # k3jax.layers.moe.RENORM_EPS (not imported: the layers import the kernels)


@dataclasses.dataclass(frozen=True)
class RouteTiles:
    """``block_d``: rows of the router matrix per step of the product; ``num_warps``: Triton warps."""

    block_d: int = 128  # min(block_d, D) when route_pallas picks the tiles
    num_warps: int = 4


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def check_inputs(x, w, bias, top_k: int, tiles: RouteTiles = RouteTiles()) -> None:
    """Raise ``ValueError`` naming the argument when the kernel cannot take these inputs."""
    if x.ndim != 2 or w.ndim != 2 or w.shape[0] != x.shape[1] or bias.shape != (w.shape[1],):
        raise ValueError(f"x must be [T, D], w [D, E] and bias [E], got x {x.shape}, w {w.shape}, bias {bias.shape}")
    D, E = w.shape
    if not is_block_dim(E):
        raise ValueError(f"the route kernel needs E (w.shape[1]) a power of two >= 16, got {E}")
    if not _power_of_two(top_k) or top_k >= E:
        raise ValueError(f"top_k={top_k} must be a power of two below E={E} for the route kernel")
    if not _power_of_two(tiles.block_d) or D % tiles.block_d:
        raise ValueError(f"tiles.block_d={tiles.block_d} must be a power of two dividing D={D}")
    if any(jnp.dtype(a.dtype) == jnp.float64 for a in (x, w, bias)):
        raise ValueError("the route kernel takes no float64 input (Triton); use decode_implementation='pallas'")


def route_token(x_ref, w_ref, b_ref, *, top_k: int, block_d: int, renormalize: bool, scaling: float):
    """One token's ``(ids [k] int32, weights [k] fp32)`` from its row ``x_ref [D]`` (steps 1-3 above)."""
    f32 = jnp.float32
    D, E = w_ref.shape

    def product(c, acc):
        rows = pl.ds(pl.multiple_of(c * block_d, block_d), block_d)
        h = x_ref[rows].astype(f32)  # [BD]
        return acc + jnp.sum(h[:, None] * w_ref[rows, :].astype(f32), axis=0)  # [E]

    logits = jax.lax.fori_loop(0, D // block_d, product, jnp.zeros((E,), f32))
    scores = 1.0 / (1.0 + jnp.exp(-logits))  # [E]
    biased = scores + b_ref[...].astype(f32)
    experts = jax.lax.broadcasted_iota(jnp.int32, (E,), 0)
    slots = jax.lax.broadcasted_iota(jnp.int32, (top_k,), 0)
    taken = jnp.zeros((E,), jnp.int32)
    ids = jnp.zeros((top_k,), jnp.int32)
    chosen = jnp.zeros((top_k,), f32)
    for s in range(top_k):
        best = jnp.max(jnp.where(taken == 0, biased, -jnp.inf))
        e = jnp.min(jnp.where((taken == 0) & (biased == best), experts, E))  # lowest index of the max
        hit = experts == e
        taken = jnp.where(hit, 1, taken)
        ids = jnp.where(slots == s, e, ids)
        chosen = jnp.where(slots == s, jnp.sum(jnp.where(hit, scores, 0.0)), chosen)
    if renormalize:
        chosen = chosen / (jnp.sum(chosen) + RENORM_EPS)
    return ids, chosen * scaling


def _kernel(x_ref, w_ref, b_ref, ids_ref, weights_ref, **route):
    ids_ref[...], weights_ref[...] = route_token(x_ref, w_ref, b_ref, **route)


@functools.partial(jax.jit, static_argnames=("top_k", "renormalize", "scaling", "tiles", "interpret"))
def route_pallas(x: Float[Array, "T D"], w: Float[Array, "D E"], bias: Float[Array, "E"], *, top_k: int,
                 renormalize: bool, scaling: float, tiles: RouteTiles | None = None,
                 interpret: bool = False) -> tuple[Int[Array, "T k"], Float[Array, "T k"]]:
    """``route(sigmoid(x.astype(f32) @ w), bias, top_k, with_stats=False)``: ids and fp32 weights ``[T, k]``.
    ``tiles``: None picks ``RouteTiles`` with ``block_d = min(128, D)``."""
    if tiles is None:
        tiles = RouteTiles(block_d=min(RouteTiles.block_d, x.shape[-1]))
    check_inputs(x, w, bias, top_k, tiles)
    T, D = x.shape
    whole = lambda a: pl.BlockSpec(a.shape, lambda t: (0,) * a.ndim)
    row = lambda n: pl.BlockSpec((None, n), lambda t: (t, 0))
    return pl.pallas_call(
        functools.partial(_kernel, top_k=top_k, block_d=tiles.block_d, renormalize=renormalize, scaling=scaling),
        grid=(T,),
        in_specs=[row(D), whole(w), whole(bias)],
        out_specs=[row(top_k), row(top_k)],
        out_shape=[jax.ShapeDtypeStruct((T, top_k), jnp.int32), jax.ShapeDtypeStruct((T, top_k), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=interpret, name="moe_decode_route",
    )(x, w, bias)


__all__ = ["RouteTiles", "check_inputs", "route_pallas", "route_token"]
