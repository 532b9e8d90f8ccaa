"""The LatentMoE decode tail kernel (``kernel_gpu_decode_tail``: combine, latent RMSNorm, ``up_proj``)
against the XLA code it replaces, interpreted on CPU and compiled on the GPU.

Against a NumPy reference that rounds at the model code's points (each expert's output, the combined
latent, the normalised latent, the output) it may differ only where another fp32 summation order
flips a rounding: rarely, by about a bf16 ulp. Against XLA (which may keep the combined latent in
fp32: excess precision) the bound holds, not the frequency.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from k3jax.layers.linear import einsum
from k3jax.layers.norm import rms_norm
from pallas_kernels.moe.kernel_gpu_decode import _round_to
from pallas_kernels.moe.kernel_gpu_decode_tail import TailTiles, decode_tail_pallas
from tests.pallas_kernels.moe.test_decode_kernel import _assert_within_ulps  # one bf16 ulp of the element plus one of the token's largest output

EPS = 1e-5


def _inputs(seed, T, k, nf, L, D, F=0):
    """Partial sums, weights, norm scale, ``W_up`` and (``F``: the shared experts' width) ``h`` and
    their down matrix, or Nones."""
    rng = np.random.default_rng(seed)
    parts = jnp.asarray(rng.normal(size=(T, k, nf, L)) * 0.3, jnp.float32)
    weights = jnp.asarray(rng.uniform(0.05, 0.3, size=(T, k)), jnp.float32)
    scale = jnp.asarray(1.0 + 0.1 * rng.normal(size=(L,)), jnp.bfloat16)
    w_up = jnp.asarray(rng.normal(size=(D, L)) * L ** -0.5, jnp.bfloat16)
    h = jnp.asarray(rng.normal(size=(T, F)), jnp.bfloat16) if F else None
    w_sd = jnp.asarray(rng.normal(size=(D, F)) * F ** -0.5, jnp.bfloat16) if F else None
    return parts, weights, scale, w_up, h, w_sd


@jax.jit
def _xla_tail(parts, weights, scale, w_up, h, w_sd):
    """The XLA path: ``gathered_experts_pallas``' epilogue, ``latent_norm``, ``up_proj``, the shared
    experts' ``down`` and the sum (decode layout)."""
    dt = jnp.bfloat16
    y = _round_to(jnp.sum(parts, axis=2), dt)  # [T, k, L]
    y = jnp.sum(y * weights[..., None], axis=1).astype(dt)
    n = rms_norm(y, scale, EPS, jnp.float32).astype(dt)
    out = einsum("TL,DL->TD", n, w_up)
    return out if h is None else out + einsum("TF,DF->TD", h, w_sd)


def _rounded_reference(parts, weights, scale, w_up, h, w_sd) -> np.ndarray:
    rnd = lambda a: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    f32 = lambda a: np.asarray(a, np.float32)
    parts, weights = np.asarray(parts), np.asarray(weights)
    y = rnd(np.sum(rnd(parts.sum(axis=2)) * weights[..., None], axis=1))  # [T, L]
    n = rnd(y / np.sqrt(np.mean(y * y, axis=-1, keepdims=True) + EPS) * f32(scale))
    out = rnd(n @ f32(w_up).T)
    return out if h is None else rnd(out + rnd(f32(h) @ f32(w_sd).T))


@pytest.mark.parametrize("T,k,nf,L,D,F,block_d", [
    (1, 8, 16, 512, 1024, 1024, 32),  # small() at batch 1
    (1, 8, 16, 512, 1024, 0, 32),     # no shared experts
    (2, 4, 2, 32, 64, 64, 16),        # tiny(), two tokens
    (1, 2, 1, 64, 48, 0, 16),         # one F block; D not a power of two
])
def test_interpreted_tail_matches_xla(T, k, nf, L, D, F, block_d):
    inputs = _inputs(T + k + nf, T, k, nf, L, D, F)
    got = decode_tail_pallas(*inputs, eps=EPS, dtype=jnp.bfloat16, tiles=TailTiles(block_d=block_d), interpret=True)
    assert got.shape == (T, D) and got.dtype == jnp.bfloat16
    _assert_within_ulps(got, _rounded_reference(*inputs), max_fraction=0.02)
    _assert_within_ulps(got, _xla_tail(*inputs))


@pytest.mark.unchecked
def test_bad_inputs_raise():
    parts, weights, scale, w_up, _, _ = _inputs(0, 1, 2, 2, 32, 64)
    with pytest.raises(ValueError, match="tiles.block_d=32 must be a power of two >= 16 dividing D=48"):
        decode_tail_pallas(parts, weights, scale, w_up[:48], eps=EPS, dtype=jnp.bfloat16, interpret=True)
    with pytest.raises(ValueError, match="scale must be \\[L\\] and w_up \\[D, L\\]"):
        decode_tail_pallas(parts, weights, scale, w_up.T, eps=EPS, dtype=jnp.bfloat16, interpret=True)
    with pytest.raises(ValueError, match="L and NF \\(parts.shape\\[2:\\]\\) powers of two"):
        decode_tail_pallas(jnp.concatenate([parts] * 3, axis=2), weights, scale, w_up, eps=EPS,
                           dtype=jnp.bfloat16, interpret=True)
    with pytest.raises(ValueError, match="h and w_shared_down must be given together"):
        decode_tail_pallas(parts, weights, scale, w_up, jnp.zeros((1, 64), jnp.bfloat16), eps=EPS,
                           dtype=jnp.bfloat16, interpret=True)
    with pytest.raises(ValueError, match="h must be \\[T, F\\] and w_shared_down \\[D, F\\]"):
        decode_tail_pallas(parts, weights, scale, w_up, jnp.zeros((1, 48), jnp.bfloat16),
                           jnp.zeros((64, 48), jnp.bfloat16), eps=EPS, dtype=jnp.bfloat16, interpret=True)


@pytest.mark.gpu
def test_compiled_tail_matches_reference():
    inputs = _inputs(1, 1, 8, 16, 512, 1024, 1024)
    got = decode_tail_pallas(*inputs, eps=EPS, dtype=jnp.bfloat16)
    _assert_within_ulps(got, _rounded_reference(*inputs), max_fraction=0.02)
