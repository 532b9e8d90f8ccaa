"""The LatentMoE decode head kernel (``kernel_gpu_decode_head``: router, ``down_proj``, the shared
experts' gate / up and activation) against the XLA code it replaces, interpreted on CPU and compiled
on the GPU.

Ids exact and weights to fp32 ulps (as ``test_route_kernel``); ``u`` and ``h`` are rounded where the
model code rounds (each product, the activation), so against a reference rounding there they may
differ only where another fp32 summation order flips a rounding: by about a bf16 ulp, rarely. XLA
keeps the shared experts' g and u in fp32 into the activation (excess precision; so does the H200's
batch-1 compile), so against it the bound holds, not the frequency.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.layers.linear import einsum
from k3jax.layers.moe import route
from pallas_kernels.moe.activations import gated_activation, split_gated_activation
from pallas_kernels.moe.kernel_gpu_decode import _round_to
from pallas_kernels.moe.kernel_gpu_decode_head import HeadTiles, decode_head_pallas

BF16_ULP = 2.0 ** -7
F32_RTOL = 1e-6


def _inputs(seed, T, D, E, L, F):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.bfloat16)
    w_router = jnp.asarray(rng.normal(size=(D, E)) * D ** -0.5, jnp.float32)
    bias = jnp.asarray(rng.normal(size=(E,)) * 0.1, jnp.float32)
    w_down, w_gate, w_up = (jnp.asarray(rng.normal(size=(D, n)) * D ** -0.5, jnp.bfloat16) for n in (L, F, F))
    return x, w_router, bias, w_down, w_gate, w_up


@jax.jit
def _rounded_products(x, w_down, w_gate, w_up):
    """The definition, rounded at the model code's points (``reduce_precision``: XLA keeps the CPU
    reference's intermediate bf16 roundings then, as it does not drop them in ``_xla_products``)."""
    f32, dt = jnp.float32, x.dtype
    product = lambda w: _round_to(jnp.dot(x.astype(f32), w.astype(f32), precision="highest"), dt)
    return product(w_down), _round_to(gated_activation(product(w_gate), product(w_up), "situ"), dt)


@jax.jit
def _xla_products(x, w_down, w_gate, w_up):
    u = einsum("TD,DL->TL", x, w_down)
    h = split_gated_activation(einsum("TD,DF->TF", x, w_gate), einsum("TD,DF->TF", x, w_up), "situ",
                               out_dtype=x.dtype)
    return u, h


def _assert_rounded_alike(got, ref, max_fraction, propagated=False):
    """Within a bf16 ulp of the element; ``propagated`` (h): plus one of the token's largest value, as
    a flipped rounding of g or u moves ``act(g, u)`` by about an ulp of g·u, not of the result."""
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    diff = np.abs(got - ref)
    bound = np.maximum(np.abs(got), np.abs(ref))
    if propagated:
        bound = bound + np.max(np.abs(ref), axis=-1, keepdims=True)
    assert np.all(diff <= BF16_ULP * bound), diff.max()
    assert np.mean(diff > 0) <= max_fraction, np.mean(diff > 0)


@pytest.mark.parametrize("T,D,E,k,L,F,shared,block_n,block_d", [
    (1, 1024, 64, 8, 512, 1024, True, 32, 128),  # small() at batch 1
    (2, 64, 16, 4, 32, 64, True, 16, 32),        # tiny(), two tokens
    (1, 64, 16, 2, 32, 0, False, 16, 64),        # no shared experts
])
def test_interpreted_head_matches_xla(T, D, E, k, L, F, shared, block_n, block_d):
    x, w_router, bias, w_down, w_gate, w_up = _inputs(T + D, T, D, E, L, max(F, 16))
    if not shared:
        w_gate = w_up = None
    ids, weights, u, h = decode_head_pallas(x, w_router, bias, w_down, w_gate, w_up, top_k=k, renormalize=True,
                                            scaling=1.0, activation="situ",
                                            tiles=HeadTiles(block_n=block_n, block_d=block_d), interpret=True)
    scores = jax.nn.sigmoid(jnp.einsum("TD,DE->TE", x.astype(jnp.float32), w_router))
    ref_ids, ref_weights = route(scores, bias, k, renormalize=True, scaling=1.0, with_stats=False)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(ref_weights), rtol=F32_RTOL)
    gate_up = _inputs(T + D, T, D, E, L, max(F, 16))[4:]
    ref_u, ref_h = _rounded_products(x, w_down, *gate_up)
    xla_u, xla_h = _xla_products(x, w_down, *gate_up)
    assert u.dtype == x.dtype and u.shape == (T, L)
    _assert_rounded_alike(u, ref_u, max_fraction=0.05)
    _assert_rounded_alike(u, xla_u, max_fraction=0.05)
    if shared:
        assert h.shape == (T, F)
        _assert_rounded_alike(h, ref_h, max_fraction=0.05, propagated=True)
        _assert_rounded_alike(h, xla_h, max_fraction=1.0, propagated=True)  # XLA keeps g, u in fp32
    else:
        assert h is None


@pytest.mark.unchecked
def test_bad_inputs_raise():
    x, w_router, bias, w_down, w_gate, w_up = _inputs(0, 1, 64, 16, 32, 40)
    kw = dict(top_k=4, renormalize=True, scaling=1.0, activation="situ", tiles=HeadTiles(block_n=16, block_d=32),
              interpret=True)
    with pytest.raises(ValueError, match="tiles.block_n=16 must be a power of two >= 16 dividing w_gate's 40"):
        decode_head_pallas(x, w_router, bias, w_down, w_gate, w_up, **kw)
    with pytest.raises(ValueError, match="w_gate and w_up must be given together"):
        decode_head_pallas(x, w_router, bias, w_down, w_gate, None, **kw)
    with pytest.raises(ValueError, match="w_down must be \\[D, L\\] with D = x.shape\\[1\\]=64"):
        decode_head_pallas(x, w_router, bias, w_down.T, **kw)


@pytest.mark.gpu
def test_compiled_head_matches_rounded_reference():
    """Against the products rounded at the model code's points (fp32 products, ``highest``): the
    H200's own batch-1 XLA path multiplies in bf16 before its fp32 sum (its strength-reduced
    matrix-vector products), ~1 % off on small outputs, so it is no reference for the products."""
    x, w_router, bias, w_down, w_gate, w_up = _inputs(1, 1, 1024, 64, 512, 1024)
    ids, weights, u, h = decode_head_pallas(x, w_router, bias, w_down, w_gate, w_up, top_k=8, renormalize=True,
                                            scaling=1.0, activation="situ")
    ref_u, ref_h = _rounded_products(x, w_down, w_gate, w_up)
    _assert_rounded_alike(u, ref_u, max_fraction=0.05)
    _assert_rounded_alike(h, ref_h, max_fraction=0.05, propagated=True)
