"""Causal MLA flash attention with document masks in Pallas (Triton backend): forward and backward.

FlashAttention-2 (arXiv:2307.08691) Alg. 1 (forward) and Alg. 2 split into a dK/dV kernel and a
dQ kernel, for the MLA shapes of SPEC §3: the logits are ``q_nope·k_nope + q_rope·k_rope`` with
one ``k_rope`` shared by every head (MQA), so the rope key is read once per (batch, key block)
and never broadcast to heads in memory; values have their own width.

Masks: queries ``[B,T]`` sit at absolute positions ``q_start[b] + t`` (``q_start [B]`` traced int32:
context parallel gives each shard its own, chunked prefill each row its cache length), keys
``[B,S]`` at ``s``; key ``s`` is visible from
query ``t`` iff ``s <= q_start + t`` and ``k_seg[s] == q_seg[t]``. Key blocks wholly past the
diagonal are skipped by the loop bounds (forward and dQ loop over keys up to the block's last
query; dK/dV starts at the first query block that reaches the key block), and so are the blocks
whose document id ranges cannot meet (:func:`document_bounds`: forward and dQ start at the first
key block that can share an id with the query block, dK/dV ends after the last such query block;
with documents in order, the other documents' blocks); blocks in between are computed and masked,
so any segment ids stay exact. Both came in stop 40: on the H200 at K3's width (B 1, T 8192,
H 96) fwd+bwd 21.43 → 20.22 ms without documents, 20.84 → 5.76 ms with 6 and 20.89 → 3.61 ms with 24
documents. Within those bounds the backward kernels' loops run in three parts: the run of tiles
that lie wholly before the diagonal within one document (:func:`full_runs`) without the mask's
compares, the tiles before and after it with them. The forward keeps one loop and tests each tile
(:func:`_tile_full`, a ``lax.cond`` around the compares): its iterations are light, and restarting
its pipeline three times cost more than the compares (stop 46, H200, K3 width, one process: three
loops against one, forward 5.57 / 5.63 ms without documents, 1.58 / 1.51 ms with 6, 0.79 / 0.68 ms
with 24; three loops in the backward: fwd+bwd 20.27 → 19.48 ms without documents, backward alone
4.23 → 4.21 ms with 6 and 2.65 → 2.56 ms with 24). Every real row sees at least its own key (callers
pass ``q_seg[t] == k_seg[q_start + t]``), so its running max ends finite: the forward also returns
that row max of the scaled logits (QK-Clip's ``max_logit``, SPEC §7); ``T == S``, ``q_start = 0``: causal.

Inputs are bf16 and the matmuls accumulate in fp32; the softmax statistics, the output and the
gradient accumulators are fp32 (SPEC §10). ``T`` and ``S`` must be multiples of their blocks;
head widths powers of two (>= 16): ``ops.py`` pads.

Backend: Pallas-Triton (deprecated since JAX 0.11, present in 0.11.2) runs the document mask and
the backward kernels with plain tile code, and under the CPU interpreter for the default tests. The
forward has a Mosaic GPU port (:mod:`kernel_gpu_fwd`, the default where it takes the call); this
one serves float32 outputs (context parallel) and the shapes that one does not take.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels import int_ops

LOG2E = math.log2(math.e)
# Finite "minus infinity" for masked logits: (MASK - m) never forms inf - inf (Triton-safe).
MASK = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile rows of the Triton kernels (powers of two) and their launch parameters; ``mosaic_forward``
    runs the forward on :mod:`kernel_gpu_fwd` instead where it takes the call (its own tiles)."""

    block_q: int = 128  # forward: query rows per program
    block_k: int = 64  # forward: key rows per loop step
    block_q_dkv: int = 64  # dK/dV: query rows per loop step
    block_k_dkv: int = 128  # dK/dV: key rows per program
    block_q_dq: int = 128  # dQ: query rows per program
    block_k_dq: int = 64  # dQ: key rows per loop step
    num_warps: int = 8
    num_stages: int = 3
    num_warps_bwd: int = 8
    num_stages_bwd: int = 3  # 2 is 7-10 % slower fwd+bwd on the H200 (RESULTS.md, stop 34)
    mosaic_forward: bool = True  # 1.75x the Triton forward at K3 width on the H200 (RESULTS.md, stop 47)

    @property
    def blocks(self) -> tuple[int, ...]:
        return self.query_blocks + self.key_blocks

    @property
    def query_blocks(self) -> tuple[int, ...]:
        return (self.block_q, self.block_q_dkv, self.block_q_dq)

    @property
    def key_blocks(self) -> tuple[int, ...]:
        return (self.block_k, self.block_k_dkv, self.block_k_dq)

    def clipped(self, length: int, key_length: int | None = None) -> "BlockSizes":
        """Query blocks no longer than ``length`` and key blocks no longer than ``key_length``
        (default ``length``), rounded up to a power of two (>= 16), for short sequences."""
        cap = lambda n: max(16, pl.next_power_of_2(n))
        q_cap, k_cap = cap(length), cap(length if key_length is None else key_length)
        names = dict(block_q=q_cap, block_q_dkv=q_cap, block_q_dq=q_cap, block_k=k_cap, block_k_dkv=k_cap,
                     block_k_dq=k_cap)
        return dataclasses.replace(self, **{n: min(getattr(self, n), c) for n, c in names.items()})


