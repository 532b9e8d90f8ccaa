"""A mid-batch decode projection (5–64 tokens) on the tensor cores, tiled for weights read from HBM.

At batch 64 a decode step's projections are ``[64, D] × [D, N]`` products of 1–5 MB weights that no
other kernel of the step reads again, so each is a cold read. XLA's autotuner times its GEMM tilings on
weights it just read, resident in the 50 MB L2, and keeps tiles that launch few programs: on an H100
(RESULTS.md, stop 55) small()'s MoE input products (the shared experts' gate and up with the latent
``down_proj``, 5.2 MB) took 13.8 µs a layer — 0.4 TB/s — and the smaller ones 3–6 µs each.

Here program ``j`` owns ``block_n`` output columns of ``W`` (stored output axis first, ``[N, D]``, as
``decode_layout`` stores the projections: each row contiguous), streams its rows in ``block_d``-column
slabs (pipelined, ``num_stages``) against every token's row of ``x`` (L2-resident: the step just wrote
it) and accumulates ``x · Wᵀ`` in float32 on the tensor cores: ``block_n`` is the widest that still
gives every SM a program, so the whole GPU streams the weight once. With two weights (an MLP's gate
and up) both products are rounded to the projection dtype, the gated activation computed in float32
and rounded to the compute dtype, as ``split_gated_activation`` rounds them (one kernel where XLA runs
two products and an activation). Rounding points are those of the model's einsum (float32 sums,
rounded once); only the float32 summation order differs. The reference is
:func:`pallas_kernels.mix_matvec.reference.token_matmul_reference`. 16-bit weights only (Triton's
float32 dot would round its inputs to TF32: the float32 router stays on XLA). ``interpret=True`` runs
it in the CPU interpreter.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float

from pallas_kernels.mix_matvec.kernel_gpu import MAX_TOKENS
from pallas_kernels.moe.activations import gated_activation
from pallas_kernels.moe.validate import passes
from pallas_kernels.triton_blocks import is_block_dim

MAX_ROWS = 64  # one tile of token rows; past it (up to 256 tokens) XLA's GEMMs have rows enough to tile
PROGRAMS = 128  # aim: about one program per SM of an H100 / H200 (132), each streaming its columns once
_16BIT = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class TokenTiles:
    """``block_n``: output columns a program (None: the widest power of two from 16 to 64 dividing N that
    gives at least ``PROGRAMS`` programs, else 16); ``block_d``: input columns a step (at most: the
    largest power of two >= 16 dividing D below it)."""

    block_n: int | None = None
    block_d: int = 128
    num_warps: int = 4
    num_stages: int = 3


def takes_tokens(T: int) -> bool:
    """Whether the kernel is the one for ``T`` tokens: more than the matvec's ``MAX_TOKENS``, at most 64."""
    return MAX_TOKENS < T <= MAX_ROWS


