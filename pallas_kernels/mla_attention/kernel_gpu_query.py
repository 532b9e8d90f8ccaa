"""MLA's decode query in one kernel: ``q_norm``, ``q_b`` and ``W_k``'s absorption.

Decoding a few tokens, XLA runs the query of an MLA layer with a query LoRA (K3, Kimi-Linear, ``small()``)
as three kernels on the step's longest chain, each waiting for the one before: ``q_norm``'s sum of squares
over the packed ``q_a`` output, the ``q_b`` product (the norm fused into it) and ``W_k``'s absorption
into the query (``q_c = q_nope·W_k``, ``[H, Rkv]`` fp32; ``benchmarks/decode_kernels.py``). Here one
Pallas-Triton kernel does all three: program ``(row, h, r)`` reads the row's ``q_a`` from the layer's
packed input projections (no slice of it materialised), norms it, multiplies it by head ``h``'s nope
columns of ``W_qb``, rounds ``q`` as the projection does, and absorbs rows ``[r·block_r, (r+1)·block_r)``
of its head's ``W_k``; the ``r = 0`` program also writes the head's rope part of ``q``. The programs of
a head each recompute its ``q_nope``: its ``W_qb`` columns come from HBM once and from L2 after.

Rounding points are the layer's (``k3jax.layers.mla.MLA._query``, then ``_attend_cached``; the reference
is :func:`reference_decode.absorbed_query_reference`): the norm in float32, rounded to the compute
dtype (``W_qb``'s); ``q`` accumulated in float32 over the rank and rounded to it; the absorption in
float32 from ``q_nope`` and ``W_k``. Only the float32 summation order differs. ``interpret=True`` runs
the kernel in the CPU interpreter (the default suite's test).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float

from pallas_kernels.moe.validate import passes
from pallas_kernels.triton_blocks import is_block_dim
from pallas_kernels.triton_sums import sums

MAX_ROWS = 4  # tokens a call: each row's programs re-read their head's W_qb columns (from L2)
PIECE = 128  # rows of q_a (and W_qb) a part
# A program holds its head's nope columns of W_qb in registers (small(): 384 x 128 bf16, 96 KB over 8
# warps); wider query ranks (K3's 1536) take the layer's XLA path.
MAX_HEAD_BYTES = 96 * 1024


@dataclasses.dataclass(frozen=True)
class QueryTiles:
    """``block_r``: rows of ``W_k`` (columns of ``q_c``) a program; ``num_warps``: Triton warps a program."""

    block_r: int = 64  # small(): 8 heads x 4 blocks = 32 programs a token
    num_warps: int = 8


def pieces(n: int) -> list[tuple[int, int]]:
    """``(offset, size)`` of ``n``'s equal power-of-two parts of at most ``PIECE`` (384 -> three of 128):
    Triton's tensors have power-of-two shapes, so a rank like ``small()``'s 384 is read in parts, and
    parts of one shape share their reductions (``triton_sums.sums``)."""
    size = min(n & -n, PIECE)
    return [(at, size) for at in range(0, n, size)]


def block_r(Rkv: int, tiles: QueryTiles = QueryTiles()) -> int:
    """``W_k``'s rows a program: ``tiles.block_r``, or all ``Rkv`` where fewer."""
    return min(tiles.block_r, Rkv)


def check_inputs(y, scale, w_qb, w_kv_b, *, offset: int, nope_dim: int, tiles: QueryTiles = QueryTiles()) -> None:
    """Raise ``ValueError`` naming the argument when :func:`absorbed_query` cannot take these inputs."""
    if y.ndim != 2 or not 1 <= y.shape[0] <= MAX_ROWS:
        raise ValueError(f"y must be [rows, N] with 1 <= rows <= {MAX_ROWS}, got {y.shape}")
    if w_qb.ndim != 3 or w_kv_b.ndim != 3 or w_kv_b.shape[1] != w_qb.shape[1]:
        raise ValueError(f"w_qb must be [R, H, Dq] and w_kv_b [Rkv, H, dn+dv] with the same H, got {w_qb.shape}, "
                         f"{w_kv_b.shape}")
    R, _, Dq = w_qb.shape
    Rkv = w_kv_b.shape[0]
    rope = Dq - nope_dim
    if scale.shape != (R,):
        raise ValueError(f"scale must be [R] = [{R}] (q_norm's), got {scale.shape}")
    if not 0 <= offset <= y.shape[1] - R:
        raise ValueError(f"offset={offset} must place q_a's {R} columns inside y's {y.shape[1]}")
    if R % 16 or not (is_block_dim(nope_dim) and is_block_dim(rope)) or w_kv_b.shape[2] <= nope_dim:
        raise ValueError(f"the query kernel needs R a multiple of 16 and nope_dim, Dq - nope_dim powers of two "
                         f">= 16 (nope_dim < w_kv_b.shape[2]): R={R}, nope_dim={nope_dim}, Dq={Dq}, "
                         f"w_kv_b {w_kv_b.shape}")
    if R * nope_dim * jnp.dtype(w_qb.dtype).itemsize > MAX_HEAD_BYTES:
        raise ValueError(f"the query kernel holds a head's W_qb nope columns in registers: R·nope_dim = {R}·"
                         f"{nope_dim} in {w_qb.dtype} is over {MAX_HEAD_BYTES} bytes")
    if not is_block_dim(tiles.block_r) or Rkv % block_r(Rkv, tiles):
        raise ValueError(f"tiles.block_r={tiles.block_r} must be a power of two >= 16 dividing Rkv={Rkv} (or above it, "
                         f"Rkv a power of two)")
    if any(jnp.dtype(x.dtype) == jnp.float64 for x in (y, scale, w_qb, w_kv_b)):
        raise ValueError("the query kernel takes no float64 input (Triton); the layer's XLA path does")