def _logits(qn, qr, kn, kr, scale):
    """Scaled ``q·kᵀ`` of one tile pair, [rows of q, rows of k] in fp32; the backward kernels pass
    ``scale·log2 e`` (logits in log2 units: each probability is one ``exp2`` of a difference)."""
    return (plgpu.dot(qn, kn, trans_b=True) + plgpu.dot(qr, kr, trans_b=True)) * scale


def _visible(q_start, k_start, q_seg, k_seg, block_q: int, block_k: int, keys_first: bool = False):
    """Causal ∧ same-document mask of one tile: [queries, keys], or [keys, queries] if ``keys_first``."""
    q_pos = q_start + jnp.arange(block_q)
    k_pos = k_start + jnp.arange(block_k)
    if keys_first:
        return (k_pos[:, None] <= q_pos[None, :]) & (k_seg[:, None] == q_seg[None, :])
    return (q_pos[:, None] >= k_pos[None, :]) & (q_seg[:, None] == k_seg[None, :])


def _tile_full(q_start, k_start, block_k: int, qdoc_ref, qi, kdoc_ref, kj):
    """Whether every key of a tile is visible from every query: the key block ends at or before the
    query block's first position and both blocks lie in one document (each block's least and
    greatest id, :func:`document_blocks`, all equal). Such tiles skip the mask."""
    doc = qdoc_ref[0, qi]
    same = (doc == qdoc_ref[1, qi]) & (doc == kdoc_ref[0, kj]) & (doc == kdoc_ref[1, kj])
    return (k_start + block_k - 1 <= q_start) & same


def _masked(s, full, visible):
    """``s`` where ``visible()`` holds, ``MASK`` elsewhere; the position and document compares are
    only evaluated on tiles that are not ``full``."""
    return lax.cond(full, lambda s: s, lambda s: jnp.where(visible(), s, MASK), s)


