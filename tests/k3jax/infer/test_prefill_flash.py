"""Chunked prefill's MLA attention by the flash kernel (``mla.flash_cached_attention``, CPU interpreter)
equals the absorbed attention over the compressed cache (``cached_attention_reference``), with a different
cache length per row (compiled on a GPU under ``-m gpu``), and the kernel's per-row query offsets
equal the reference's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.layers import mla
from pallas_kernels.mla_attention import cached_attention_reference, mla_attention
from tests.tolerances import BF16_FWD_RTOL, rel_rmse

RNG = np.random.default_rng(0)
B, S, T, H, R, DN, DR, DV = 2, 96, 32, 2, 32, 16, 16, 16


def _normal(*shape, dtype=jnp.float32):
    return jnp.asarray(RNG.normal(size=shape), dtype)


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.gpu)])
def test_flash_cached_attention_equals_absorbed(interpret):
    start = jnp.asarray([0, 37], jnp.int32)  # row 1's cache already holds 37 tokens
    latent = _normal(B, S, R + DR, dtype=jnp.bfloat16)
    kv_b = _normal(R, H, DN + DV) * R ** -0.5
    q = _normal(B, T, H, DN + DR)
    scale = (DN + DR) ** -0.5
    got = mla.flash_cached_attention(q, latent, kv_b.astype(jnp.bfloat16), start, scale, nope_dim=DN,
                                     interpret=interpret)
    # The absorbed path on the same bf16-rounded operands, in float32.
    q32 = q.astype(jnp.bfloat16).astype(jnp.float32)
    w = kv_b.astype(jnp.bfloat16).astype(jnp.float32)
    with jax.default_matmul_precision("highest"):
        q_c = jnp.einsum("BTHK,RHK->BTHR", q32[..., :DN], w[..., :DN])
        o_c = cached_attention_reference(q_c, q32[..., DN:], latent, start[:, None] + jnp.arange(T)[None], scale)
        ref = jnp.einsum("BTHR,RHV->BTHV", o_c, w[..., DN:])
    assert got.shape == (B, T, H, DV)
    assert rel_rmse(got, ref) <= BF16_FWD_RTOL


def test_per_row_offsets_equal_reference():
    start = jnp.asarray([5, 50], jnp.int32)
    qn, qr = _normal(B, T, H, DN, dtype=jnp.bfloat16), _normal(B, T, H, DR, dtype=jnp.bfloat16)
    kn, kr, v = (_normal(B, S, H, DN, dtype=jnp.bfloat16), _normal(B, S, DR, dtype=jnp.bfloat16),
                 _normal(B, S, H, DV, dtype=jnp.bfloat16))
    args = (qn, qr, kn, kr, v)
    got, _ = mla_attention(*args, scale=0.2, implementation="pallas", interpret=True, q_start=start)
    ref, _ = mla_attention(*args, scale=0.2, implementation="xla", q_start=start)
    assert rel_rmse(got, ref) <= BF16_FWD_RTOL
    for b in range(B):  # each row as its own call with a scalar offset
        one, _ = mla_attention(*(x[b:b + 1] for x in args), scale=0.2, implementation="xla", q_start=int(start[b]))
        np.testing.assert_allclose(np.asarray(ref[b]), np.asarray(one[0]), rtol=1e-6, atol=1e-6)
