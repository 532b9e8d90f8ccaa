"""The flash kernels' unmasked loop bounds (:func:`kernel_gpu.full_runs`) against the tiles' masks
built from the definition, over generated segment ids (sorted, as packing makes them, or not) and
query offsets: every tile in a run is wholly visible, the run starts at the first such tile and
ends at the next that is not; and the interpreted kernels that loop by them against the reference
over generated document layouts."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.mla_attention import kernel_gpu
from tests.pallas_kernels.mla_attention.test_ops import SMALL_BLOCKS, _check, _inputs


def _wholly_visible(q_seg, k_seg, q_start, block_q, block_k):
    """[B, nq, nk]: every key of key block j is visible from every query of query block i."""
    B, T = q_seg.shape
    S = k_seg.shape[1]
    q_pos = q_start[:, None] + np.arange(T)[None]
    vis = (np.arange(S)[None, None, :] <= q_pos[:, :, None]) & (k_seg[:, None, :] == q_seg[:, :, None])
    tiles = vis.reshape(B, T // block_q, block_q, S // block_k, block_k)
    return tiles.all(axis=(2, 4))


@st.composite
def cases(draw):
    block_q, block_k = draw(st.sampled_from([(4, 2), (2, 4), (4, 4)]))
    nq, nk = draw(st.integers(1, 6)), draw(st.integers(1, 8))
    B = draw(st.integers(1, 2))
    segs = []
    for n in (nq * block_q, nk * block_k):
        rows = [draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)) for _ in range(B)]
        if draw(st.booleans()):
            rows = [sorted(r) for r in rows]
        segs.append(np.asarray(rows, np.int32))
    q_start = np.asarray(draw(st.lists(st.integers(-block_k, nk * block_k), min_size=B, max_size=B)), np.int32)
    return segs[0], segs[1], q_start, block_q, block_k


@settings(max_examples=60, deadline=None)
@given(cases(), st.booleans())
def test_runs_cover_exactly_a_run_of_wholly_visible_tiles(case, keys_major):
    q_seg, k_seg, q_start, block_q, block_k = case
    qdoc = kernel_gpu.document_blocks(jnp.asarray(q_seg), block_q)
    kdoc = kernel_gpu.document_blocks(jnp.asarray(k_seg), block_k)
    runs = np.asarray(kernel_gpu.full_runs(qdoc, kdoc, jnp.asarray(q_start), block_q, block_k, keys_major))
    full = _wholly_visible(q_seg, k_seg, q_start, block_q, block_k)
    if keys_major:
        full = full.transpose(0, 2, 1)
    for b in range(full.shape[0]):
        for i in range(full.shape[1]):
            lo, hi = runs[b, :, i]
            row = full[b, i]
            if not row.any():
                assert (lo, hi) == (0, 0)
                continue
            assert lo == np.argmax(row), (b, i, row, lo)
            assert row[lo:hi].all() and hi > lo
            assert hi == len(row) or not row[hi]


@st.composite
def documents(draw):
    """``(T, segment ids [2, T])``: each row a run of documents of random lengths, their ids in order,
    shuffled, or reused (an id recurring after another document)."""
    T = draw(st.sampled_from([32, 48, 64, 96]))
    rows = []
    for _ in range(2):
        cuts = sorted(draw(st.sets(st.integers(1, T - 1), max_size=5)))
        lengths = np.diff([0, *cuts, T])
        ids = draw(st.lists(st.integers(0, 3), min_size=len(lengths), max_size=len(lengths)))
        rows.append(np.repeat(ids, lengths))
    return T, jnp.asarray(np.stack(rows), jnp.int32)


@settings(max_examples=6, deadline=None)
@given(documents(), st.integers(0, 2**16))
def test_interpreted_kernels_match_the_reference_for_any_documents(case, seed):
    """The three-part loops of the backward kernels (and the forward's per-tile test) over generated
    document layouts — tiles wholly visible, partly visible and of other documents in every order —
    against the reference: values and every gradient."""
    T, seg = case
    args, w = _inputs(2, T, 2, 16, 16, 16, seed=seed)
    _check(args, w, seg, 0.3, interpret=True, blocks=SMALL_BLOCKS)
