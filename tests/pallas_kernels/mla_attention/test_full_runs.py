"""The flash kernels' unmasked loop bounds (:func:`kernel_gpu.full_runs`) against the tiles' masks
built from the definition, over generated segment ids (sorted, as packing makes them, or not) and
query offsets: every tile in a run is wholly visible, the run starts at the first such tile and
ends at the next that is not."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.mla_attention import kernel_gpu


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
