"""Routed experts of a decode step on the GPU: the gather path in one kernel plus one epilogue.

At batch 1 a decode step of ``small()`` is bound by how many kernels it launches (a few µs each), and
XLA compiles :func:`k3jax.layers.moe_decode.gathered_experts` (the reference: each token's k
experts' matrices gathered inside multiply-and-sum fusions) to 4 kernels per MoE layer (6 in one
layer, where it writes the gathered W1 and W3 in fp32). Here one
Pallas-Triton kernel does the whole expert FFN: program ``(i, j)`` owns token-slot ``i = t·k + s``
(expert ``e = ids[t, s]``, read from the ids ref and used as a dynamic index into the weight refs, so
only the routed experts' bytes move) and intermediate block ``j`` of ``block_f`` columns. It reads
``x_t``, ``W1_e[:, block]``, ``W3_e[:, block]`` and ``W2_e[block, :]``, and writes the block's fp32
contribution to the expert's output, ``a_block · W2_e[block, :]``; it reads all three weight blocks
into registers before its first product (``DecodeTiles.prefetch``; read where they are used, each
waits behind the reduction before it: three HBM round trips, ``benchmarks/kernel_resources.py``).
Splitting F gives ``T·k·F/block_f`` programs (128 for ``small()`` at batch 1): one program per expert slot would
stream 3 matrices through 8 SMs. A small XLA epilogue sums the blocks, rounds each expert's output
and takes the weighted sum over k.

A custom call takes only materialised buffers, so the ``[:, :k]`` slice of the router's sorted ids
(fused into XLA's gather before) becomes a kernel of its own: 3 kernels a layer against 4, and
354.7 → 341.7 kernels, 32.1 → 17.6 MB written per ``small()`` decode step at batch 1 (device-less H200
compile, ``benchmarks/decode_kernels.py --moe-decode pallas``).

The decode step calls the variant that routes each token itself (:func:`routed_experts_pallas`, the
reference ``k3jax.layers.moe_decode.routed_experts``): it takes the router's scores and the balancing
bias instead of ids and weights, and each program finds its slot's expert as a rank of
``scores + bias`` (``pallas_kernels/moe/rank_routing.py``) before reading the weights: XLA's bias
add, top-k, weight sum and the ids' copy are gone, 324.7 → 280.7 kernels a ``small()`` step at
batch 1, 0.849 → 0.796 ms on the H200 (RESULTS.md, stop 52).

Rounding points are the reference's (those of ``moe_ffn``): g and u accumulated in fp32 over L and
rounded to the compute dtype (x's dtype), the activation (``gated_activation``, computed in fp32)
rounded to it, each expert's output summed in fp32 over F (blocks in the kernel, the block sums in the
epilogue) and rounded to it, the weighted sum over the k experts in fp32, the result in x's dtype.
Only the fp32 summation order differs. Plain ``[E, in, out]`` weights only (MXFP4 stays on the
reference). ``interpret=True`` runs the kernel in the CPU interpreter (the default suite's test).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels.moe.activations import gated_activation
from pallas_kernels.moe.rank_routing import Routing, check_routing, slots
from pallas_kernels.moe.validate import check_decode_expert_args, passes
from pallas_kernels.triton_blocks import is_block_dim
from pallas_kernels.triton_sums import sums


@dataclasses.dataclass(frozen=True)
class DecodeTiles:
    """``block_f``: intermediate columns per program; ``num_warps``: Triton warps per program;
    ``prefetch``: read the W1, W3 and W2 blocks into registers before the first product, so their
    reads from HBM overlap (one round trip, not three: Triton issues each load where the program
    reads it, and the reduction before it holds it back; 255 registers a thread at 4 warps, no
    spills, ptxas for sm_90a)."""

    block_f: int = 32  # small(): 8 slots x 16 blocks = 128 programs, 96 KB of weights each
    num_warps: int = 4
    prefetch: bool = True


def check_inputs(x, ids, weights, w1, w3, w2, tiles: DecodeTiles = DecodeTiles()) -> None:
    """Raise ``ValueError`` naming the argument when the kernel cannot take these inputs."""
    _, L, F = check_decode_expert_args(x, ids, weights, w1, w3, w2, "decode kernel")
    if not is_block_dim(L):
        raise ValueError(f"the decode kernel needs L (x.shape[1]) a power of two >= 16, got {L}")
    if not is_block_dim(tiles.block_f) or F % tiles.block_f:
        raise ValueError(f"tiles.block_f={tiles.block_f} must be a power of two >= 16 dividing F={F}")
    if jnp.dtype(x.dtype) == jnp.float64 or any(jnp.dtype(w.dtype) == jnp.float64 for w in (w1, w3, w2)):
        raise ValueError("the decode kernel takes no float64 input (Triton); use implementation='xla'")


def accepts(x, ids, weights, w1, w3, w2, tiles: DecodeTiles = DecodeTiles()) -> bool:
    """Whether :func:`check_inputs` takes these inputs (what ``implementation=None`` asks)."""
    return passes(check_inputs, x, ids, weights, w1, w3, w2, tiles)


def check_routing_inputs(x, scores, bias, w1, w3, w2, routing: Routing, tiles: DecodeTiles = DecodeTiles()) -> None:
    """:func:`check_inputs` for the kernel that routes (``rank_routing.check_routing``: float32 ``scores
    [T, E]`` and ``bias [E]``, E a power of two in [16, 256], ``0 < routing.top_k < E``)."""
    slots = jax.ShapeDtypeStruct((x.shape[0] if x.ndim else 0, routing.top_k), jnp.int32)
    check_inputs(x, slots, slots, w1, w3, w2, tiles)
    check_routing(scores, bias, x.shape[0], w1.shape[0], routing)


def accepts_routing(x, scores, bias, w1, w3, w2, routing: Routing, tiles: DecodeTiles = DecodeTiles()) -> bool:
    """Whether :func:`check_routing_inputs` takes these inputs."""
    return passes(check_routing_inputs, x, scores, bias, w1, w3, w2, routing, tiles)


def _kernel(*refs, routing: Routing | None, top_k: int, block_f: int, activation: str, situ_beta: float,
            situ_linear_beta: float, prefetch: bool):
    f32 = jnp.float32
    i, j = pl.program_id(0), pl.program_id(1)
    if routing is None:  # the slots' experts given
        ids_ref, x_ref, w1_ref, w3_ref, w2_ref, out_ref = refs
        e = ids_ref[i]  # the slot's expert: a dynamic index into the weight refs
    else:  # routed here, from the router's scores
        scores_ref, bias_ref, x_ref, w1_ref, w3_ref, w2_ref, out_ref, weight_ref = refs
        [(e, weight)] = slots(scores_ref, bias_ref, i // top_k, routing, [i % top_k])
        weight_ref[...] = weight
    dt = x_ref.dtype
    cols = pl.ds(pl.multiple_of(j * block_f, block_f), block_f)
    w1, w3, w2 = (w1_ref[e, :, cols], w3_ref[e, :, cols], w2_ref[e, cols, :]) if prefetch else (None,) * 3
    h = x_ref[i // top_k, :].astype(f32)  # [L]
    w1 = w1_ref[e, :, cols] if w1 is None else w1
    w3 = w3_ref[e, :, cols] if w3 is None else w3
    g, u = (s.astype(dt) for s in sums(h[:, None] * w1.astype(f32), h[:, None] * w3.astype(f32)))  # [BF] each
    a = gated_activation(g, u, activation, situ_beta, situ_linear_beta).astype(dt).astype(f32)
    w2 = w2_ref[e, cols, :] if w2 is None else w2
    out_ref[...] = jnp.sum(a[:, None] * w2.astype(f32), axis=0)  # [L]


def expert_blocks(x: Float[Array, "T L"], slots: Int[Array, "T k"] | tuple, w1: Float[Array, "E L F"],
                  w3: Float[Array, "E L F"], w2: Float[Array, "E F L"], *, activation: str,
                  situ_beta: float = 4.0, situ_linear_beta: float = 25.0, tiles: DecodeTiles = DecodeTiles(),
                  routing: Routing | None = None, interpret: bool = False):
    """The kernel: ``[T, k, F/block_f, L]`` fp32, block ``j``'s contribution to each expert's output.

    ``slots``: the experts ``ids [T, k]``; with ``routing``, the router's ``(scores [T, E], bias [E])``,
    and the kernel also returns the slots' weights ``[T, k]`` (in ``lax.top_k``'s order)."""
    T, L = x.shape
    k = slots.shape[1] if routing is None else routing.top_k
    F = w1.shape[2]
    nf = F // tiles.block_f
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)
    route_in = [slots.reshape(T * k).astype(jnp.int32)] if routing is None else list(slots)
    parts = (pl.BlockSpec((None, None, L), lambda i, j: (i, j, 0)), jax.ShapeDtypeStruct((T * k, nf, L), jnp.float32))
    weight = (pl.BlockSpec((None, None), lambda i, j: (i, j)), jax.ShapeDtypeStruct((T * k, nf), jnp.float32))
    outs = [parts] if routing is None else [parts, weight]
    out = pl.pallas_call(
        functools.partial(_kernel, routing=routing, top_k=k, block_f=tiles.block_f, activation=activation,
                          situ_beta=situ_beta, situ_linear_beta=situ_linear_beta, prefetch=tiles.prefetch),
        grid=(T * k, nf),
        in_specs=[whole(a) for a in (*route_in, x, w1, w3, w2)],
        out_specs=[o[0] for o in outs],
        out_shape=[o[1] for o in outs],
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=interpret, name="moe_decode_gather" if routing is None else "moe_decode_route_gather",
    )(*route_in, x, w1, w3, w2)
    if routing is None:
        return out[0].reshape(T, k, nf, L)
    return out[0].reshape(T, k, nf, L), out[1][:, 0].reshape(T, k)  # every block wrote the slot's weight


def _combine(parts: Float[Array, "T k NF L"], weights: Float[Array, "T k"], dt) -> Float[Array, "T L"]:
    """The epilogue: each expert's output summed over its blocks and rounded, then weighted over k."""
    wide = jnp.promote_types(dt, jnp.float32)
    y = _round_to(jnp.sum(parts, axis=2), dt)  # [T, k, L]: each expert's output, rounded, kept wide
    # a multiply-and-sum, not a dot: XLA fuses it with the block sum instead of launching a GEMM
    return jnp.sum(y * weights.astype(wide)[..., None], axis=1).astype(dt)


