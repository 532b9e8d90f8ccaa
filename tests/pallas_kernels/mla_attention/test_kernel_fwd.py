"""The Mosaic GPU MLA forward (:mod:`kernel_gpu_fwd`) against the definition: interpreted on CPU
(default run), compiled on GPU through ``mla_attention`` (``test_ops.py``'s compiled tests, whose
default blocks take it).

``o`` within the bf16 forward tolerance; ``lse`` and the row max to fp32 rounding, from the dense
masked logits. Document layouts are generated (ordered, shuffled, reused ids) with query offsets, so
the CTA's first key block, each warpgroup's causal bound and run of wholly visible tiles, and the
slots one warpgroup only releases for its partner are all exercised.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.mla_attention import BlockSizes, kernel_gpu_fwd, mla_attention, ops
from pallas_kernels.mla_attention.reference import visible
from tests.pallas_kernels.mla_attention.test_ops import _inputs
from tests.tolerances import BF16_FWD_RTOL, F32_RTOL, rel_rmse

# 64 keys a step: more key blocks per test length (the default takes 128)
TEST_BLOCKS = kernel_gpu_fwd.ForwardBlocks(block_q=64, block_k=64, stages=2)


def _reference(qn, qr, kn, kr, v, q_seg, k_seg, q_start, scale):
    """``(o [B,T,H,V], lse [B,H,T], row max [B,H,T])`` in float64 from the dense masked logits."""
    f = lambda x: np.asarray(x, np.float64)
    logits = (np.einsum("bthn,bshn->bhts", f(qn), f(kn)) + np.einsum("bthr,bsr->bhts", f(qr), f(kr))) * scale
    mask = np.asarray(visible(q_seg, q_seg.shape[0], q_seg.shape[1], q_start=q_start, key_length=k_seg.shape[1],
                              key_segment_ids=k_seg))[:, None]
    logits = np.where(mask, logits, -np.inf)
    mx = logits.max(-1)
    e = np.exp(logits - mx[..., None])
    lse = mx + np.log(e.sum(-1))
    return np.einsum("bhts,bshv->bthv", e / e.sum(-1, keepdims=True), f(v)), lse, mx


def _run_and_check(T, S, q_seg, k_seg, q_start, *, blocks=TEST_BLOCKS, widths=(64, 32, 64), seed=0, scale=0.1,
                   out_dtype=jnp.bfloat16):
    N, R, V = widths
    ks = jax.random.split(jax.random.key(seed), 5)
    bf = lambda k, shape: jax.random.normal(k, shape, jnp.float32).astype(jnp.bfloat16)
    qn, qr = bf(ks[0], (2, T, 2, N)), bf(ks[1], (2, T, 2, R))
    kn, kr, v = bf(ks[2], (2, S, 2, N)), bf(ks[3], (2, S, R)), bf(ks[4], (2, S, 2, V))
    start = jnp.asarray(q_start, jnp.int32)
    o, lse, mx = kernel_gpu_fwd.flash_forward(qn, qr, kn, kr, v, q_seg, k_seg, start, scale=scale, blocks=blocks,
                                              interpret=True, out_dtype=out_dtype)
    ro, rlse, rmx = _reference(qn, qr, kn, kr, v, q_seg, k_seg, start, scale)
    assert o.dtype == out_dtype and o.shape == (2, T, 2, V)
    assert rel_rmse(o, ro) <= BF16_FWD_RTOL
    assert rel_rmse(lse, rlse) <= F32_RTOL and rel_rmse(mx, rmx) <= F32_RTOL


@st.composite
def layouts(draw):
    """``(T, S, q_seg [2,T], k_seg [2,S], q_start [2])``: keys in documents of random lengths (ids in
    order, shuffled or reused), the queries the last ``T`` of them or an earlier window (the offset)."""
    T = draw(st.sampled_from([128, 256]))
    S = T + draw(st.sampled_from([0, 64, 128]))
    k_rows, starts = [], []
    for _ in range(2):
        cuts = sorted(draw(st.sets(st.integers(1, S - 1), max_size=5)))
        lengths = np.diff([0, *cuts, S])
        ids = draw(st.lists(st.integers(0, 3), min_size=len(lengths), max_size=len(lengths)))
        k_rows.append(np.repeat(ids, lengths))
        starts.append(draw(st.integers(0, S - T)))
    k_seg = np.stack(k_rows).astype(np.int32)
    q_seg = np.stack([k_seg[b, s:s + T] for b, s in enumerate(starts)])
    return T, S, jnp.asarray(q_seg), jnp.asarray(k_seg), np.asarray(starts, np.int32)


@settings(max_examples=4, deadline=None)
@given(layouts(), st.integers(0, 2**16), st.booleans())
def test_interpreted_forward_matches_the_definition_for_any_documents(case, seed, f32_output):
    """bf16 outputs, or float32 ones through their own tile (context parallel's partial results)."""
    T, S, q_seg, k_seg, q_start = case
    _run_and_check(T, S, q_seg, k_seg, q_start, seed=seed, out_dtype=jnp.float32 if f32_output else jnp.bfloat16)


def test_interpreted_forward_default_blocks_and_odd_widths():
    """The default tiles (128 keys a step, so one warpgroup's last block is partly its partner's),
    and widths that are not the q_nope/v widths of K3 (the output then has its own smem tile)."""
    T = 256
    seg = jnp.asarray(np.repeat([[0, 1, 1, 2], [5, 5, 5, 5]], T // 4, axis=1), jnp.int32)
    _run_and_check(T, T, seg, seg, [0, 0], blocks=kernel_gpu_fwd.ForwardBlocks(), widths=(32, 16, 64), scale=0.3)


def test_interpreted_forward_skips_the_blocks_of_other_documents():
    """NaN in the first document's keys and values: a visit to its key blocks from the second
    document's rows would form 0·NaN; the CTA's first key block skips them."""
    T = 256
    seg = jnp.asarray(np.repeat([[1, 2]], T // 2, axis=1), jnp.int32)
    args, _ = _inputs(1, T, 2, 64, 32, 64, seed=3)
    poisoned = [x.at[:, :T // 2].set(jnp.nan) if i in (2, 3, 4) else x for i, x in enumerate(args)]
    o, lse, mx = kernel_gpu_fwd.flash_forward(*poisoned, seg, seg, jnp.zeros((1,), jnp.int32), scale=0.1,
                                              blocks=kernel_gpu_fwd.ForwardBlocks(), interpret=True)
    alone = mla_attention(*(x[:, T // 2:] for x in args), scale=0.1, implementation="xla")[0]
    assert rel_rmse(o[:, T // 2:], alone) <= BF16_FWD_RTOL
    assert np.isfinite(np.asarray(lse[:, :, T // 2:])).all()


def test_the_op_takes_the_mosaic_forward_where_it_can():
    """``mla_attention``'s switch: the default blocks run this kernel on whole CTAs of rows (the
    same bits as calling it); ``mosaic_forward=False`` keeps the Triton one."""
    T = 128
    args, _ = _inputs(1, T, 2, 64, 32, 64, seed=1)
    seg, start = jnp.zeros((1, T), jnp.int32), jnp.zeros((1,), jnp.int32)
    direct = kernel_gpu_fwd.flash_forward(*args, seg, seg, start, scale=0.2, interpret=True)
    via_op = ops.flash_forward(*args, seg, seg, start, scale=0.2, blocks=BlockSizes(), interpret=True)
    assert all(np.array_equal(a, b) for a, b in zip(direct, via_op))
    kernels = lambda blocks: str(jax.make_jaxpr(
        lambda *a: ops.flash_forward(*a, seg, seg, start, scale=0.2, blocks=blocks, interpret=True))(*args))
    assert "mla_flash_fwd_mgpu" in kernels(BlockSizes())
    assert "mla_flash_fwd_mgpu" not in kernels(BlockSizes(mosaic_forward=False))
    assert kernel_gpu_fwd.accepts(T, T, 64, 32, 64, jnp.bfloat16, jnp.float32)  # context parallel's output
    assert not kernel_gpu_fwd.accepts(T, T, 64, 32, 64, jnp.bfloat16, jnp.float16)
    assert not kernel_gpu_fwd.accepts(T, 96, 64, 32, 64, jnp.bfloat16, jnp.float32)  # 64-key blocks for float32


@pytest.mark.parametrize("T,S,dtype,widths", [(192, 256, jnp.bfloat16, (64, 32, 64)),
                                              (256, 192, jnp.bfloat16, (64, 32, 64)),
                                              (256, 256, jnp.float32, (64, 32, 64)),
                                              (256, 256, jnp.bfloat16, (64, 24, 64))])
def test_shapes_it_does_not_take_are_refused_by_name(T, S, dtype, widths):
    N, R, V = widths
    z = lambda *shape: jnp.zeros(shape, dtype)
    with pytest.raises(ValueError, match="Mosaic GPU forward needs"):
        kernel_gpu_fwd.flash_forward(z(1, T, 1, N), z(1, T, 1, R), z(1, S, 1, N), z(1, S, R), z(1, S, 1, V),
                                     jnp.zeros((1, T), jnp.int32), jnp.zeros((1, S), jnp.int32),
                                     jnp.zeros((1,), jnp.int32), scale=1.0)
