"""Routed experts of a mid-batch decode step on the GPU: the dense path in two kernels plus one epilogue.

At batch 16–256 a decode step applies every expert to every token (``k3jax.layers.moe_decode.
dense_experts``, the reference): each weight is read once, so the step costs the weight read. XLA
compiles it to three kernels a layer — the gate and up products, the activation between them, the down
product — and the activation kernel reads the gate and up products back in between (7.3 of 44.5 µs a
``small()`` layer at batch 64 on the H200, ``benchmarks/RESULTS.md``, stop 48). Here:

1. ``gate_up``: program ``(t, e, j)`` accumulates ``x_t · W1_e[:, j]`` and ``x_t · W3_e[:, j]`` for a
   block of ``block_t`` tokens and ``block_n`` intermediate columns over ``block_k``-row slabs of L on the
   tensor cores (fp32), rounds both to the compute dtype, applies the activation and writes ``a``
   ``[E, T, F]`` in the compute dtype — each W1 / W3 byte read once, the products never written.
2. ``down``: program ``(t, e, j)`` computes ``a_e · W2_e[:, j]`` for ``block_n`` latent columns and
   writes each expert's output ``[E, T, L]`` rounded to the compute dtype.
3. XLA picks each token's k outputs and takes their weighted sum in fp32 (one small fusion); or, in
   the decode step (:func:`routed_dense_experts_pallas`), :func:`routed_combine` routes each token from the
   router's scores (``rank_routing``) and sums its k outputs: one kernel for XLA's five (bias add,
   top-k, the chosen scores, their sum, the pick). Given the latent MoE's ``latent_norm`` scale it also
   norms each token's sum (``norm_scale``), so no norm kernel of its own sits before ``up_proj`` on the
   step's chain (small() at batch 64: 169 → 158 kernels on it, device-less; RESULTS.md stop 62).

Where they take the shapes (at most 64 tokens, widths of whole column tiles: small()'s batch 64), the
GPU is a Hopper and no tiling is asked for, the two products run as the Mosaic GPU kernels of
``kernel_gpu_decode_dense_tma`` instead (TMA streams into ``wgmma``: 5.7 % faster on an H100, RESULTS.md
stop 55); the combine is this module's either way.

Rounding points are the reference's (those of ``moe_ffn``): the gate and up products and each expert's
output accumulated in fp32 and rounded once, the activation computed in fp32 and rounded; only the fp32
summation order differs. The token count is padded to a multiple of ``block_t`` (zero rows, whose
outputs are never picked). 16-bit weights only: Triton's float32 dot would round its inputs to TF32
(float32 models and MXFP4 experts stay on the reference). ``interpret=True`` runs the kernels in the CPU
interpreter (the default suite's tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels.moe import kernel_gpu_decode_dense_tma
from pallas_kernels.moe.activations import gated_activation
from pallas_kernels.moe.rank_routing import Routing, check_routing, slots
from pallas_kernels.moe.validate import check_decode_expert_args, passes
from pallas_kernels.target import current_target
from pallas_kernels.triton_blocks import is_block_dim

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class DenseTiles:
    """``block_t`` tokens × ``block_n`` output columns a program, reducing over ``block_k`` rows a step
    (``tiles=None`` in the functions below: :func:`default_tiles` of the widths)."""

    block_t: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


# 128 output columns a program, 8 warps: small() at batch 64 (E 64, L = F = 512) in 64 × 4 programs a
# kernel, each streaming 128 KB of every weight it reads — 44.56 µs a layer on the H200 against 46.14
# with 64 columns and 4 warps (45.77 XLA; ``bench_moe_decode.py --path dense``, RESULTS.md stop 52).
WIDE = DenseTiles(block_n=128, num_warps=8)


def default_tiles(L: int, F: int) -> DenseTiles:
    """``WIDE`` where the latent ``L`` and the intermediate ``F`` are multiples of its 128 columns (small()'s
    512, K3's 3584 latent), else ``DenseTiles()`` (multiples of 64)."""
    return WIDE if L % WIDE.block_n == 0 and F % WIDE.block_n == 0 else DenseTiles()


def _tiles(tiles: DenseTiles | None, w1) -> DenseTiles:
    """``tiles``, or :func:`default_tiles` of ``w1``'s ``[E, L, F]``."""
    if tiles is not None:
        return tiles
    shape = getattr(w1, "shape", ())
    return default_tiles(*shape[1:]) if len(shape) == 3 else DenseTiles()


def _token_block(T: int, tiles: DenseTiles) -> int:
    """Rows of a program: ``block_t``, or the next power of two >= max(T, 16) below it."""
    return min(tiles.block_t, max(16, 1 << (T - 1).bit_length()))


def check_inputs(x, ids, weights, w1, w3, w2, tiles: DenseTiles | None = None) -> None:
    """Raise ``ValueError`` naming the argument when the kernels cannot take these inputs."""
    _, L, F = check_decode_expert_args(x, ids, weights, w1, w3, w2, "dense decode kernels")
    tiles = _tiles(tiles, w1)
    for name in ("block_t", "block_n", "block_k"):
        if not is_block_dim(getattr(tiles, name)):
            raise ValueError(f"tiles.{name}={getattr(tiles, name)} must be a power of two >= 16")
    for dim, n in (("L", L), ("F", F)):
        if n % tiles.block_n or n % tiles.block_k:
            raise ValueError(f"{dim}={n} must be a multiple of tiles.block_n={tiles.block_n} and "
                             f"tiles.block_k={tiles.block_k}")
    dtypes = {jnp.dtype(a.dtype) for a in (x, w1, w3, w2)}
    if len(dtypes) != 1 or not dtypes <= set(_DTYPES):
        raise ValueError(f"x, w1, w3, w2 must share one 16-bit float dtype (bfloat16 or float16) for the dense "
                         f"decode kernels, got {sorted(str(d) for d in dtypes)}; use implementation='xla'")


def accepts(x, ids, weights, w1, w3, w2, tiles: DenseTiles | None = None) -> bool:
    """Whether :func:`check_inputs` takes these inputs (what ``implementation=None`` asks)."""
    return passes(check_inputs, x, ids, weights, w1, w3, w2, tiles)


def check_routing_inputs(x, scores, bias, w1, w3, w2, routing: Routing, tiles: DenseTiles | None = None) -> None:
    """:func:`check_inputs` for the kernels that route (``rank_routing.check_routing``)."""
    slots = jax.ShapeDtypeStruct((x.shape[0] if x.ndim else 0, routing.top_k), jnp.int32)
    check_inputs(x, slots, slots, w1, w3, w2, tiles)
    check_routing(scores, bias, x.shape[0], w1.shape[0], routing)


def accepts_routing(x, scores, bias, w1, w3, w2, routing: Routing, tiles: DenseTiles | None = None) -> bool:
    """Whether :func:`check_routing_inputs` takes these inputs."""
    return passes(check_routing_inputs, x, scores, bias, w1, w3, w2, routing, tiles)


def _products(a_ref, w_refs, block_k: int) -> list:
    """``a · W`` for each ``W`` of ``w_refs`` (``[K, N]`` blocks), fp32, over ``block_k``-row slabs of K."""
    K = a_ref.shape[1]

    def step(i, accs):
        ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        a = a_ref[:, ks]
        return tuple(acc + jax.lax.dot_general(a, w[ks, :], (((1,), (0,)), ((), ())),
                                               preferred_element_type=jnp.float32)
                     for acc, w in zip(accs, w_refs))

    zeros = tuple(jnp.zeros((a_ref.shape[0], w.shape[1]), jnp.float32) for w in w_refs)
    return list(jax.lax.fori_loop(0, K // block_k, step, zeros))


def _gate_up_kernel(x_ref, w1_ref, w3_ref, a_ref, *, block_k, activation, situ_beta, situ_linear_beta):
    dt = a_ref.dtype
    g, u = _products(x_ref, (w1_ref, w3_ref), block_k)
    a_ref[...] = gated_activation(g.astype(dt), u.astype(dt), activation, situ_beta, situ_linear_beta).astype(dt)


def _down_kernel(a_ref, w2_ref, y_ref, *, block_k):
    (y,) = _products(a_ref, (w2_ref,), block_k)
    y_ref[...] = y.astype(y_ref.dtype)


def _call(kernel, a, w, out_cols: int, bt: int, tiles: DenseTiles, interpret: bool, name: str, *more_w):
    """``kernel`` over the grid (token block, expert, column block): ``a [Tp, K]`` (shared by every
    expert) or ``[E, Tp, K]``, weights ``[E, K, N]``, output ``[E, Tp, N]``. The token blocks are the
    grid's first (fastest-launched) axis, so the programs that read one weight block run together
    and share it through L2 (a layer's experts exceed L2 from ``small()`` on)."""
    E, K, N = w.shape
    Tp = a.shape[-2]
    grid = (Tp // bt, E, N // tiles.block_n)
    if a.ndim == 2:
        a_spec = pl.BlockSpec((bt, K), lambda t, e, j: (t, 0))
    else:
        a_spec = pl.BlockSpec((None, bt, K), lambda t, e, j: (e, t, 0))
    w_spec = pl.BlockSpec((None, K, tiles.block_n), lambda t, e, j: (e, 0, j))
    return pl.pallas_call(
        kernel, grid=grid, in_specs=[a_spec] + [w_spec] * (1 + len(more_w)),
        out_specs=pl.BlockSpec((None, bt, tiles.block_n), lambda t, e, j: (e, t, j)),
        out_shape=jax.ShapeDtypeStruct((E, Tp, out_cols), a.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret, name=name,
    )(a, w, *more_w)


def expert_outputs(x: Float[Array, "T L"], w1: Float[Array, "E L F"], w3: Float[Array, "E L F"],
                   w2: Float[Array, "E F L"], *, activation: str, situ_beta: float = 4.0,
                   situ_linear_beta: float = 25.0, tiles: DenseTiles | None = None,
                   interpret: bool = False) -> Float[Array, "E T L"]:
    """The two kernels: every expert's output on every token, ``[E, T, L]`` in ``x``'s dtype — by the Mosaic
    GPU kernels (``kernel_gpu_decode_dense_tma``) where they take the shapes and ``tiles`` is None."""
    T, L = x.shape
    F = w1.shape[2]
    # (TMA and wgmma: Hopper only; the Triton kernels run on any CUDA GPU)
    if tiles is None and kernel_gpu_decode_dense_tma.takes(T, L, F) and (interpret or current_target().hopper):
        return kernel_gpu_decode_dense_tma.expert_outputs(x, w1, w3, w2, activation=activation, situ_beta=situ_beta,
                                                          situ_linear_beta=situ_linear_beta, interpret=interpret)
    tiles = _tiles(tiles, w1)
    bt = _token_block(T, tiles)
    Tp = -(-T // bt) * bt
    xp = jnp.pad(x, ((0, Tp - T), (0, 0))) if Tp != T else x
    gate_up = functools.partial(_gate_up_kernel, block_k=tiles.block_k, activation=activation,
                                situ_beta=situ_beta, situ_linear_beta=situ_linear_beta)
    a = _call(gate_up, xp, w1, F, bt, tiles, interpret, "moe_decode_dense_gate_up", w3)  # [E, Tp, F]
    y = _call(functools.partial(_down_kernel, block_k=tiles.block_k), a, w2, L, bt, tiles, interpret,
              "moe_decode_dense_down")  # [E, Tp, L]
    return y[:, :T]


def _combine_kernel(scores_ref, bias_ref, y_ref, *refs, routing: Routing, block_n: int, norm_eps: float | None):
    """Program ``(t, j)``: token t's k experts' outputs in column block j, in ``lax.top_k``'s order,
    weighted and summed in fp32 — the router's top-k found here (``rank_routing``) — and rounded. With a
    norm (``norm_eps``; ``refs`` the scale then the output) every program also sums the whole row's
    squares (its blocks unrolled, so their loads issue together) for ``RMSNorm``'s ``1/rms``."""
    t, j = pl.program_id(0), pl.program_id(1)
    if norm_eps is not None:  # the norm's scale read first: read after the routing's reductions, it would wait
        scale_ref, out_ref = refs
        scale = scale_ref[pl.ds(pl.multiple_of(j * block_n, block_n), block_n)].astype(jnp.float32)
    picked = slots(scores_ref, bias_ref, t, routing, range(routing.top_k))
    dt = y_ref.dtype

    def block(c):  # the weighted sum over column block c, rounded to y's dtype (kept in fp32)
        cols = pl.ds(c * block_n if isinstance(c, int) else pl.multiple_of(c * block_n, block_n), block_n)
        acc = jnp.zeros((block_n,), jnp.float32)
        for e, w in picked:
            acc = acc + w * y_ref[e, t, cols].astype(jnp.float32)
        return acc.astype(dt).astype(jnp.float32)

    h = block(j)
    if norm_eps is None:
        (out_ref,) = refs
        out_ref[...] = h.astype(out_ref.dtype)
        return
    L = y_ref.shape[-1]
    squares = functools.reduce(jnp.add, [jnp.square(block(c)) for c in range(L // block_n)])
    inv = jax.lax.rsqrt(jnp.sum(squares) / L + norm_eps)
    out_ref[...] = (h * inv * scale).astype(out_ref.dtype)


def routed_combine(y: Float[Array, "E T L"], scores: Float[Array, "T E"], bias: Float[Array, "E"], *,
                   routing: Routing, norm_scale: Float[Array, "L"] | None = None, norm_eps: float = 1e-6,
                   tiles: DenseTiles | None = None, interpret: bool = False) -> Float[Array, "T L"]:
    """Each token's k picked outputs of ``y`` (every expert on every token), weighted and summed: one
    kernel where XLA routes (bias add, top-k, the chosen scores, their sum) and picks in 5. With
    ``norm_scale`` the sum is also ``RMSNorm``-ed (``k3jax.layers.norm.rms_norm`` with ``norm_eps``, then
    rounded): the latent MoE's ``latent_norm`` before ``up_proj``, so the norm is not a kernel of its own on
    the decode step's chain."""
    E, T, L = y.shape
    tiles = tiles or default_tiles(L, L)
    bn = min(tiles.block_n, L)
    if L % bn or not is_block_dim(bn):
        raise ValueError(f"y's L={L} must be a multiple of tiles.block_n={tiles.block_n} or a power of two >= 16 "
                         f"below it")
    if norm_scale is not None and tuple(norm_scale.shape) != (L,):
        raise ValueError(f"norm_scale must have shape ({L},) (y's L), got {tuple(norm_scale.shape)}")
    whole = lambda a: pl.BlockSpec(a.shape, lambda t, j: (0,) * a.ndim)
    normed = norm_scale is not None
    kernel = functools.partial(_combine_kernel, routing=routing, block_n=bn, norm_eps=norm_eps if normed else None)
    return pl.pallas_call(
        kernel, grid=(T, L // bn),
        in_specs=[whole(scores), whole(bias), whole(y), *([whole(norm_scale)] if normed else [])],
        out_specs=pl.BlockSpec((None, bn), lambda t, j: (t, j)),
        out_shape=jax.ShapeDtypeStruct((T, L), y.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="moe_decode_dense_combine",
    )(scores, bias, y, *([norm_scale] if normed else []))


@functools.partial(jax.jit, static_argnames=("activation", "situ_beta", "situ_linear_beta", "tiles", "interpret"))
def dense_experts_pallas(x: Float[Array, "T L"], ids: Int[Array, "T k"], weights: Float[Array, "T k"],
                         w1: Float[Array, "E L F"], w3: Float[Array, "E L F"], w2: Float[Array, "E F L"], *,
                         activation: str, situ_beta: float = 4.0, situ_linear_beta: float = 25.0,
                         tiles: DenseTiles | None = None, interpret: bool = False) -> Float[Array, "T L"]:
    """``moe_decode.dense_experts`` (same arguments, same rounding points) by the kernels and an epilogue."""
    check_inputs(x, ids, weights, w1, w3, w2, tiles)
    y = expert_outputs(x, w1, w3, w2, activation=activation, situ_beta=situ_beta,
                       situ_linear_beta=situ_linear_beta, tiles=tiles, interpret=interpret)
    picked = y[ids, jnp.arange(x.shape[0])[:, None]].astype(jnp.float32)  # [T, k, L]
    # a multiply-and-sum, not a dot: one fusion with the pick instead of a GEMM launch
    return jnp.sum(picked * weights.astype(jnp.float32)[..., None], axis=1).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("routing", "activation", "situ_beta", "situ_linear_beta", "norm_eps",
                                             "tiles", "interpret"))
def routed_dense_experts_pallas(x: Float[Array, "T L"], scores: Float[Array, "T E"], bias: Float[Array, "E"],
                                w1: Float[Array, "E L F"], w3: Float[Array, "E L F"], w2: Float[Array, "E F L"], *,
                                routing: Routing, activation: str, situ_beta: float = 4.0,
                                situ_linear_beta: float = 25.0, norm_scale: Float[Array, "L"] | None = None,
                                norm_eps: float = 1e-6, tiles: DenseTiles | None = None,
                                interpret: bool = False) -> Float[Array, "T L"]:
    """``moe_decode.routed_experts`` on the dense path: the two kernels, then :func:`routed_combine`
    (the expert products never wait for the routing: only the combine reads it; ``norm_scale``: it
    also norms the result)."""
    asked, tiles = tiles, _tiles(tiles, w1)
    check_routing_inputs(x, scores, bias, w1, w3, w2, routing, tiles)
    y = expert_outputs(x, w1, w3, w2, activation=activation, situ_beta=situ_beta,
                       situ_linear_beta=situ_linear_beta, tiles=asked, interpret=interpret)  # None: maybe TMA
    return routed_combine(y, scores, bias, routing=routing, norm_scale=norm_scale, norm_eps=norm_eps, tiles=tiles,
                          interpret=interpret)


__all__ = ["WIDE", "DenseTiles", "accepts", "accepts_routing", "check_inputs", "check_routing_inputs",
           "default_tiles", "dense_experts_pallas", "expert_outputs", "routed_combine", "routed_dense_experts_pallas"]
