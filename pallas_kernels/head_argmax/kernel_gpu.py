"""Greedy decoding's output head in Pallas-Triton: each row's argmax of ``x · W`` without the logits.

At temperature 0 a decode step needs only each row's highest-scoring id, but XLA's path stores the
``[T, V]`` float32 logits (at ``small()``'s batch 64: 42 MB beside the head's 335 MB of weights) and
reads them back in a two-kernel argmax; on an H100 the head took 148 µs and the argmax 15 where batch
1's head streams the same weights in 110 (``benchmarks/RESULTS.md``, stop 57). Here program ``j`` owns
``block_v`` vocabulary columns of ``W`` (``[D, V]``, as the model stores its head), streams them in
``block_d``-row slabs (pipelined, ``num_stages``) against every row of ``x`` (L2-resident) on the tensor
cores into a float32 accumulator, and keeps of it only each row's largest logit and that logit's
lowest id: ``[V / block_v, T]`` partials, 0.4 % of the logits' bytes at the default ``block_v = 512``.
``reference.combine_partials`` (one small XLA reduction) picks each row's token from them.

The logits are the model's (16-bit products summed in float32); only the summation order differs from
XLA's GEMM, so a row whose two best logits lie within float32 rounding of each other may pick the
other one. Ties of equal logits go to the lowest id, as ``jnp.argmax``. Rows are padded to a power of
two of at least 16 (Triton's dot). The reference is :func:`pallas_kernels.head_argmax.reference.greedy_tokens`.
``interpret=True`` runs it in the CPU interpreter.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels.head_argmax.reference import combine_partials
from pallas_kernels.moe.validate import passes
from pallas_kernels.triton_blocks import is_block_dim

MAX_ROWS = 64  # one tile of rows: a decode batch of up to 64 sequences
# From 24 rows (padded to 32) the kernel beats XLA's head and argmax: on an H100 at small()'s head it takes
# 133-141 µs from 24 to 64 rows (126 at 16, 136 at 1), XLA 117 at 1 row, 123-127 at 16, 138 at 24, 143-146 at
# 32 and 171-174 at 64, whose float32 logits grow with the rows (``bench_greedy_head.py``; benchmarks/RESULTS.md,
# stops 68-69).
MIN_ROWS = 24
_16BIT = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class HeadTiles:
    """``block_v`` vocabulary columns a program, ``block_d`` rows of ``W`` a pipelined step."""

    block_v: int = 512
    block_d: int = 32
    num_warps: int = 8
    num_stages: int = 4


# 512 columns a program in 32-row steps at 8 warps (H100, stop 69): 139.8 µs at 64 rows, 137.4-138.4 at 32, 132.8
# at 24, against 143.0-144.9 / 146.0-149.5 / 147.8 with stop 68's 256 columns in 64-row steps at 4 warps (which
# beat 128 columns, 147.4, and 64, 157.7); 512 x 64 with 3 stages 145.9, 256 x 32 with 6 stages 145.5 at 64 rows
DEFAULT = HeadTiles()


def default_tiles(V: int) -> HeadTiles:
    """``DEFAULT`` with its ``block_v`` halved (down to 16) until it divides the vocabulary ``V``."""
    block_v = DEFAULT.block_v
    while block_v > 16 and V % block_v:
        block_v //= 2
    return dataclasses.replace(DEFAULT, block_v=block_v)


def pays(rows: int) -> bool:
    """Whether the kernel beats XLA's logits and argmax for ``rows`` rows (``MIN_ROWS`` to ``MAX_ROWS``)."""
    return MIN_ROWS <= rows <= MAX_ROWS


def check_inputs(x, w, tiles: HeadTiles | None = None) -> None:
    """Raise ``ValueError`` naming the argument when the kernel cannot take these inputs (``tiles`` None:
    ``default_tiles``)."""
    if getattr(x, "ndim", 0) != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x must be [T, D] with 1 <= T <= {MAX_ROWS} rows, got shape {getattr(x, 'shape', None)}")
    T, D = x.shape
    if getattr(w, "ndim", 0) != 2 or w.shape[0] != D:
        raise ValueError(f"w must be [D={D}, V] (the head as stored), got shape {getattr(w, 'shape', None)}")
    tiles = tiles or default_tiles(w.shape[1])
    dtypes = {jnp.dtype(x.dtype), jnp.dtype(w.dtype)}
    if len(dtypes) != 1 or not dtypes <= set(_16BIT):
        raise ValueError(f"x and w must share one 16-bit float dtype, got {sorted(map(str, dtypes))}")
    if not is_block_dim(tiles.block_v) or w.shape[1] % tiles.block_v:
        raise ValueError(f"V={w.shape[1]} must be a multiple of tiles.block_v={tiles.block_v} (a power of two >= 16)")
    if not is_block_dim(tiles.block_d) or D % tiles.block_d:
        raise ValueError(f"D={D} must be a multiple of tiles.block_d={tiles.block_d} (a power of two >= 16)")


def accepts(x, w, tiles: HeadTiles | None = None) -> bool:
    """Whether :func:`check_inputs` takes these inputs."""
    return passes(check_inputs, x, w, tiles)


def _kernel(x_ref, w_ref, max_ref, idx_ref, *, block_d: int):
    Tp, D = x_ref.shape
    block_v = w_ref.shape[1]

    def step(i, acc):
        ks = pl.ds(pl.multiple_of(i * block_d, block_d), block_d)
        return acc + jnp.dot(x_ref[:, ks], w_ref[ks, :], preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, D // block_d, step, jnp.zeros((Tp, block_v), jnp.float32))
    max_ref[...] = jnp.max(acc, axis=1)
    idx_ref[...] = jnp.argmax(acc, axis=1).astype(jnp.int32) + pl.program_id(0) * block_v


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def greedy_head(x: Float[Array, "T D"], w: Float[Array, "D V"], *, tiles: HeadTiles | None = None,
                interpret: bool = False) -> Int[Array, "T"]:
    """Each row's ``argmax_v (x · W)[v]`` (lowest id on ties), int32 ``[T]``; ``tiles`` None: ``default_tiles``."""
    check_inputs(x, w, tiles)
    T, D = x.shape
    V = w.shape[1]
    tiles = tiles or default_tiles(V)
    Tp = max(16, 1 << (T - 1).bit_length())
    xp = jnp.pad(x, ((0, Tp - T), (0, 0))) if Tp != T else x
    blocks = V // tiles.block_v
    pmax, pidx = pl.pallas_call(
        functools.partial(_kernel, block_d=tiles.block_d), grid=(blocks,),
        in_specs=[pl.BlockSpec((Tp, D), lambda j: (0, 0)), pl.BlockSpec((D, tiles.block_v), lambda j: (0, j))],
        out_specs=[pl.BlockSpec((Tp,), lambda j: (j,))] * 2,
        out_shape=[jax.ShapeDtypeStruct((blocks * Tp,), jnp.float32), jax.ShapeDtypeStruct((blocks * Tp,), jnp.int32)],
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret, name="greedy_head",
    )(xp, w)
    return combine_partials(pmax.reshape(blocks, Tp), pidx.reshape(blocks, Tp))[:T]


__all__ = ["DEFAULT", "MAX_ROWS", "MIN_ROWS", "HeadTiles", "accepts", "check_inputs", "default_tiles", "greedy_head",
           "pays"]
