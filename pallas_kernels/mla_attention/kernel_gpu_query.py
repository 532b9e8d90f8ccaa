"""MLA's decode query in one kernel: ``q_norm``, ``q_b`` and ``W_k``'s absorption.

Decoding, XLA runs the query of an MLA layer with a query LoRA (K3, Kimi-Linear, ``small()``) as three
kernels on the step's longest chain at batch 1 (``q_norm``'s sum of squares over the packed ``q_a``
output, the ``q_b`` product with the norm fused in, ``W_k``'s absorption into the query, ``q_c =
q_nope·W_k``) and four at batch 64 (the norm, ``q_b`` as a split-K GEMM and its reduction, the
absorption; ``benchmarks/decode_kernels.py``). Here one Pallas-Triton kernel does all of it for up to
``MAX_ROWS`` rows: program ``(h, r)`` reads every row's ``q_a`` from the layer's packed input projections
(no slice of it materialised), norms it, multiplies it by head ``h``'s nope columns of ``W_qb``, rounds
``q`` as the projection does, and absorbs rows ``[r·block_r, (r+1)·block_r)`` of its head's ``W_k``; a last
program per head writes its rope part of ``q`` (stop 64: inside the ``r = 0`` programs its columns' trip from
HBM came after their products). Every program reads its weights before ``q_a`` and the norm's reductions
(Triton issues a load where the program reads it). Both products are tensor-core dots over the
rows padded to 16 (or a power of two): their contractions need no cross-warp reduction, which as sums
took 47 barriers a program against 11 (ptxas, sm_90a, batch 1). The programs of a head each recompute its
``q_nope``: its ``W_qb`` columns come from HBM once and from L2 after.

Rounding points are the layer's (``k3jax.layers.mla.MLA._query``, then ``_attend_cached``; the reference
is :func:`reference_decode.absorbed_query_reference`): the norm in float32, rounded to the compute
dtype (``W_qb``'s); ``q`` accumulated in float32 over the rank and rounded to it; the absorption in
float32 (``q_nope`` is 16-bit once rounded, ``W_k`` 16-bit or, stored in float32, three bfloat16 parts that
sum to it, so the tensor cores' products are exact). Only the float32 summation order differs.
``interpret=True`` runs the kernel in the CPU interpreter (the default suite's test).

The kernel alone does not pay (a ``small()`` step at batch 1 on the H200: 0.609 ms without it, 0.615 with,
stop 62; with the rope programs on an H100, 0.643 against 0.663, stop 64; benchmarks/RESULTS.md), so the layer
runs it from 16 rows (``k3jax.layers.mla.QUERY_KERNEL_ROWS``), where it was timed beside :mod:`kernel_gpu_output`
(which since stop 66 also runs without it, below 16 rows).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float

from pallas_kernels.moe.validate import passes
from pallas_kernels.triton_blocks import is_block_dim
from pallas_kernels.triton_sums import sums

MAX_ROWS = 64  # rows a call: one program takes them all (tensor-core products), padded to 16 or a power of two
PIECE = 128  # rows of q_a (and W_qb) a part
# A program holds its head's nope columns of W_qb in registers (small(): 384 x 128 bf16, 96 KB over 8
# warps); wider query ranks (K3's 1536) take the layer's XLA path.
MAX_HEAD_BYTES = 96 * 1024


@dataclasses.dataclass(frozen=True)
class QueryTiles:
    """``block_r``: rows of ``W_k`` (columns of ``q_c``) a program; ``num_warps``: Triton warps a program."""

    block_r: int = 64  # small(): 8 heads x 4 blocks = 32 programs
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
    if jnp.dtype(w_qb.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) or jnp.dtype(
            w_kv_b.dtype) not in (jnp.dtype(w_qb.dtype), jnp.dtype(jnp.float32)):
        raise ValueError(f"w_qb must be 16-bit (the compute dtype) and w_kv_b in its dtype or float32 (the products "
                         f"run on the tensor cores), got {w_qb.dtype}, {w_kv_b.dtype}")
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
    if any(jnp.dtype(x.dtype) == jnp.float64 for x in (y, scale)):
        raise ValueError("the query kernel takes no float64 input (Triton); the layer's XLA path does")


def accepts(y, scale, w_qb, w_kv_b, *, offset: int, nope_dim: int, tiles: QueryTiles = QueryTiles()) -> bool:
    """Whether :func:`check_inputs` takes these inputs."""
    return passes(functools.partial(check_inputs, offset=offset, nope_dim=nope_dim, tiles=tiles),
                  y, scale, w_qb, w_kv_b)


def dot_f32(a, b, contract):
    """``a·b`` over ``contract`` on the tensor cores, float32 accumulation (bf16 operands: exact products)."""
    return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


def bf16_parts(w):
    """``w`` as 16-bit tensor-core operands: itself, or a float32 ``w`` as three bfloat16 parts whose sum is
    ``w`` (8 significant bits each; the products with a 16-bit operand stay exact)."""
    if w.dtype != jnp.float32:
        return [w]
    hi = w.astype(jnp.bfloat16)
    rest = w - hi.astype(jnp.float32)
    mid = rest.astype(jnp.bfloat16)
    return [hi, mid, (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)]


def _kernel(y_ref, scale_ref, wq_ref, wk_ref, qc_ref, qr_ref, *, offset: int, R: int, Dq: int, nope: int, Rkv: int,
            Dkv: int, block_r: int, group: int, eps: float):
    f32 = jnp.float32
    h, r = pl.program_id(0), pl.program_id(1)
    n_rows, dt = y_ref.shape[0], wq_ref.dtype
    rows = jnp.arange(group)
    live, at_row = rows < n_rows, jnp.minimum(rows, n_rows - 1)[:, None]  # padding rows: the last row, unstored
    cols = lambda start, n: start + jnp.arange(n)[None, :]
    parts = pieces(R)

    def normed_q_a():
        """The rows' ``q_a`` normed and rounded, each part: called after the program reads its weights (Triton
        issues a load where the program reads it), so that they and these inputs are in flight before the
        norm's reductions."""
        c = [y_ref[at_row, cols(offset + at, n)].astype(f32) for at, n in parts]  # [group, n] each
        scales = [scale_ref[pl.ds(at, n)].astype(f32)[None, :] for at, n in parts]
        inv = jax.lax.rsqrt(sum(sums(*(x * x for x in c), axis=1)) / R + eps)  # [group]
        return [(x * inv[:, None] * sc).astype(dt) for x, sc in zip(c, scales)]

    @pl.when(r < Rkv // block_r)
    def _absorbed():  # q_nope, then rows [r·block_r, (r+1)·block_r) of its absorption
        w_nope = [wq_ref[pl.ds(at, n), pl.ds(pl.multiple_of(h * Dq, Dq), nope)] for at, n in parts]  # [n, dn] each
        w_k = wk_ref[pl.ds(pl.multiple_of(r * block_r, block_r), block_r), pl.ds(pl.multiple_of(h * Dkv, Dkv), nope)]
        normed = normed_q_a()
        q_nope = sum(dot_f32(x, w, ((1,), (0,))) for x, w in zip(normed, w_nope)).astype(dt)  # q_b's output, rounded
        q_c = sum(dot_f32(q_nope, w, ((1,), (1,))) for w in bf16_parts(w_k))  # [group, block_r]
        plgpu.store(qc_ref.at[rows[:, None], cols(h * Rkv + r * block_r, block_r)], q_c, mask=live[:, None])

    @pl.when(r == Rkv // block_r)
    def _rope():  # a program of its own: no program's products wait for the rope columns' trip from HBM
        start = pl.multiple_of(h * Dq + nope, math.gcd(Dq, nope))
        w_rope = [wq_ref[pl.ds(at, n), pl.ds(start, Dq - nope)] for at, n in parts]
        normed = normed_q_a()
        q_rope = sum(dot_f32(x, w, ((1,), (0,))) for x, w in zip(normed, w_rope)).astype(dt).astype(f32)
        dr = Dq - nope
        plgpu.store(qr_ref.at[rows[:, None], cols(h * dr, dr)], q_rope, mask=live[:, None])


@functools.partial(jax.jit, static_argnames=("offset", "nope_dim", "eps", "tiles", "interpret"))
def absorbed_query(y: Float[Array, "rows N"], scale: Float[Array, "R"], w_qb: Float[Array, "R H Dq"],
                   w_kv_b: Float[Array, "Rkv H Dkv"], *, offset: int, nope_dim: int, eps: float,
                   tiles: QueryTiles = QueryTiles(), interpret: bool = False):
    """``(q_c [rows, H, Rkv], q_rope [rows, H, Dq - nope_dim])`` in float32 from ``q_a = y[:, offset:offset+R]``:
    ``q = W_qb·RMSNorm(q_a; scale, eps)`` (in ``W_qb``'s dtype), ``q_c = q[:, :, :nope_dim]·W_k`` with
    ``W_k = w_kv_b[:, :, :nope_dim]``."""
    check_inputs(y, scale, w_qb, w_kv_b, offset=offset, nope_dim=nope_dim, tiles=tiles)
    rows, (R, H, Dq), (Rkv, _, Dkv) = y.shape[0], w_qb.shape, w_kv_b.shape
    br, dr = block_r(Rkv, tiles), Dq - nope_dim
    whole = lambda a: pl.BlockSpec(a.shape, lambda h, r: (0,) * a.ndim)
    out_shape = [jax.ShapeDtypeStruct((rows, H * Rkv), jnp.float32), jax.ShapeDtypeStruct((rows, H * dr), jnp.float32)]
    # the heads flattened into the columns (free reshapes): every load and store is a 2-D tile
    args = (y, scale, w_qb.reshape(R, H * Dq), w_kv_b.reshape(Rkv, H * Dkv))
    q_c, q_rope = pl.pallas_call(
        functools.partial(_kernel, offset=offset, R=R, Dq=Dq, nope=nope_dim, Rkv=Rkv, Dkv=Dkv, block_r=br,
                          group=max(16, pl.next_power_of_2(rows)), eps=eps),
        grid=(H, Rkv // br + 1),  # the last program of a head: its rope part
        in_specs=[whole(a) for a in args],
        out_specs=[whole(o) for o in out_shape],
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=interpret, name="mla_decode_query",
    )(*args)
    return q_c.reshape(rows, H, Rkv), q_rope.reshape(rows, H, dr)


__all__ = ["MAX_HEAD_BYTES", "MAX_ROWS", "PIECE", "QueryTiles", "absorbed_query", "accepts", "bf16_parts", "block_r",
           "check_inputs", "dot_f32", "pieces"]
