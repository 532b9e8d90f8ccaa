"""Context parallel's flash path over the latent (sharding/latent_flash.py), interpreted, on one device.

A shard's queries at an offset against all keys given as the latent, key chunk by key chunk:
outputs, max_logit and the gradients of the queries, the latent, the rope key and ``kv_b``
against the fp32 dense reference on the same bf16 operands, and against the single flash call on
keys expanded whole. Cases: a chunk as long as the queries, chunks several times as long (context
parallel's default; the last one reaching past the queries), chunks shorter than the queries
(query blocks lying wholly before a chunk run no key block there and must not poison the sum),
rows padded up to the kernel's blocks, documents changing mid-chunk, and keys past the last query
taking no gradient.
"""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.mla_attention import mla_attention
from sharding.latent_flash import key_chunk_for, latent_flash
from tests.pallas_kernels.mla_attention.test_ops import SMALL_BLOCKS
from tests.tolerances import BF16_FWD_RTOL, BF16_GRAD_RTOL, F32_RTOL, rel_rmse

B, S, H, R, DR, DN, DV, SCALE = 2, 96, 2, 16, 8, 16, 16, 0.3


def _inputs(T, S=S):
    ks = jax.random.split(jax.random.PRNGKey(11), 4)
    q = jax.random.normal(ks[0], (B, T, H, DN + DR)).astype(jnp.bfloat16)
    c = jax.random.normal(ks[1], (B, S, R)).astype(jnp.bfloat16)
    kr = jax.random.normal(ks[2], (B, S, DR)).astype(jnp.bfloat16)
    kv_b = (0.3 * jax.random.normal(ks[3], (R, H, DN + DV))).astype(jnp.bfloat16)
    s = jnp.arange(S)
    seg = jnp.stack([(s >= 21) + (s >= 50) + (s >= 70) + (s >= 150), (s // 9) % 2]).astype(jnp.int32)
    return (q, c, kr, kv_b), seg


def _expanded(q_start, T, seg, implementation, dt):
    def fn(q, c, kr, kv_b):
        kv = jnp.einsum("BSR,RHK->BSHK", c.astype(dt), kv_b.astype(dt))
        return mla_attention(q[..., :DN].astype(dt), q[..., DN:].astype(dt), kv[..., :DN], kr.astype(dt),
                             kv[..., DN:], seg[:, q_start:q_start + T], scale=SCALE, implementation=implementation,
                             interpret=True, blocks=SMALL_BLOCKS, q_start=q_start, key_segment_ids=seg)
    return fn


def _fwd_grad(fn, args):
    (o, m), vjp = jax.vjp(fn, *args)
    return (o, m), vjp((jnp.cos(3 * o.astype(jnp.float32)).astype(o.dtype), jnp.zeros_like(m)))


def _f32(x):
    return x.astype(jnp.float32)


@pytest.mark.parametrize("q_start,T,key_chunk", [(32, 32, 32), (64, 32, 8), (0, 24, 24), (48, 48, 16), (32, 16, 48),
                                                 (64, 32, 96)])
def test_chunked_flash_equals_the_reference(q_start, T, key_chunk):
    args, seg = _inputs(T)
    chunked = lambda *a: latent_flash(*a, seg[:, q_start:q_start + T], seg, jnp.int32(q_start), scale=SCALE,
                                      nope_dim=DN, key_chunk=key_chunk, blocks=SMALL_BLOCKS, interpret=True)
    with jax.default_matmul_precision("highest"):
        (o, m), grads = _fwd_grad(jax.jit(chunked), args)
        (o_ref, m_ref), grads_ref = _fwd_grad(_expanded(q_start, T, seg, "xla", jnp.float32), [_f32(a) for a in args])
        (o_one, m_one), _ = _fwd_grad(_expanded(q_start, T, seg, "pallas", jnp.bfloat16), args)
    assert bool(jnp.all(jnp.isfinite(o))) and o.dtype == jnp.float32
    assert rel_rmse(o, o_ref) <= BF16_FWD_RTOL and rel_rmse(m, m_ref) <= BF16_FWD_RTOL  # keys expanded in bf16
    # The single call over whole expanded keys: the same tiles, bf16 probabilities scaled per chunk.
    assert rel_rmse(o, o_one) <= BF16_FWD_RTOL and rel_rmse(m, m_one) <= F32_RTOL
    for name, g, g_ref in zip(("q", "c", "k_rope", "kv_b"), grads, grads_ref):
        assert g.dtype == args[("q", "c", "k_rope", "kv_b").index(name)].dtype
        assert rel_rmse(_f32(g), g_ref) <= BF16_GRAD_RTOL, name
    # keys past the last query take no gradient: their chunks are never visited
    assert float(jnp.abs(_f32(grads[1][:, q_start + T:])).max(initial=0.0)) == 0.0


def test_key_chunk_is_the_longest_multiple_of_the_queries_under_the_cap():
    assert key_chunk_for(2048, 1 << 20) == 16384 and key_chunk_for(4096, 1 << 20) == 16384  # K3, 1 M tokens
    assert key_chunk_for(3072, 3 * 4096) == 12288 and key_chunk_for(3000, 9000) == 9000
    assert key_chunk_for(3000, 3000 * 7) == 3000 and key_chunk_for(12288, 1 << 20) == 12288  # caller's check
    assert key_chunk_for(65536, 1 << 20) == 16384 and key_chunk_for(3 * 8192, 1 << 20) == 8192
    assert key_chunk_for(16386, 16386 * 2) == 16386  # no power-of-two divisor >= 128: one chunk


@pytest.mark.unchecked
def test_key_chunk_must_divide_the_queries_and_keys():
    args, seg = _inputs(24)
    with pytest.raises(ValueError, match="key_chunk=16 must divide the S=96 keys and divide the T=24 queries or"):
        latent_flash(*args, seg[:, :24], seg, 0, scale=SCALE, nope_dim=DN, key_chunk=16, interpret=True)


@pytest.mark.parametrize("key_chunk", [64, 128])
def test_chunked_flash_through_the_mosaic_forward(key_chunk):
    """The default blocks: each chunk's forward is the Mosaic GPU kernel writing float32 partial
    outputs (64-key blocks; query blocks before a chunk run none), against the reference."""
    q_start, T, S_ = 128, 128, 256
    args, seg = _inputs(T, S_)
    chunked = lambda *a: latent_flash(*a, seg[:, q_start:], seg, jnp.int32(q_start), scale=SCALE, nope_dim=DN,
                                      key_chunk=key_chunk, interpret=True)
    assert "mla_flash_fwd_mgpu" in str(jax.make_jaxpr(chunked)(*args))
    (o, m), grads = _fwd_grad(jax.jit(chunked), args)
    with jax.default_matmul_precision("highest"):
        (o_ref, m_ref), grads_ref = _fwd_grad(_expanded(q_start, T, seg, "xla", jnp.float32), [_f32(a) for a in args])
    assert bool(jnp.all(jnp.isfinite(o))) and o.dtype == jnp.float32
    assert rel_rmse(o, o_ref) <= BF16_FWD_RTOL and rel_rmse(m, m_ref) <= BF16_FWD_RTOL
    for name, g, g_ref in zip(("q", "c", "k_rope", "kv_b"), grads, grads_ref):
        assert rel_rmse(_f32(g), g_ref) <= BF16_GRAD_RTOL, name


@pytest.mark.gpu
@pytest.mark.parametrize("key_chunk", [None, 128])
def test_chunked_flash_on_the_gpu_equals_one_call_over_whole_keys(key_chunk):
    """Compiled kernels (no interpreter; the forward the Mosaic one with float32 outputs): 8 heads, 256
    queries at the end of 2048 keys."""
    T, S_, heads = 256, 2048, 8
    ks = jax.random.split(jax.random.PRNGKey(5), 4)
    bf = lambda k, shape, s=1.0: (s * jax.random.normal(k, shape)).astype(jnp.bfloat16)
    q, c, kr = bf(ks[0], (1, T, heads, 192)), bf(ks[1], (1, S_, 512)), bf(ks[2], (1, S_, 64))
    kv_b = bf(ks[3], (512, heads, 256), 512 ** -0.5)
    seg = (jnp.arange(S_)[None] >= 700).astype(jnp.int32)
    scale = 192 ** -0.5

    def chunked(q, c, kr, kv_b):
        return latent_flash(q, c, kr, kv_b, seg[:, S_ - T:], seg, S_ - T, scale=scale, nope_dim=128,
                            key_chunk=key_chunk)

    def whole(q, c, kr, kv_b):
        kv = jnp.einsum("BSR,RHK->BSHK", c, kv_b)
        return mla_attention(q[..., :128], q[..., 128:], kv[..., :128], kr, kv[..., 128:], seg[:, S_ - T:],
                             scale=scale, implementation="pallas", q_start=S_ - T, key_segment_ids=seg)

    args = (q, c, kr, kv_b)
    (o, m), g = _fwd_grad(jax.jit(chunked), args)
    (o_w, m_w), g_w = _fwd_grad(jax.jit(whole), args)
    assert rel_rmse(o, o_w) <= BF16_FWD_RTOL and rel_rmse(m, m_w) <= F32_RTOL
    for a, b in zip(g, g_w):
        assert rel_rmse(_f32(a), _f32(b)) <= BF16_GRAD_RTOL