def document_blocks(seg: Int[Array, "B L"], block: int) -> Int[Array, "B 2 n"]:
    """Each ``block`` rows' least and greatest document id ``[B, 2, L/block]`` (equal: one document)."""
    B, L = seg.shape
    tiles = seg.reshape(B, L // block, block)
    return jnp.stack([jnp.min(tiles, axis=-1), jnp.max(tiles, axis=-1)], axis=1)


def document_bounds(qdoc: Int[Array, "B 2 nq"], kdoc: Int[Array, "B 2 nk"]):
    """``(first key block [B, nq], query block end [B, nk])``: per query block the first key block,
    and per key block one past the last query block, whose document id ranges meet. Tiles outside
    hold no visible pair (every id differs), so the loops skip them: with documents in order, the
    keys of earlier documents and the queries of later ones. A block that meets none keeps the
    whole range (padding)."""
    meets = (kdoc[:, None, 1, :] >= qdoc[:, 0, :, None]) & (kdoc[:, None, 0, :] <= qdoc[:, 1, :, None])
    first = jnp.argmax(meets, axis=2)
    end = meets.shape[1] - jnp.argmax(meets[:, ::-1, :], axis=1)
    return first.astype(jnp.int32), jnp.where(jnp.any(meets, axis=1), end, meets.shape[1]).astype(jnp.int32)


def full_runs(qdoc: Int[Array, "B 2 nq"], kdoc: Int[Array, "B 2 nk"], q_start: Int[Array, "B"], block_q: int,
              block_k: int, keys_major: bool = False) -> Int[Array, "B 2 n"]:
    """Per query block the run ``[lo, hi)`` of key blocks (with ``keys_major``, per key block the run
    of query blocks) from the first whose tile is wholly visible — both blocks in one document, the
    key block ending at or before the query block's first position — up to the next that is not:
    the kernels compute those tiles without the mask. Empty ``(0, 0)`` where no tile is wholly
    visible; tiles outside the run keep the mask, so any segment ids stay exact."""
    nq, nk = qdoc.shape[-1], kdoc.shape[-1]
    doc = qdoc[:, 0, :, None]
    same = (doc == qdoc[:, 1, :, None]) & (doc == kdoc[:, None, 0, :]) & (doc == kdoc[:, None, 1, :])
    k_last = jnp.arange(nk) * block_k + block_k - 1
    causal = k_last[None, None, :] <= q_start[:, None, None] + (jnp.arange(nq) * block_q)[None, :, None]
    full = same & causal  # [B, nq, nk]
    if keys_major:
        full = full.transpose(0, 2, 1)
    lo = jnp.argmax(full, axis=2)
    after = (jnp.arange(full.shape[2])[None, None, :] >= lo[..., None]) & ~full
    hi = jnp.where(jnp.any(after, axis=2), jnp.argmax(after, axis=2), full.shape[2])
    some = jnp.any(full, axis=2)
    return jnp.stack([jnp.where(some, lo, 0), jnp.where(some, hi, 0)], axis=1).astype(jnp.int32)


def _runs(start, stop, full_ref, block):
    """``(start, lo, hi, stop)`` loop bounds: ``[start, lo)`` and ``[hi, stop)`` masked, ``[lo, hi)``
    (block ``block``'s :func:`full_runs` entry clipped into ``[start, stop]``) without the mask."""
    lo = jnp.clip(full_ref[0, block], start, stop)
    return start, lo, jnp.clip(full_ref[1, block], lo, stop), stop


def _loops(bounds, step, init):
    """The three loops of :func:`_runs`' bounds, ``step(masked)`` giving each one's body."""
    start, lo, hi, stop = bounds
    carry = lax.fori_loop(start, lo, step(True), init)
    carry = lax.fori_loop(lo, hi, step(False), carry)
    return lax.fori_loop(hi, stop, step(True), carry)


def _first_key_block(first, num_k):
    """The forward's and dQ's loop start: the first key block that can share a document, but never
    past the last causal one (a block of padded rows meets no document and still gets one visit,
    as before the document bounds) and 0 when there is none (a key chunk wholly after the block:
    no visit, the caller's rule)."""
    return jnp.minimum(first, jnp.maximum(num_k - 1, 0))


def _num_key_blocks(q_last, block_k: int, num_k_blocks: int):
    """Key blocks that hold a key at or before position ``q_last``: the causal loop bound."""
    return jnp.minimum(int_ops.div(q_last + block_k, block_k), num_k_blocks)


def _fwd_kernel(off_ref, qn_ref, qr_ref, kn_ref, kr_ref, v_ref, qseg_ref, kseg_ref, qdoc_ref, kdoc_ref, first_ref,
                o_ref, lse_ref, mx_ref, *,
                scale: float, block_q: int, block_k: int, num_q_blocks: int, num_k_blocks: int):
    i = num_q_blocks - 1 - pl.program_id(0)  # longest rows first: shorter tail
    q0 = off_ref[0] + i * block_q  # absolute position of the block's first query
    qn, qr = qn_ref[...], qr_ref[...]
    q_seg = qseg_ref[pl.ds(i * block_q, block_q)]

    def body(j, carry):
        acc, m, l = carry
        keys = pl.ds(j * block_k, block_k)
        s, k_seg = _logits(qn, qr, kn_ref[keys, :], kr_ref[keys, :], scale), kseg_ref[keys]
        full = _tile_full(q0, j * block_k, block_k, qdoc_ref, i, kdoc_ref, j)
        s = _masked(s, full, lambda: _visible(q0, j * block_k, q_seg, k_seg, block_q, block_k))
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp2((s - m_new[:, None]) * LOG2E)
        fix = jnp.exp2((m - m_new) * LOG2E)
        acc = acc * fix[:, None] + plgpu.dot(p.astype(v_ref.dtype), v_ref[keys, :])
        return acc, m_new, l * fix + jnp.sum(p, axis=1)

    init = (jnp.zeros((block_q, o_ref.shape[-1]), jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
            jnp.zeros((block_q,), jnp.float32))
    num_k = _num_key_blocks(q0 + block_q - 1, block_k, num_k_blocks)
    acc, m, l = lax.fori_loop(_first_key_block(first_ref[i], num_k), num_k, body, init)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)
    mx_ref[...] = m


def _dkdv_kernel(off_ref, qn_ref, qr_ref, kn_ref, kr_ref, v_ref, qseg_ref, kseg_ref, end_ref, full_ref,
                 do_ref, lse_ref, delta_ref, dkn_ref, dkr_ref, dv_ref, *, scale: float, block_q: int, block_k: int):
    j = pl.program_id(0)
    off = off_ref[0]
    kn, kr, v = kn_ref[...], kr_ref[...], v_ref[...]
    k_seg = kseg_ref[pl.ds(j * block_k, block_k)]

    def step(masked: bool):
        def body(i, carry):
            dkn, dkr, dv = carry
            rows = pl.ds(i * block_q, block_q)
            qn, qr, do = qn_ref[rows, :], qr_ref[rows, :], do_ref[rows, :]
            # Transposed tiles [keys, queries]: every product below reads its loaded operands as stored.
            s_t = _logits(kn, kr, qn, qr, scale * LOG2E)  # log2 units
            if masked:
                visible = _visible(off + i * block_q, j * block_k, qseg_ref[rows], k_seg, block_q, block_k,
                                   keys_first=True)
                s_t = jnp.where(visible, s_t, MASK)
            p_t = jnp.exp2(s_t - (lse_ref[rows] * LOG2E)[None, :])
            dv = dv + plgpu.dot(p_t.astype(do.dtype), do)
            dp_t = plgpu.dot(v, do, trans_b=True)
            ds_t = (p_t * (dp_t - delta_ref[rows][None, :])).astype(qn.dtype)
            return dkn + plgpu.dot(ds_t, qn), dkr + plgpu.dot(ds_t, qr), dv
        return body

    zeros = lambda ref: jnp.zeros((block_k, ref.shape[-1]), jnp.float32)
    # The first query block holding a position >= this key block's first key (clamped at 0: a
    # truncating division of a negative numerator is >= the floor, and 0 bounds both).
    first = jnp.maximum(int_ops.div(j * block_k - off, block_q), 0)
    bounds = _runs(first, jnp.maximum(end_ref[j], first), full_ref, j)
    dkn, dkr, dv = _loops(bounds, step, (zeros(dkn_ref), zeros(dkr_ref), zeros(dv_ref)))
    dkn_ref[...] = (dkn * scale).astype(dkn_ref.dtype)
    dkr_ref[...] = dkr * scale
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(off_ref, qn_ref, qr_ref, kn_ref, kr_ref, v_ref, qseg_ref, kseg_ref, first_ref, full_ref,
               do_ref, lse_ref, delta_ref, dqn_ref, dqr_ref, *, scale: float, block_q: int, block_k: int,
               num_q_blocks: int, num_k_blocks: int):
    i = num_q_blocks - 1 - pl.program_id(0)
    q0 = off_ref[0] + i * block_q
    qn, qr, do = qn_ref[...], qr_ref[...], do_ref[...]
    q_seg = qseg_ref[pl.ds(i * block_q, block_q)]
    lse2, delta = lse_ref[...] * LOG2E, delta_ref[...]

    def step(masked: bool):
        def body(j, carry):
            dqn, dqr = carry
            keys = pl.ds(j * block_k, block_k)
            kn, kr = kn_ref[keys, :], kr_ref[keys, :]
            s = _logits(qn, qr, kn, kr, scale * LOG2E)  # log2 units
            if masked:
                s = jnp.where(_visible(q0, j * block_k, q_seg, kseg_ref[keys], block_q, block_k), s, MASK)
            p = jnp.exp2(s - lse2[:, None])
            dp = plgpu.dot(do, v_ref[keys, :], trans_b=True)
            ds = (p * (dp - delta[:, None])).astype(kn.dtype)
            return dqn + plgpu.dot(ds, kn), dqr + plgpu.dot(ds, kr)
        return body

    zeros = lambda ref: jnp.zeros((block_q, ref.shape[-1]), jnp.float32)
    num_k = _num_key_blocks(q0 + block_q - 1, block_k, num_k_blocks)
    bounds = _runs(_first_key_block(first_ref[i], num_k), num_k, full_ref, i)
    dqn, dqr = _loops(bounds, step, (zeros(dqn_ref), zeros(dqr_ref)))
    dqn_ref[...] = (dqn * scale).astype(dqn_ref.dtype)
    dqr_ref[...] = (dqr * scale).astype(dqr_ref.dtype)


# The query offset of each row ``[B]``: one int32 read by every program of that row.
OFFSET_SPEC = pl.BlockSpec((1,), lambda i, b, h: (b,))


def _tiles(length: int, block: int, reverse: bool):
    """BlockSpecs over grid (block index, b, h) tiling a ``[B,length,...]`` operand: ``[B,T,H,*]``
    tiles, the shared ``[B,T,dr]`` rope key and ``[B,H,T]`` row statistics."""
    n = length // block
    blk = (lambda i: n - 1 - i) if reverse else (lambda i: i)
    return dict(
        heads=lambda d: pl.BlockSpec((None, block, None, d), lambda i, b, h: (b, blk(i), h, 0)),
        rope=lambda d: pl.BlockSpec((None, block, d), lambda i, b, h: (b, blk(i), 0)),
        rows=pl.BlockSpec((None, None, block), lambda i, b, h: (b, h, blk(i))),
    )


def _documents(q_seg, k_seg, q_start, block_q: int, block_k: int, keys_major: bool, runs: bool = True):
    """``(operands, BlockSpecs)`` of the document tests, each row b's to every program of it: the
    loop bound of :func:`document_bounds` the kernel needs (its first key block per query block, or
    with ``keys_major`` its query block end per key block), and then the backward kernels'
    :func:`full_runs` or the forward's per-tile test operands (both sides' :func:`document_blocks`)."""
    qdoc, kdoc = document_blocks(q_seg, block_q), document_blocks(k_seg, block_k)
    bound = document_bounds(qdoc, kdoc)[1 if keys_major else 0]
    row = lambda a: pl.BlockSpec((None,) + a.shape[1:], lambda i, b, h: (b,) + (0,) * (a.ndim - 1))
    ops = [bound, full_runs(qdoc, kdoc, q_start, block_q, block_k, keys_major)] if runs else [qdoc, kdoc, bound]
    return ops, [row(a) for a in ops]


def _whole(length: int):
    """BlockSpecs of a whole ``[B,length,...]`` operand per (b, h) program, as in :func:`_tiles`."""
    return dict(
        heads=lambda d: pl.BlockSpec((None, length, None, d), lambda i, b, h: (b, 0, h, 0)),
        rope=lambda d: pl.BlockSpec((None, length, d), lambda i, b, h: (b, 0, 0)),
        seg=pl.BlockSpec((None, length), lambda i, b, h: (b, 0)),
        rows=pl.BlockSpec((None, None, length), lambda i, b, h: (b, h, 0)),
    )


def flash_forward(qn: Float[Array, "B T H N"], qr: Float[Array, "B T H R"], kn: Float[Array, "B S H N"],
                  kr: Float[Array, "B S R"], v: Float[Array, "B S H V"], q_seg: Int[Array, "B T"],
                  k_seg: Int[Array, "B S"], q_start: Int[Array, "B"], *, scale: float, blocks: BlockSizes,
                  interpret: bool = False, out_dtype=jnp.float32):
    """``(o [B,T,H,V] in out_dtype, lse [B,H,T], row max [B,H,T])`` of causal same-document attention,
    query ``t`` of row ``b`` at position ``q_start[b] + t`` and key ``s`` at ``s``. ``out_dtype``: float32
    for a caller that merges partial outputs (context parallel's key chunks), else the inputs' dtype."""
    B, T, H, N = qn.shape
    S, R, V = kn.shape[1], qr.shape[-1], v.shape[-1]
    bq, bk = blocks.block_q, blocks.block_k
    tile, whole = _tiles(T, bq, True), _whole(S)
    docs, doc_specs = _documents(q_seg, k_seg, q_start, bq, bk, keys_major=False, runs=False)
    kernel = functools.partial(_fwd_kernel, scale=scale, block_q=bq, block_k=bk, num_q_blocks=T // bq,
                               num_k_blocks=S // bk)
    rows = jax.ShapeDtypeStruct((B, H, T), jnp.float32)
    return pl.pallas_call(
        kernel, grid=(T // bq, B, H),
        in_specs=[OFFSET_SPEC, tile["heads"](N), tile["heads"](R), whole["heads"](N), whole["rope"](R),
                  whole["heads"](V), _whole(T)["seg"], whole["seg"], *doc_specs],
        out_specs=[tile["heads"](V), tile["rows"], tile["rows"]],
        out_shape=[jax.ShapeDtypeStruct((B, T, H, V), out_dtype), rows, rows],
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret, name="mla_flash_fwd",
    )(q_start, qn, qr, kn, kr, v, q_seg, k_seg, *docs)


def flash_backward(qn, qr, kn, kr, v, q_seg, k_seg, q_start, do: Float[Array, "B T H V"],
                   lse: Float[Array, "B H T"], delta: Float[Array, "B H T"], *, scale: float, blocks: BlockSizes,
                   interpret: bool = False, dq_dtype=None):
    """``(dqn, dqr, dkn, dkr per head [B,S,H,R] f32, dv)``: the caller sums ``dkr`` over heads.
    ``dq_dtype`` (default ``qn``'s): ``float32`` for a caller that sums ``dq`` over several calls."""
    B, T, H, N = qn.shape
    S, R, V = kn.shape[1], qr.shape[-1], v.shape[-1]
    params = plgpu.CompilerParams(num_warps=blocks.num_warps_bwd, num_stages=blocks.num_stages_bwd)
    operands = (q_start, qn, qr, kn, kr, v, q_seg, k_seg)
    cotangents = (do, lse, delta)

    bq, bk = blocks.block_q_dkv, blocks.block_k_dkv
    tile, whole = _tiles(S, bk, False), _whole(T)
    docs, doc_specs = _documents(q_seg, k_seg, q_start, bq, bk, keys_major=True)
    dkdv = functools.partial(_dkdv_kernel, scale=scale, block_q=bq, block_k=bk)
    dkn, dkr, dv = pl.pallas_call(
        dkdv, grid=(S // bk, B, H),
        in_specs=[OFFSET_SPEC, whole["heads"](N), whole["heads"](R), tile["heads"](N), tile["rope"](R),
                  tile["heads"](V), whole["seg"], _whole(S)["seg"], *doc_specs, whole["heads"](V),
                  whole["rows"], whole["rows"]],
        out_specs=[tile["heads"](N), tile["heads"](R), tile["heads"](V)],
        out_shape=[jax.ShapeDtypeStruct(kn.shape, kn.dtype), jax.ShapeDtypeStruct((B, S, H, R), jnp.float32),
                   jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=params, interpret=interpret, name="mla_flash_dkdv",
    )(*operands, *docs, *cotangents)

    bq, bk = blocks.block_q_dq, blocks.block_k_dq
    tile, whole = _tiles(T, bq, True), _whole(S)
    docs, doc_specs = _documents(q_seg, k_seg, q_start, bq, bk, keys_major=False)
    dq = functools.partial(_dq_kernel, scale=scale, block_q=bq, block_k=bk, num_q_blocks=T // bq,
                           num_k_blocks=S // bk)
    dqn, dqr = pl.pallas_call(
        dq, grid=(T // bq, B, H),
        in_specs=[OFFSET_SPEC, tile["heads"](N), tile["heads"](R), whole["heads"](N), whole["rope"](R),
                  whole["heads"](V), _whole(T)["seg"], whole["seg"], *doc_specs, tile["heads"](V),
                  tile["rows"], tile["rows"]],
        out_specs=[tile["heads"](N), tile["heads"](R)],
        out_shape=[jax.ShapeDtypeStruct(qn.shape, dq_dtype or qn.dtype),
                   jax.ShapeDtypeStruct(qr.shape, dq_dtype or qr.dtype)],
        compiler_params=params, interpret=interpret, name="mla_flash_dq",
    )(*operands, *docs, *cotangents)
    return dqn, dqr, dkn, dkr, dv
