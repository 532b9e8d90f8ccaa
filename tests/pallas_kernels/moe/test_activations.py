import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe.activations import (gated_activation, packed_gated_activation, situ_glu, split_gated_activation,
                                             swiglu)
from tests.tolerances import BF16_GRAD_RTOL, F32_RTOL, rel_rmse


def test_situ_matches_swiglu_near_zero():
    g, u = jax.random.normal(jax.random.PRNGKey(0), (2, 256)) * 1e-2
    assert rel_rmse(situ_glu(g, u), swiglu(g, u)) < 1e-3


def test_situ_is_bounded_by_beta_product():
    g, u = jax.random.normal(jax.random.PRNGKey(1), (2, 4096)) * 1e3
    out = situ_glu(g, u, 4.0, 25.0)
    assert float(jnp.max(jnp.abs(out))) <= 100.0
    assert float(jnp.max(jnp.abs(out))) > 90.0


def test_situ_formula():
    g = jnp.array([-3.0, 0.5, 7.0])
    u = jnp.array([40.0, -2.0, 0.1])
    want = 4 * np.tanh(np.asarray(g) / 4) / (1 + np.exp(-np.asarray(g))) * 25 * np.tanh(np.asarray(u) / 25)
    assert rel_rmse(situ_glu(g, u), want) < F32_RTOL


@pytest.mark.parametrize("fn", [situ_glu, swiglu])
def test_dtypes(fn):
    g = jnp.ones((3,), jnp.bfloat16)
    assert fn(g, g).dtype == jnp.float32
    with jax.enable_x64(True):
        g64 = jnp.ones((3,), jnp.float64)
        assert fn(g64, g64).dtype == jnp.float64


@pytest.mark.unchecked
def test_bad_input():
    with pytest.raises(ValueError, match="activation"):
        gated_activation(jnp.ones(2), jnp.ones(2), "gelu")
    with pytest.raises(ValueError, match="u.shape"):
        situ_glu(jnp.ones(2), jnp.ones(3))


@pytest.mark.parametrize("activation", ["situ", "swiglu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_packed_equals_unpacked_values_and_grads(activation, dtype):
    """``packed_gated_activation([g | u])`` == ``gated_activation(g, u)`` cast, and its custom
    backward == autodiff of the unpacked form (gradient in the packed layout, ``gu.dtype``)."""
    gu = (jax.random.normal(jax.random.PRNGKey(4), (64, 2 * 24)) * 3).astype(dtype)
    da = jax.random.normal(jax.random.PRNGKey(5), (64, 24))

    def unpacked(gu):
        return gated_activation(gu[:, :24], gu[:, 24:], activation).astype(dtype)

    packed = lambda gu: packed_gated_activation(gu, activation, 4.0, 25.0, dtype)
    assert packed(gu).dtype == dtype
    np.testing.assert_array_equal(np.asarray(packed(gu), np.float32), np.asarray(unpacked(gu), np.float32))
    loss = lambda f: lambda gu: jnp.sum(f(gu).astype(jnp.float32) * da)
    got, want = jax.grad(loss(packed))(gu), jax.grad(loss(unpacked))(gu)
    assert got.dtype == dtype and got.shape == gu.shape
    assert rel_rmse(got, want) <= (F32_RTOL if dtype == jnp.float32 else BF16_GRAD_RTOL)


@pytest.mark.parametrize("activation", ["situ", "swiglu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_split_equals_autodiff_values_and_grads(activation, dtype):
    """``split_gated_activation(g, u)`` == ``gated_activation(g, u)`` cast, its backward == autodiff,
    and what it keeps for the backward is two ``[., F]`` arrays in the input dtype."""
    from jax._src.ad_checkpoint import saved_residuals

    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(7), 3)
    g, u = ((jax.random.normal(k, (2, 32, 24)) * 3).astype(dtype) for k in (k1, k2))
    da = jax.random.normal(k3, (2, 32, 24))
    split = lambda g, u: split_gated_activation(g, u, activation, 4.0, 25.0, dtype)
    plain = lambda g, u: gated_activation(g, u, activation).astype(dtype)
    np.testing.assert_array_equal(np.asarray(split(g, u), np.float32), np.asarray(plain(g, u), np.float32))
    loss = lambda f: lambda g, u: jnp.sum(f(g, u).astype(jnp.float32) * da)
    got, want = jax.grad(loss(split), argnums=(0, 1))(g, u), jax.grad(loss(plain), argnums=(0, 1))(g, u)
    for a, b in zip(got, want):
        assert a.dtype == dtype and a.shape == g.shape
        assert rel_rmse(a, b) <= (F32_RTOL if dtype == jnp.float32 else BF16_GRAD_RTOL)
    kept = [(a.shape, a.dtype) for a, why in saved_residuals(loss(split), g, u) if why.startswith("output of")]
    assert sorted(kept, key=str) == [((2 * 32, 24), jnp.dtype(dtype))] * 2  # kept as [rows, F] views
    with pytest.raises(ValueError, match="u.shape"):
        jax.grad(loss(split))(g, u[:, :16])


@pytest.mark.parametrize("activation", ["situ", "swiglu"])
def test_packed_forward_stores_bf16_partial_derivatives(activation):
    """The backward's residuals are ∂a/∂g and ∂a/∂u in the input dtype (not two float32 terms)."""
    from pallas_kernels.moe.activations import _packed_fwd

    gu = (jax.random.normal(jax.random.PRNGKey(6), (8, 2 * 16)) * 3).astype(jnp.bfloat16)
    _, (d_g, d_u) = _packed_fwd(gu, activation, 4.0, 25.0, None, "xla", False)
    assert d_g.dtype == d_u.dtype == jnp.bfloat16
    g, u = gu[:, :16].astype(jnp.float32), gu[:, 16:].astype(jnp.float32)
    fn = lambda g, u: jnp.sum(gated_activation(g, u, activation))
    want_g, want_u = jax.grad(fn, argnums=(0, 1))(g, u)
    assert rel_rmse(d_g, want_g) < 4e-3 and rel_rmse(d_u, want_u) < 4e-3


@pytest.mark.parametrize("activation", ["situ", "swiglu"])
def test_split_backward_keeps_the_products_and_recomputes(activation):
    """The split form's residuals are ``g`` and ``u`` themselves (no derivative written by the
    forward), and its gradient, recomputed in float32, matches float32 autodiff of the bf16 inputs
    to the result's one bf16 rounding."""
    from pallas_kernels.moe.activations import _split_bwd, _split_fwd

    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(9), 3)
    g, u = ((jax.random.normal(k, (16, 24)) * 3).astype(jnp.bfloat16) for k in (k1, k2))
    da = jax.random.normal(k3, (16, 24)).astype(jnp.bfloat16)
    _, res = _split_fwd(g, u, activation, 4.0, 25.0, None, "xla", False)
    assert len(res) == 2 and all(r is x for r, x in zip(res, (g, u)))
    got = _split_bwd(activation, 4.0, 25.0, None, "xla", False, res, da)
    fn = lambda g, u: jnp.sum(gated_activation(g, u, activation) * da.astype(jnp.float32))
    want = jax.grad(fn, argnums=(0, 1))(g.astype(jnp.float32), u.astype(jnp.float32))
    for a, b in zip(got, want):
        assert a.dtype == jnp.bfloat16
        assert rel_rmse(a, b) < 4e-3
