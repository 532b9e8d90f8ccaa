"""MLA decode attention on the GPU: absorbed queries over the compressed cache, split along the keys.

XLA runs :func:`reference_decode.cached_attention_reference` as 8–11 kernels per MLA layer (the two
logit products, masks and pads, the softmax, the weighted latent): on ``small()`` at batch 64, 72 µs
a layer for the 45 MB of cache it reads (0.6 TB/s; ``benchmarks/RESULTS.md``, stop 49), at batch 1
14.5 µs for 0.7 MB. Here one Pallas-Triton kernel reads each cache row once for all of a sequence's
query rows (every head and new token: ``T·H`` rows in groups of a power of two — one group for
``small()``'s 8 heads, three of 32 for K3's 96 over its 512-wide latent). Program ``(b, g, s)`` takes
row group ``g`` of sequence ``b`` and split ``s`` of the key tiles up to the furthest row any of its
queries sees, runs the online softmax over them (logits and ``p·c`` as bf16 tensor-core products:
the cache rows are bf16, the fp32 query and probabilities enter as two bf16 parts each, ~16 mantissa
bits) and writes its unnormalised output with its row max and sum; a short XLA epilogue merges the
splits. Splits are chosen so that ``B × groups × splits`` fills the GPU (``SPLIT_PROGRAMS``); a split
past every query's reach reads nothing. Against XLA (``benchmarks/bench_mla_decode.py``): 1.6× at
batch 1, 2.2× at batch 64, 5.6× at K3's widths over a 32 K cache.

Same contract as the reference: keys at ``s <= last[b, t]``, rows past the cache see all of it.
``interpret=True`` runs the kernel in the CPU interpreter (the default suite's test).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels.triton_blocks import is_block_dim

SPLIT_PROGRAMS = 256  # programs to aim for over (sequence, split): about two per SM of an H100/H200
NUM_WARPS = 4  # per 8 K accumulator elements (K3's [32, 512] groups: 8)
# cache tiles in flight a program: small()'s batch 64 27.4 µs a call against 30.1 with 2 and 37.0 with 1, K3's
# widths over 32 K at batch 1 / 8 127.5 / 817.2 against 137.7 / 907.2 with 2 (H100, stop 69; at small()'s batch 64
# 8 warps 38.0, 32-row tiles 32.4, 128 / 512 programs 32.0 / 32.2)
NUM_STAGES = 3
MAX_ACC = 64 * 256  # fp32 accumulator elements per program (query rows × latent width)
# Query rows (new tokens × heads) up to which ``implementation=None`` takes the kernel: every row group
# reads the whole cache, and a call of many new tokens is chunked prefill's (timed: T = 1, K3's 96 heads)
DEFAULT_MAX_ROWS = 512


def row_groups(tokens: int, heads: int, width: int) -> tuple[int, int]:
    """``(groups, rows per group)`` for ``tokens · heads`` query rows of latent ``width``: a group is a
    power of two >= 16 rows whose fp32 accumulator fits ``MAX_ACC``; each is a program of its own
    (K3's 96 heads over a 512-wide latent: 3 groups of 32)."""
    rows = tokens * heads
    per = min(max(16, pl.next_power_of_2(rows)), max(16, MAX_ACC // width))
    return -(-rows // per), per


def key_block(latent_width: int, length: int) -> int:
    """Cache rows per tile: 64, or 32 for latents wider than 256 (the tile stays <= 32 KB), at most
    the cache's ``length`` (a power of two)."""
    return min(64 if latent_width <= 256 else 32, 1 << (length.bit_length() - 1))


def check_inputs(q_c, q_r, latent, last) -> None:
    """Raise ``ValueError`` naming the argument when the kernel cannot take these inputs."""
    if q_c.ndim != 4 or q_r.shape[:3] != q_c.shape[:3] or latent.ndim != 3 or last.shape != q_c.shape[:2]:
        raise ValueError(f"q_c must be [B, T, H, R], q_r [B, T, H, dr], latent [B, S, R + dr], last [B, T]; got "
                         f"{q_c.shape}, {q_r.shape}, {latent.shape}, {last.shape}")
    B, T, H, R = q_c.shape
    dr = q_r.shape[-1]
    if latent.shape[0] != B or latent.shape[2] != R + dr:
        raise ValueError(f"latent must be [B, S, R + dr] = [{B}, S, {R + dr}], got {latent.shape}")
    if not (is_block_dim(R) and is_block_dim(dr)):
        raise ValueError(f"the decode kernel needs R (q_c.shape[-1]={R}) and dr (q_r.shape[-1]={dr}) "
                         "powers of two >= 16")
    if 16 * R > MAX_ACC:
        raise ValueError(f"the decode kernel takes R (q_c.shape[-1]) <= {MAX_ACC // 16}, got {R}")
    if latent.dtype != jnp.bfloat16:
        raise ValueError(f"the decode kernel reads a bf16 cache (latent), got {latent.dtype}")
    if latent.shape[1] < 16:
        raise ValueError(f"the decode kernel needs a cache of >= 16 rows (latent.shape[1]), got {latent.shape[1]}")
    if any(jnp.dtype(x.dtype) == jnp.float64 for x in (q_c, q_r)):
        raise ValueError("the decode kernel takes no float64 input (Triton); use implementation='xla'")


def accepts(q_c, q_r, latent, last) -> bool:
    """What ``implementation=None`` asks: :func:`check_inputs` takes these inputs and they are a decode
    call's few rows (``T·H <= DEFAULT_MAX_ROWS``)."""
    try:
        check_inputs(q_c, q_r, latent, last)
    except ValueError:
        return False
    return q_c.shape[1] * q_c.shape[2] <= DEFAULT_MAX_ROWS


def splits_for(batch: int, tiles: int) -> tuple[int, int]:
    """``(splits, tiles per split)`` for ``batch`` sequences of ``tiles`` key tiles."""
    per = -(-tiles // max(1, min(tiles, -(-SPLIT_PROGRAMS // batch))))
    return -(-tiles // per), per


def _split(x):
    """fp32 ``x`` as ``(hi, lo)`` bf16 parts, ``x ≈ hi + lo`` to ~16 mantissa bits."""
    hi = x.astype(jnp.bfloat16)
    return hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def _dot(parts, b, contract):
    """``Σ part · b`` over bf16 ``parts`` of an fp32 operand and a bf16 ``b`` (exact: cache rows are
    bf16), fp32 accumulation on the tensor cores."""
    out = None
    for a in parts:
        y = jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)
        out = y if out is None else out + y
    return out


def _rows(ref, rows, cols, n: int):
    """``ref[rows, cols]`` in fp32, rows clamped to the ``n`` real ones (the interpreter's gather stays
    in bounds); padding rows read as zeros where the load is masked (``cols`` given)."""
    idx = jnp.minimum(rows, n - 1)
    if cols is None:
        return ref[idx]
    return plgpu.load(ref.at[idx[:, None], cols[None, :]], mask=(rows < n)[:, None], other=0).astype(jnp.float32)


def _kernel(qc_ref, qr_ref, last_ref, lat_ref, o_ref, m_ref, l_ref, *, scale: float, block_s: int, per: int,
            group: int):
    f32 = jnp.float32
    S, C = lat_ref.shape
    n_rows, R = qc_ref.shape
    rows = pl.program_id(1) * group + jnp.arange(group)  # this program's query rows (token-major)
    last = _rows(last_ref, rows, None, n_rows)  # [Mg]: padding rows repeat the last real row's
    qc = _split(_rows(qc_ref, rows, jnp.arange(R), n_rows) * scale)  # [Mg, R] as two bf16 parts
    qr = _split(_rows(qr_ref, rows, jnp.arange(qr_ref.shape[1]), n_rows) * scale)  # [Mg, dr]
    reach = jnp.minimum(jnp.max(last), S - 1)  # the furthest cache row any query sees
    first = pl.program_id(2) * per
    stop = jnp.minimum(first + per, reach // block_s + 1)

    def tile(j):
        """Tile ``j``'s cache rows ``[c, k_r]`` (bf16) and positions: contiguous loads kept inside the
        cache, the last tile ending at its end (its rows before ``j·block_s`` are the previous tile's,
        and are not counted again)."""
        start = jnp.minimum(j * block_s, S - block_s)
        rows = pl.ds(start, block_s)
        return (lat_ref[rows, pl.ds(0, R)], lat_ref[rows, pl.ds(R, C - R)],
                start + jnp.arange(block_s), j * block_s)

    def body(j, carry):
        m, l, acc = carry
        c, r, pos, fresh = tile(j)  # [BS, R], [BS, dr], [BS], the tile's first new position
        logits = _dot(qc, c, ((1,), (1,))) + _dot(qr, r, ((1,), (1,)))  # [M, BS]
        seen = (pos[None, :] <= last[:, None]) & (pos[None, :] >= fresh)  # [M, BS]
        logits = jnp.where(seen, logits, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with nothing seen yet stays at 0
        p = jnp.where(seen, jnp.exp(logits - shift[:, None]), 0.0)
        fix = jnp.exp(m - shift)
        return m_new, l * fix + jnp.sum(p, axis=1), acc * fix[:, None] + _dot(_split(p), c, ((1,), (0,)))

    M = last.shape[0]
    init = (jnp.full((M,), -jnp.inf, f32), jnp.zeros((M,), f32), jnp.zeros((M, R), f32))
    m, l, acc = jax.lax.fori_loop(first, jnp.maximum(stop, first), body, init)
    o_ref[...], m_ref[...], l_ref[...] = acc, m, l


def split_shape(q_c, latent) -> tuple[int, int, int, int]:
    """``(B, n, M, R)``: :func:`split_outputs`' ``o`` for these inputs (``n`` splits, ``M`` query rows in
    whole row groups)."""
    B, T, H, R = q_c.shape
    G, Mg = row_groups(T, H, R)
    n, _ = splits_for(B * G, -(-latent.shape[1] // key_block(R, latent.shape[1])))
    return B, n, G * Mg, R


def split_outputs(q_c: Float[Array, "B T H R"], q_r: Float[Array, "B T H K"], latent: Float[Array, "B S C"],
                  last: Int[Array, "B T"], *, scale: float, interpret: bool = False):
    """The kernel: per split ``(o [B, n, M, R], row max [B, n, M], row sum [B, n, M])``, fp32, unnormalised;
    ``M`` covers the ``T·H`` query rows (token-major) in whole row groups."""
    B, T, H, R = q_c.shape
    S, dr = latent.shape[1], q_r.shape[-1]
    G, Mg = row_groups(T, H, R)
    M, block_s = G * Mg, key_block(R, S)
    n, per = splits_for(B * G, -(-S // block_s))
    TH = T * H
    qc, qr = q_c.reshape(B, TH, R), q_r.reshape(B, TH, dr)
    rows_last = jnp.repeat(last.astype(jnp.int32), H, axis=1)  # [B, TH]
    per_row = lambda w: pl.BlockSpec((None, TH, w), lambda b, g, s: (b, 0, 0))  # rows padded in the kernel
    per_split = lambda *tail: pl.BlockSpec((None, None, Mg) + tail, lambda b, g, s: (b, s, g) + (0,) * len(tail))
    return pl.pallas_call(
        functools.partial(_kernel, scale=scale, block_s=block_s, per=per, group=Mg),
        grid=(B, G, n),
        in_specs=[per_row(R), per_row(dr), pl.BlockSpec((None, TH), lambda b, g, s: (b, 0)),
                  pl.BlockSpec((None, S, R + dr), lambda b, g, s: (b, 0, 0))],
        out_specs=[per_split(R), per_split(), per_split()],
        out_shape=[jax.ShapeDtypeStruct((B, n, M, R), jnp.float32), jax.ShapeDtypeStruct((B, n, M), jnp.float32),
                   jax.ShapeDtypeStruct((B, n, M), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS * max(1, Mg * R // 8192),
                                             num_stages=NUM_STAGES),
        interpret=interpret, name="mla_decode_attention",
    )(qc, qr, rows_last, latent)


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def cached_attention_pallas(q_c: Float[Array, "B T H R"], q_r: Float[Array, "B T H K"],
                            latent: Float[Array, "B S C"], last: Int[Array, "B T"], *, scale: float,
                            interpret: bool = False) -> Float[Array, "B T H R"]:
    """``reference_decode.cached_attention_reference`` (same arguments) by the kernel and a merge of its splits."""
    check_inputs(q_c, q_r, latent, last)
    B, T, H, R = q_c.shape
    o, m, l = split_outputs(q_c, q_r, latent, last, scale=scale, interpret=interpret)
    top = jnp.max(m, axis=1, keepdims=True)  # [B, 1, M]: finite, every row sees key 0
    w = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - top))  # splits that saw nothing weigh 0
    out = jnp.sum(o * w[..., None], axis=1) / jnp.sum(l * w, axis=1)[..., None]  # [B, M, R]
    return out[:, :T * H].reshape(B, T, H, R).astype(jnp.promote_types(q_c.dtype, jnp.float32))


__all__ = ["accepts", "cached_attention_pallas", "check_inputs", "row_groups", "split_outputs", "split_shape"]