@functools.partial(jax.jit, static_argnames=("activation", "situ_beta", "situ_linear_beta", "tiles", "interpret"))
def gathered_experts_pallas(x: Float[Array, "T L"], ids: Int[Array, "T k"], weights: Float[Array, "T k"],
                            w1: Float[Array, "E L F"], w3: Float[Array, "E L F"], w2: Float[Array, "E F L"], *,
                            activation: str, situ_beta: float = 4.0, situ_linear_beta: float = 25.0,
                            tiles: DecodeTiles = DecodeTiles(), interpret: bool = False) -> Float[Array, "T L"]:
    """``moe_decode.gathered_experts`` (same arguments, same rounding points) by the kernel and an epilogue."""
    check_inputs(x, ids, weights, w1, w3, w2, tiles)
    parts = expert_blocks(x, ids, w1, w3, w2, activation=activation, situ_beta=situ_beta,
                          situ_linear_beta=situ_linear_beta, tiles=tiles, interpret=interpret)
    return _combine(parts, weights, x.dtype)


@functools.partial(jax.jit, static_argnames=("routing", "activation", "situ_beta", "situ_linear_beta", "tiles",
                                             "interpret"))
def routed_experts_pallas(x: Float[Array, "T L"], scores: Float[Array, "T E"], bias: Float[Array, "E"],
                          w1: Float[Array, "E L F"], w3: Float[Array, "E L F"], w2: Float[Array, "E F L"], *,
                          routing: Routing, activation: str, situ_beta: float = 4.0, situ_linear_beta: float = 25.0,
                          tiles: DecodeTiles = DecodeTiles(), interpret: bool = False) -> Float[Array, "T L"]:
    """``moe_decode.routed_experts(path="gather")``: the router's top-k and weights computed inside the kernel
    (``rank_routing``), so the 4 kernels XLA routes a token with (bias add, top-k, weight sum, the
    ids' copy for the custom call) are gone; then the same products and epilogue."""
    check_routing_inputs(x, scores, bias, w1, w3, w2, routing, tiles)
    parts, weights = expert_blocks(x, (scores, bias), w1, w3, w2, activation=activation, situ_beta=situ_beta,
                                   situ_linear_beta=situ_linear_beta, tiles=tiles, routing=routing,
                                   interpret=interpret)
    return _combine(parts, weights, x.dtype)


def _round_to(y: Float[Array, "..."], dtype) -> Float[Array, "..."]:
    """``y`` rounded to ``dtype``'s precision, in ``y``'s dtype. Not ``y.astype(dtype).astype(y.dtype)``:
    XLA (excess precision allowed, its default) drops that pair of converts, and the XLA gather path
    loses this rounding that way (CPU compile)."""
    info = jnp.finfo(dtype)
    if jnp.dtype(dtype) == jnp.dtype(y.dtype):
        return y
    return jax.lax.reduce_precision(y, exponent_bits=info.nexp, mantissa_bits=info.nmant)


__all__ = ["DecodeTiles", "accepts", "accepts_routing", "check_inputs", "check_routing_inputs", "expert_blocks",
           "gathered_experts_pallas", "routed_experts_pallas"]