def accepts(y, scale, w_qb, w_kv_b, *, offset: int, nope_dim: int, tiles: QueryTiles = QueryTiles()) -> bool:
    """Whether :func:`check_inputs` takes these inputs."""
    return passes(functools.partial(check_inputs, offset=offset, nope_dim=nope_dim, tiles=tiles),
                  y, scale, w_qb, w_kv_b)


def _kernel(y_ref, scale_ref, wq_ref, wk_ref, qc_ref, qr_ref, *, offset: int, nope: int, block_r: int, eps: float):
    f32 = jnp.float32
    t, h, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    R, _, Dq = wq_ref.shape
    dt = wq_ref.dtype
    parts = pieces(R)
    # the weights first: they do not wait for the norm's reductions
    w_nope = [wq_ref[pl.ds(at, n), h, pl.ds(0, nope)] for at, n in parts]  # [n, dn] each
    w_k = wk_ref[pl.ds(pl.multiple_of(r * block_r, block_r), block_r), h, pl.ds(0, nope)]  # [block_r, dn]
    c = [y_ref[t, pl.ds(offset + at, n)].astype(f32) for at, n in parts]
    squares = sums(*(x * x for x in c))
    inv = jax.lax.rsqrt(sum(squares) / R + eps)
    normed = [(x * inv * scale_ref[pl.ds(at, n)].astype(f32)).astype(dt).astype(f32) for x, (at, n) in zip(c, parts)]
    q_nope = sum(sums(*(x[:, None] * w.astype(f32) for x, w in zip(normed, w_nope)), axis=0))
    q_nope = q_nope.astype(dt).astype(f32)  # [dn]: q_b's output, rounded
    qc_ref[t, h, pl.ds(pl.multiple_of(r * block_r, block_r), block_r)] = jnp.sum(q_nope[None, :] * w_k.astype(f32),
                                                                                 axis=1)

    @pl.when(r == 0)
    def _rope():
        w_rope = [wq_ref[pl.ds(at, n), h, pl.ds(nope, Dq - nope)] for at, n in parts]
        q_rope = sum(sums(*(x[:, None] * w.astype(f32) for x, w in zip(normed, w_rope)), axis=0))
        qr_ref[t, h, :] = q_rope.astype(dt).astype(f32)


@functools.partial(jax.jit, static_argnames=("offset", "nope_dim", "eps", "tiles", "interpret"))
def absorbed_query(y: Float[Array, "rows N"], scale: Float[Array, "R"], w_qb: Float[Array, "R H Dq"],
                   w_kv_b: Float[Array, "Rkv H Dkv"], *, offset: int, nope_dim: int, eps: float,
                   tiles: QueryTiles = QueryTiles(), interpret: bool = False):
    """``(q_c [rows, H, Rkv], q_rope [rows, H, Dq - nope_dim])`` in float32 from ``q_a = y[:, offset:offset+R]``:
    ``q = W_qb·RMSNorm(q_a; scale, eps)`` (in ``W_qb``'s dtype), ``q_c = q[:, :, :nope_dim]·W_k`` with
    ``W_k = w_kv_b[:, :, :nope_dim]``."""
    check_inputs(y, scale, w_qb, w_kv_b, offset=offset, nope_dim=nope_dim, tiles=tiles)
    rows, (_, H, Dq), Rkv = y.shape[0], w_qb.shape, w_kv_b.shape[0]
    whole = lambda a: pl.BlockSpec(a.shape, lambda t, h, r: (0,) * a.ndim)
    out_shape = [jax.ShapeDtypeStruct((rows, H, Rkv), jnp.float32),
                 jax.ShapeDtypeStruct((rows, H, Dq - nope_dim), jnp.float32)]
    br = block_r(Rkv, tiles)
    return tuple(pl.pallas_call(
        functools.partial(_kernel, offset=offset, nope=nope_dim, block_r=br, eps=eps),
        grid=(rows, H, Rkv // br),
        in_specs=[whole(a) for a in (y, scale, w_qb, w_kv_b)],
        out_specs=[whole(o) for o in out_shape],
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=interpret, name="mla_decode_query",
    )(y, scale, w_qb, w_kv_b))


__all__ = ["MAX_HEAD_BYTES", "MAX_ROWS", "PIECE", "QueryTiles", "absorbed_query", "accepts", "block_r", "check_inputs", "pieces"]
