"""MLA's decode kernel (``kernel_gpu_decode``) against the absorbed reference over the compressed cache,
interpreted on CPU and compiled on the GPU; the split merge, the reach past the written rows, and the
dispatch of ``cached_attention`` with its errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla_attention import cached_attention, cached_attention_reference, kernel_gpu_decode
from pallas_kernels.target import compile_for
from tests.tolerances import F32_RTOL, rel_rmse


def _inputs(seed, B, T, H, R, dr, S, lengths):
    ks = jax.random.split(jax.random.key(seed), 3)
    q_c = jax.random.normal(ks[0], (B, T, H, R)) * 0.5
    q_r = jax.random.normal(ks[1], (B, T, H, dr)) * 0.5
    latent = jax.random.normal(ks[2], (B, S, R + dr)).astype(jnp.bfloat16)
    last = jnp.asarray(lengths, jnp.int32)[:, None] + jnp.arange(T, dtype=jnp.int32)[None]  # [B, T]
    return q_c, q_r, latent, last


def _check(B, T, H, R, dr, S, lengths, interpret, seed=0, scale=0.125):
    q_c, q_r, latent, last = _inputs(seed, B, T, H, R, dr, S, lengths)
    with jax.default_matmul_precision("highest"):
        ref = cached_attention_reference(q_c, q_r, latent, last, scale)
    got = kernel_gpu_decode.cached_attention_pallas(q_c, q_r, latent, last, scale=scale, interpret=interpret)
    assert got.shape == ref.shape and got.dtype == jnp.float32
    assert rel_rmse(got, ref) <= F32_RTOL
    return got, ref


@pytest.mark.parametrize("B,T,H,R,dr,S,lengths", [
    (2, 1, 8, 32, 16, 100, [3, 99]),     # one token; S not a multiple of the 64-row tile
    (1, 3, 4, 32, 16, 300, [200]),       # three tokens (12 rows, padded to 16), one row past tile 3
    (3, 2, 2, 16, 16, 40, [0, 20, 45]),  # rows at the cache's start, and past its end (see all of it)
    (1, 2, 24, 64, 16, 80, [70]),        # 48 rows over a latent of 64: 3 groups of 16 (MAX_ACC patched)
])
def test_interpreted_kernel_matches_reference(B, T, H, R, dr, S, lengths, monkeypatch):
    monkeypatch.setattr(kernel_gpu_decode, "MAX_ACC", 16 * 64)
    if H == 24:
        assert kernel_gpu_decode.row_groups(T, H, R) == (3, 16)
    _check(B, T, H, R, dr, S, lengths, interpret=True)


def test_splits_cover_the_keys_once():
    """The split sizes tile the keys exactly, and splits past every query's reach weigh nothing: a
    batch of one spreads a cache over many splits, most of them unread for a short sequence."""
    for batch, tiles in ((1, 17), (64, 18), (300, 5), (2, 1)):
        n, per = kernel_gpu_decode.splits_for(batch, tiles)
        assert (n - 1) * per < tiles <= n * per and n >= 1
    q_c, q_r, latent, last = _inputs(1, 1, 1, 8, 32, 16, 700, [5])
    o, m, l = kernel_gpu_decode.split_outputs(q_c, q_r, latent, last, scale=0.1, interpret=True)
    n = m.shape[1]
    assert n > 1 and np.isfinite(np.asarray(m[0, 0, :8])).all()
    assert np.isneginf(np.asarray(m[0, 1:])).all() and (np.asarray(l[0, 1:]) == 0).all()
    _check(1, 1, 8, 32, 16, 700, [5], interpret=True)


def test_dispatch():
    """``cached_attention``: the reference on a CPU target (bit-for-bit), the kernel when asked; the
    default takes a decode call's few query rows, not chunked prefill's many."""
    q_c, q_r, latent, last = _inputs(2, 2, 1, 2, 16, 16, 50, [10, 30])
    assert kernel_gpu_decode.accepts(q_c, q_r, latent, last)
    many = jnp.zeros((2, 64, 16, 16))
    assert not kernel_gpu_decode.accepts(many, jnp.zeros((2, 64, 16, 16)), latent, jnp.zeros((2, 64), jnp.int32))
    with compile_for("cpu"):
        default = cached_attention(q_c, q_r, latent, last, 0.2)
    assert (default == cached_attention_reference(q_c, q_r, latent, last, 0.2)).all()
    with jax.default_matmul_precision("highest"):
        ref = cached_attention_reference(q_c, q_r, latent, last, 0.2)
    got = cached_attention(q_c, q_r, latent, last, 0.2, implementation="pallas", interpret=True)
    assert rel_rmse(got, ref) <= F32_RTOL


@pytest.mark.unchecked
def test_dispatch_errors():
    q_c, q_r, latent, last = _inputs(0, 1, 1, 2, 16, 16, 20, [3])
    with pytest.raises(ValueError, match="implementation must be"):
        cached_attention(q_c, q_r, latent, last, 0.1, implementation="triton")
    with compile_for("cpu"), pytest.raises(ValueError, match="needs a CUDA GPU"):
        cached_attention(q_c, q_r, latent, last, 0.1, implementation="pallas")
    with pytest.raises(ValueError, match="powers of two >= 16"):
        cached_attention(q_c[..., :12], q_r, latent[..., 4:], last, 0.1, implementation="pallas", interpret=True)
    with pytest.raises(ValueError, match="R \\(q_c.shape\\[-1\\]\\) <= 1024"):
        wide = jnp.zeros((1, 1, 2, 2048))
        cached_attention(wide, q_r, jnp.zeros((1, 20, 2064)), last, 0.1, implementation="pallas", interpret=True)
    with pytest.raises(ValueError, match="bf16 cache"):
        cached_attention(q_c, q_r, latent.astype(jnp.float32), last, 0.1, implementation="pallas", interpret=True)
    with pytest.raises(ValueError, match="latent must be"):
        cached_attention(q_c, q_r, latent[..., :20], last, 0.1, implementation="pallas", interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H,R,dr,S,lengths", [
    (64, 1, 8, 256, 64, 1089, list(range(1024, 1088))),  # small() at batch 64 after a 1 K prompt
    (1, 1, 8, 256, 64, 1089, [1050]),                     # batch 1
    (2, 5, 8, 256, 64, 4096, [17, 3000]),                 # a speculative verification of 5 tokens
    (1, 1, 96, 512, 64, 2048, [2047]),                    # K3's widths: 96 heads (3 groups), 512-wide latent
])
def test_compiled_kernel_matches_reference(B, T, H, R, dr, S, lengths):
    _check(B, T, H, R, dr, S, lengths, interpret=False)
