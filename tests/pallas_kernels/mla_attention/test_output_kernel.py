"""MLA's decode output kernel (``kernel_gpu_output.gated_output``: the attention's key splits merged, ``W_v``
and the output gate) against its reference (``reference_decode.gated_output_reference``) from the decode
attention kernel's own splits, interpreted on CPU and compiled on the GPU; its errors."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.mla_attention import kernel_gpu_decode, kernel_gpu_output
from pallas_kernels.mla_attention.kernel_gpu_output import gated_output
from pallas_kernels.mla_attention.reference_decode import gated_output_reference
from tests.tolerances import BF16_FWD_RTOL, rel_rmse


def _inputs(seed, B, T, H, R, dr, dn, dv, S, interpret, w_dtype=jnp.bfloat16):
    """The decode attention's splits for rows ``S - 2 - b`` of a cache of ``S``, ``kv_b``'s kernel, gate logits."""
    ks = jax.random.split(jax.random.key(seed), 5)
    q_c = jax.random.normal(ks[0], (B, T, H, R)) * 0.5
    q_r = jax.random.normal(ks[1], (B, T, H, dr)) * 0.5
    latent = jax.random.normal(ks[2], (B, S, R + dr)).astype(jnp.bfloat16)
    last = (S - 2 - jnp.arange(B)[:, None] % S + jnp.arange(T)[None]).astype(jnp.int32)
    splits = kernel_gpu_decode.split_outputs(q_c, q_r, latent, last, scale=0.1, interpret=interpret)
    assert splits[0].shape == kernel_gpu_decode.split_shape(q_c, latent)
    w_kv_b = (0.1 * jax.random.normal(ks[3], (R, H, dn + dv))).astype(w_dtype)
    gate = jax.random.normal(ks[4], (B, T, H, dv)).astype(jnp.bfloat16)
    return (*splits, w_kv_b, gate), dn


def _check(args, dn, interpret=True):
    got = gated_output(*args, nope_dim=dn, interpret=interpret)
    want = jax.jit(lambda *a: gated_output_reference(*a, nope_dim=dn))(*args)
    assert got.shape == want.shape and got.dtype == want.dtype == jnp.bfloat16
    # the same bf16 outputs but for a rounding flipped by the float32 sums' order (one ulp; where W_v's sum
    # cancels, the float32 order's own error, small against the outputs' scale)
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    diff = jnp.abs(got - want)
    assert bool(jnp.all(diff <= jnp.abs(want) * 2.0 ** -7 + 1e-5 * jnp.max(jnp.abs(want))))
    assert float(jnp.mean(got != want)) < (0.01 if interpret else 0.05)
    assert rel_rmse(got, want) <= BF16_FWD_RTOL


@pytest.mark.parametrize("B,T,H,R,dr,dn,dv,S,w_dtype", [
    (64, 1, 8, 256, 64, 128, 128, 1089, jnp.bfloat16),  # small() at batch 64: 4 splits, 4 row groups
    (9, 2, 4, 32, 16, 16, 32, 300, jnp.bfloat16),       # two tokens a row, 18 rows: the second group padded
    (20, 1, 2, 32, 16, 16, 16, 64, jnp.float16),        # float16 W_v
    (1, 1, 8, 256, 64, 128, 128, 1089, jnp.bfloat16),   # small() at batch 1: a program a head, 18 splits at once
    (3, 2, 4, 32, 16, 16, 32, 300, jnp.bfloat16),       # 6 rows (under a row group): a program a (head, row)
    (1, 1, 2, 32, 16, 16, 16, 5000, jnp.bfloat16),      # 79 splits: three chunks of SPLIT_CHUNK
    (1, 1, 2, 256, 16, 16, 16, 5000, jnp.bfloat16),     # a 256 latent: two chunks read first, the third after
])
def test_interpreted_kernel_matches_reference(B, T, H, R, dr, dn, dv, S, w_dtype):
    _check(*_inputs(0, B, T, H, R, dr, dn, dv, S, True, w_dtype))


def test_errors_name_the_argument():
    (o, m, l, w, gate), dn = _inputs(0, 16, 1, 4, 32, 16, 16, 16, 100, True)
    cases = [
        ((o, m[:, :1], l, w, gate), "o must be"),
        ((o, m, l, w, jnp.zeros((16, 5, 4, 16), jnp.bfloat16)), "gate must be"),
        ((o, m, l, w[:, :2], gate), "w_kv_b must be"),
        ((o, m, l, w, jnp.zeros((16, 1, 4, 24), jnp.bfloat16)), "w_kv_b must be"),
        ((o.astype(jnp.bfloat16), m, l, w, gate), "float32"),
        ((o, m, l, w.astype(jnp.float32), gate), "w_kv_b must be bfloat16 or float16"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            kernel_gpu_output.check_inputs(*args, nope_dim=dn)
        assert not kernel_gpu_output.accepts(*args, nope_dim=dn)
    assert kernel_gpu_output.accepts(o, m, l, w, gate, nope_dim=dn)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T", [(1, 1), (3, 1), (16, 1), (64, 1), (4, 5)])
def test_compiled_kernel_matches_reference(B, T):
    """small()'s widths after a 1 K prompt: batch 1 and 3 (a program a head and row), 16 and 64, speculative
    verifications of 5 tokens."""
    _check(*_inputs(1, B, T, 8, 256, 64, 128, 128, 1089, False), interpret=False)