def block_n(N: int, tiles: TokenTiles = TokenTiles()) -> int:
    """The program's output columns for ``N`` (see :class:`TokenTiles`); 0 where none divides ``N``."""
    if tiles.block_n is not None:
        return tiles.block_n if N % tiles.block_n == 0 else 0
    fits = [b for b in (64, 32, 16) if N % b == 0]
    return next((b for b in fits if N // b >= PROGRAMS), fits[-1] if fits else 0)


def block_d(D: int, tiles: TokenTiles = TokenTiles()) -> int:
    """The input columns a step for ``D`` (see :class:`TokenTiles`); 0 where no power of two >= 16 divides it."""
    b = tiles.block_d
    while b >= 16 and D % b:
        b //= 2
    return b if b >= 16 else 0


def check_inputs(x, weights: tuple, activation: tuple | None = None, tiles: TokenTiles = TokenTiles()) -> None:
    """Raise ``ValueError`` naming the argument when the kernel cannot take these inputs."""
    if getattr(x, "ndim", 0) != 2 or not takes_tokens(x.shape[0]):
        raise ValueError(f"x must be [T, D] with {MAX_TOKENS} < T <= {MAX_ROWS} tokens, got shape "
                         f"{getattr(x, 'shape', None)}")
    if len(weights) not in (1, 2) or (len(weights) == 2) != (activation is not None):
        raise ValueError(f"weights must be (W,) or (W_gate, W_up) with an activation, got {len(weights)} "
                         f"weight(s) and activation={activation}")
    T, D = x.shape
    N = weights[0].shape[0]
    for i, w in enumerate(weights):
        if w.ndim != 2 or w.shape != (N, D):
            raise ValueError(f"weights[{i}] must be [N, D={D}] (output axis first) like weights[0] {weights[0].shape}, "
                             f"got {w.shape}")
    dtypes = {jnp.dtype(a.dtype) for a in (x, *weights)}
    if len(dtypes) != 1 or not dtypes <= set(_16BIT):
        raise ValueError(f"x and weights must share one 16-bit float dtype, got {sorted(map(str, dtypes))}")
    if not block_n(N, tiles):
        raise ValueError(f"N={N} must be a multiple of 16 (tiles.block_n={tiles.block_n})")
    if not is_block_dim(tiles.block_d) or not block_d(D, tiles):
        raise ValueError(f"D={D} must be a multiple of 16 (tiles.block_d={tiles.block_d}: a power of two >= 16)")


def accepts(x, weights: tuple, activation: tuple | None = None, tiles: TokenTiles = TokenTiles()) -> bool:
    """Whether :func:`check_inputs` takes these inputs."""
    return passes(check_inputs, x, weights, activation, tiles)


def _kernel(x_ref, *refs, block_d: int, activation, out_dtype):
    w_refs, out_ref = refs[:-1], refs[-1]
    D = x_ref.shape[1]

    def step(i, accs):
        ks = pl.ds(pl.multiple_of(i * block_d, block_d), block_d)
        x = x_ref[:, ks]
        dims = (((1,), (1,)), ((), ()))  # x [T, block_d] against W's rows [block_n, block_d]
        return tuple(acc + jax.lax.dot_general(x, w[:, ks], dims, preferred_element_type=jnp.float32)
                     for acc, w in zip(accs, w_refs))

    zeros = tuple(jnp.zeros((x_ref.shape[0], out_ref.shape[1]), jnp.float32) for _ in w_refs)
    accs = jax.lax.fori_loop(0, D // block_d, step, zeros)
    if len(accs) == 1:
        out_ref[...] = accs[0].astype(out_dtype)
    else:
        g, u = (a.astype(x_ref.dtype).astype(jnp.float32) for a in accs)
        out_ref[...] = gated_activation(g, u, **activation).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "activation", "tiles", "interpret"))
def token_matmul(x: Float[Array, "T D"], weights: tuple, *, out_dtype=None, activation: tuple | None = None,
                 tiles: TokenTiles = TokenTiles(), interpret: bool = False) -> Float[Array, "T N"]:
    """``x · Wᵀ`` for ``weights = (W,)`` (``[N, D]``) in ``out_dtype`` (default: x's), or
    ``act(round(x · W_gateᵀ), round(x · W_upᵀ))`` (``activation``: ``gated_activation``'s keywords as a
    tuple of pairs) in x's dtype; ``[T, N]``."""
    check_inputs(x, weights, activation, tiles)
    T, D = x.shape
    N = weights[0].shape[0]
    Tp = max(16, 1 << (T - 1).bit_length())  # the dot's rows: a power of two
    xp = jnp.pad(x, ((0, Tp - T), (0, 0))) if Tp != T else x
    bn = block_n(N, tiles)
    out_dtype = jnp.dtype(x.dtype if out_dtype is None or activation is not None else out_dtype)
    kernel = functools.partial(_kernel, block_d=block_d(D, tiles), activation=dict(activation or ()),
                               out_dtype=out_dtype)
    y = pl.pallas_call(
        kernel, grid=(N // bn,),
        in_specs=[pl.BlockSpec((Tp, D), lambda j: (0, 0))] + [pl.BlockSpec((bn, D), lambda j: (j, 0))] * len(weights),
        out_specs=pl.BlockSpec((Tp, bn), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((Tp, N), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret, name="token_matmul",
    )(xp, *weights)
    return y[:T]


__all__ = ["MAX_ROWS", "PROGRAMS", "TokenTiles", "accepts", "block_d", "block_n", "check_inputs", "takes_tokens",
           "token_matmul"]
