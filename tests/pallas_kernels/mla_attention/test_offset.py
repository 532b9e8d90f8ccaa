"""The MLA flash kernels with a query offset (context parallel's shard of queries against the
gathered keys) against the dense fp32 reference, interpreted on CPU.

Queries ``[B,T]`` at positions ``q_start + t`` over keys ``[B,S]``: offsets off the block grid,
documents that cross the query range's first row, fewer queries than one block, a traced offset,
and keys past the causal reach filled with NaN (a visited block would poison the output: the
loop bounds, not the mask, must skip them).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla_attention import mla_attention
from tests.pallas_kernels.mla_attention.test_ops import SMALL_BLOCKS
from tests.tolerances import BF16_FWD_RTOL, BF16_GRAD_RTOL, F32_RTOL, rel_rmse

B, H, N, R, V = 2, 2, 16, 8, 16


def _inputs(T, S, seed=0, dims=(H, N, R, V)):
    h, n, r, v = dims
    ks = jax.random.split(jax.random.key(seed), 6)
    shapes = [(B, T, h, n), (B, T, h, r), (B, S, h, n), (B, S, r), (B, S, h, v), (B, T, h, v)]
    qn, qr, kn, kr, v, w = (jax.random.normal(k, s, jnp.float32) for k, s in zip(ks, shapes))
    return [x.astype(jnp.bfloat16) for x in (qn, qr, kn, kr, v)], w


def _key_segments(S, q_start):
    """Row 0: a document starts 3 keys before the first query (it crosses into the query range)
    and another mid-range; row 1: one document."""
    s = np.arange(S)
    row0 = (s >= max(q_start - 3, 1)).astype(np.int32) + (s >= q_start + 5) * 2
    return jnp.asarray(np.stack([row0, np.zeros(S, np.int32)]))


def _run(args, k_seg, q_start, implementation, T, interpret=True, blocks=SMALL_BLOCKS, scale=0.3):
    q_seg = jax.lax.dynamic_slice_in_dim(k_seg, q_start, T, axis=1)
    return mla_attention(*args, q_seg, scale=scale, implementation=implementation, interpret=interpret,
                         blocks=blocks, q_start=q_start, key_segment_ids=k_seg)


def _fwd_grads(fn, args, w):
    (o, mx), vjp = jax.vjp(fn, *args)
    return o, mx, vjp((w.astype(o.dtype), jnp.zeros_like(mx)))


def _check(T, S, q_start, dims=(H, N, R, V), **kw):
    args, w = _inputs(T, S, dims=dims)
    k_seg = _key_segments(S, q_start)
    # A traced offset, as context parallel's lax.axis_index gives it.
    kernel = jax.jit(lambda start, *a: _run(a, k_seg, start, "pallas", T, **kw))
    o, mx, grads = _fwd_grads(lambda *a: kernel(jnp.int32(q_start), *a), args, w)
    ro, rmx, ref_grads = _fwd_grads(lambda *a: _run(a, k_seg, q_start, "xla", T, **kw), args, w)
    assert o.dtype == args[0].dtype and o.shape == w.shape
    assert rel_rmse(o, ro) <= BF16_FWD_RTOL
    assert rel_rmse(mx, rmx) <= F32_RTOL
    for name, g, rg in zip(("q_nope", "q_rope", "k_nope", "k_rope", "v"), grads, ref_grads):
        assert g.dtype == jnp.bfloat16 and g.shape == rg.shape, name
        assert rel_rmse(g, rg) <= BF16_GRAD_RTOL, name


@pytest.mark.parametrize("T,S,q_start", [(32, 96, 40), (24, 64, 17), (8, 40, 30), (32, 32, 0), (16, 64, 0)])
def test_offset_kernel_matches_reference(T, S, q_start):
    _check(T, S, q_start)


@pytest.mark.gpu
@pytest.mark.parametrize("T,S,q_start", [(1024, 4096, 1000), (512, 2048, 1536), (300, 1024, 77)])
def test_compiled_offset_kernel_matches_reference(T, S, q_start):
    _check(T, S, q_start, dims=(4, 128, 64, 128), interpret=False, blocks=None, scale=192 ** -0.5)


def test_key_blocks_past_the_diagonal_are_never_read():
    T, q_start, reach = 32, 40, 96  # the last query (position 71) reaches key block 64..95
    S = reach + 64
    args, w = _inputs(T, S, seed=1)
    k_seg = _key_segments(S, q_start)
    poisoned = [x.at[:, reach:].set(jnp.nan) if i >= 2 else x for i, x in enumerate(args)]
    cut = [x[:, :reach] if i >= 2 else x for i, x in enumerate(args)]
    o, mx, grads = _fwd_grads(lambda *a: _run(a, k_seg, q_start, "pallas", T), poisoned, w)
    ro, rmx, ref_grads = _fwd_grads(lambda *a: _run(a, k_seg[:, :reach], q_start, "pallas", T), cut, w)
    np.testing.assert_array_equal(o, ro)
    np.testing.assert_array_equal(mx, rmx)
    for g, rg in zip(grads, ref_grads):
        np.testing.assert_array_equal(g[:, :reach], rg)
        assert not np.any(np.asarray(g[:, reach:], np.float32)), "keys no query sees get zero gradient"


@pytest.mark.unchecked
def test_offset_errors():
    args, _ = _inputs(16, 32)
    seg = jnp.zeros((B, 16), jnp.int32)
    with pytest.raises(ValueError, match="without q_start"):
        mla_attention(*args, scale=1.0)
    with pytest.raises(ValueError, match=r"q_start must be in \[0, 16\]"):
        mla_attention(*args, scale=1.0, q_start=20)
    with pytest.raises(ValueError, match="key_segment_ids must have shape"):
        mla_attention(*args, seg, scale=1.0, q_start=0, key_segment_ids=seg)
    with pytest.raises(ValueError, match="given together"):
        mla_attention(*args, seg, scale=1.0, q_start=0)
