"""MLA's decode query kernel (``kernel_gpu_query.absorbed_query``: ``q_norm``, ``q_b`` and ``W_k``'s absorption)
against its reference (``reference_decode.absorbed_query_reference``), interpreted on CPU and compiled on the
GPU; how it splits the rank, and its errors."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.mla_attention import kernel_gpu_query
from pallas_kernels.mla_attention.kernel_gpu_query import QueryTiles, absorbed_query, pieces
from pallas_kernels.mla_attention.reference_decode import absorbed_query_reference
from tests.tolerances import BF16_FWD_RTOL, F32_RTOL, rel_rmse


def _inputs(seed, rows, N, R, H, dn, dr, Rkv, dv, param_dtype=jnp.bfloat16):
    """The packed input projections ``y`` and ``W_qb`` (bf16, the compute dtype), q_norm's scale and ``kv_b``'s
    kernel (as stored)."""
    ks = jax.random.split(jax.random.key(seed), 4)
    y = jax.random.normal(ks[0], (rows, N)).astype(jnp.bfloat16)
    scale = (1 + 0.1 * jax.random.normal(ks[1], (R,))).astype(param_dtype)
    w_qb = (R ** -0.5 * jax.random.normal(ks[2], (R, H, dn + dr))).astype(jnp.bfloat16)
    w_kv_b = (dn ** -0.5 * jax.random.normal(ks[3], (Rkv, H, dn + dv))).astype(param_dtype)
    return y, scale, w_qb, w_kv_b


def _check(args, offset, dn, interpret=True, tiles=QueryTiles(), eps=1e-6):
    kw = dict(offset=offset, nope_dim=dn, eps=eps)
    want = jax.jit(lambda *a: absorbed_query_reference(*a, **kw))(*args)
    got = absorbed_query(*args, **kw, tiles=tiles, interpret=interpret)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype == jnp.float32
    # Only the float32 sums' order differs, which can flip a bf16 rounding of q (by one ulp): rarely where
    # the CPU interpreter's order is close to the reference's, more often compiled (bf16-input tolerance).
    (q_c, q_rope), (want_c, want_rope) = got, want
    if interpret:
        ulp = jnp.abs(want_rope) * 2.0 ** -7  # one bf16 ulp or more
        assert bool(jnp.all(jnp.abs(q_rope - want_rope) <= ulp)) and float(jnp.mean(q_rope != want_rope)) < 0.01
        assert rel_rmse(q_c, want_c) <= 10 * F32_RTOL
    else:
        assert rel_rmse(q_rope, want_rope) <= BF16_FWD_RTOL and rel_rmse(q_c, want_c) <= BF16_FWD_RTOL


@pytest.mark.parametrize("rows,N,R,H,dn,dr,Rkv,dv,offset,block_r,param_dtype", [
    (1, 704, 384, 8, 128, 64, 256, 128, 0, 64, jnp.bfloat16),  # small()'s MLA at batch 1 (4 blocks of W_k)
    (64, 704, 384, 8, 128, 64, 256, 128, 0, 128, jnp.bfloat16),  # batch 64: no padding rows
    (5, 100, 48, 2, 16, 16, 32, 16, 8, 64, jnp.bfloat16),      # q_a inside y, 5 rows padded to 16; one block
    (2, 96, 64, 4, 32, 16, 128, 16, 32, 32, jnp.float32),      # float32 scale and W_k (W_k in three bf16 parts)
])
def test_interpreted_kernel_matches_reference(rows, N, R, H, dn, dr, Rkv, dv, offset, block_r, param_dtype):
    _check(_inputs(0, rows, N, R, H, dn, dr, Rkv, dv, param_dtype), offset, dn, tiles=QueryTiles(block_r=block_r))


def test_rank_is_read_in_equal_power_of_two_parts():
    assert pieces(384) == [(0, 128), (128, 128), (256, 128)]  # small()
    assert pieces(48) == [(0, 16), (16, 16), (32, 16)]
    assert pieces(512) == [(0, 128), (128, 128), (256, 128), (384, 128)]
    assert pieces(64) == [(0, 64)]


def test_errors_name_the_argument():
    args = _inputs(0, 1, 704, 384, 8, 128, 64, 256, 128)
    y, scale, w_qb, w_kv_b = args
    cases = [
        ((jnp.zeros((65, 704), jnp.bfloat16), scale, w_qb, w_kv_b), {}, "y must be"),
        ((y, scale, w_qb.astype(jnp.float32), w_kv_b), {}, "w_qb must be 16-bit"),
        ((y, scale, w_qb, w_kv_b.astype(jnp.float16)), {}, "w_qb must be 16-bit"),
        ((y, scale[:100], w_qb, w_kv_b), {}, "scale must be"),
        ((y, scale, w_qb, w_kv_b[:, :4]), {}, "same H"),
        (args, dict(offset=400), "offset=400"),
        ((y, scale[:376], w_qb[:376], w_kv_b), {}, "multiple of 16"),
        ((y, scale, w_qb[..., :176], w_kv_b), {}, "powers of two"),
        ((y, jnp.ones((512,)), jnp.zeros((512, 8, 192), jnp.bfloat16), w_kv_b), {}, "in registers"),
        ((y, jax.ShapeDtypeStruct(scale.shape, jnp.float64), w_qb, w_kv_b), {}, "float64"),
    ]
    for a, extra, match in cases:
        kw = dict(offset=0, nope_dim=128) | extra
        with pytest.raises(ValueError, match=match):
            kernel_gpu_query.check_inputs(*a, **kw)
        assert not kernel_gpu_query.accepts(*a, **kw)
    with pytest.raises(ValueError, match="tiles.block_r=48"):
        kernel_gpu_query.check_inputs(*args, offset=0, nope_dim=128, tiles=QueryTiles(block_r=48))
    assert kernel_gpu_query.accepts(*args, offset=0, nope_dim=128)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,block_r", [(1, 64), (5, 64), (64, 64), (1, 128)])
def test_compiled_kernel_matches_reference(rows, block_r):
    """small()'s widths, one to ``MAX_ROWS`` rows."""
    _check(_inputs(1, rows, 704, 384, 8, 128, 64, 256, 128), 0, 128, interpret=False,
           tiles=QueryTiles(block_r=block_r))
