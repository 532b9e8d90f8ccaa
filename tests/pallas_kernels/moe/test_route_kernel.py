"""The decode router kernel (``kernel_gpu_route``) against the XLA router it replaces (``moe.route`` on
the sigmoid of the fp32 router product), interpreted on CPU and compiled on the GPU.

Ids must agree exactly (random scores have no near-ties; exact ties are ordered as ``jax.lax.top_k``
orders them, tested apart); weights to a few fp32 ulps (the product's and the k-sum's fp32 order).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.layers.moe import route
from pallas_kernels.moe.kernel_gpu_route import RouteTiles, route_pallas

F32_RTOL = 1e-6


def _inputs(seed, T, D, E):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(D, E)) * D ** -0.5, jnp.float32)
    bias = jnp.asarray(rng.normal(size=(E,)) * 0.1, jnp.float32)
    return x, w, bias


def _xla_route(x, w, bias, top_k, renormalize, scaling):
    scores = jax.nn.sigmoid(jnp.einsum("TD,DE->TE", x.astype(jnp.float32), w))
    return route(scores, bias, top_k, renormalize=renormalize, scaling=scaling, with_stats=False)


@pytest.mark.parametrize("T,D,E,k,renormalize,scaling,block_d", [
    (1, 1024, 64, 8, True, 1.0, 128),  # small() at batch 1
    (3, 64, 16, 4, True, 2.5, 32),     # tiny(), three tokens, a scaling factor
    (2, 256, 32, 2, False, 1.0, 256),  # no renormalisation, one step of the product
])
def test_interpreted_route_matches_xla(T, D, E, k, renormalize, scaling, block_d):
    x, w, bias = _inputs(T + E, T, D, E)
    ids, weights = route_pallas(x, w, bias, top_k=k, renormalize=renormalize, scaling=scaling,
                                tiles=RouteTiles(block_d=block_d), interpret=True)
    ref_ids, ref_weights = jax.jit(_xla_route, static_argnums=(3, 4, 5))(x, w, bias, k, renormalize, scaling)
    assert ids.dtype == jnp.int32 and weights.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(ref_weights), rtol=F32_RTOL)


def test_ties_ordered_as_top_k():
    """All scores 0.5 (a zero router), biases in few distinct values and one ``-inf``: the biased scores
    tie in groups, and the kernel picks the same experts in the same order as ``jax.lax.top_k``."""
    E, k = 16, 8
    x = jnp.ones((1, 32), jnp.bfloat16)
    w = jnp.zeros((32, E), jnp.float32)
    bias = jnp.asarray([0.0, 1.0, 1.0, 0.0, -jnp.inf, 1.0, 0.5, 0.5] * 2, jnp.float32)
    ids, weights = route_pallas(x, w, bias, top_k=k, renormalize=True, scaling=1.0, tiles=RouteTiles(block_d=16),
                                interpret=True)
    ref_ids, ref_weights = _xla_route(x, w, bias, k, True, 1.0)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
    np.testing.assert_array_equal(np.asarray(weights), np.asarray(ref_weights))


@pytest.mark.unchecked
def test_bad_inputs_raise():
    x, w, bias = _inputs(0, 1, 64, 48)
    with pytest.raises(ValueError, match="E \\(w.shape\\[1\\]\\) a power of two >= 16, got 48"):
        route_pallas(x, w, bias, top_k=4, renormalize=True, scaling=1.0, interpret=True)
    x, w, bias = _inputs(0, 1, 64, 16)
    with pytest.raises(ValueError, match="top_k=3 must be a power of two below E=16"):
        route_pallas(x, w, bias, top_k=3, renormalize=True, scaling=1.0, interpret=True)
    with pytest.raises(ValueError, match="tiles.block_d=128 must be a power of two dividing D=64"):
        route_pallas(x, w, bias, top_k=4, renormalize=True, scaling=1.0, tiles=RouteTiles(), interpret=True)
    with pytest.raises(ValueError, match="x must be \\[T, D\\]"):
        route_pallas(x, w, bias[:8], top_k=4, renormalize=True, scaling=1.0, tiles=RouteTiles(block_d=32),
                     interpret=True)


@pytest.mark.gpu
def test_compiled_route_matches_xla():
    x, w, bias = _inputs(1, 1, 1024, 64)
    ids, weights = route_pallas(x, w, bias, top_k=8, renormalize=True, scaling=1.0)
    ref_ids, ref_weights = jax.jit(_xla_route, static_argnums=(3, 4, 5))(x, w, bias, 8, True, 1.0)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(ref_weights), rtol=F32_RTOL)
