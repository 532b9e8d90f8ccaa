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
def test_packed_backward_keeps_only_the_product_and_recomputes(activation):
    """The backward's one residual is ``gu`` itself (bf16, no float32 term and no stored derivative),
    and its gradient is ``[da·∂a/∂g | da·∂a/∂u]`` with the derivatives recomputed in float32: equal
    to float32 autodiff of the bf16 inputs up to the result's one bf16 rounding."""
    from jax._src.ad_checkpoint import saved_residuals

    gu = (jax.random.normal(jax.random.PRNGKey(6), (8, 2 * 16)) * 3).astype(jnp.bfloat16)
    da = jax.random.normal(jax.random.PRNGKey(8), (8, 16))
    loss = lambda gu: jnp.sum(packed_gated_activation(gu, activation, 4.0, 25.0, None).astype(jnp.float32) * da)
    kept = [(a.shape, a.dtype, why) for a, why in saved_residuals(loss, gu) if not why.startswith("from a constant")]
    assert kept == [((8, 32), jnp.bfloat16, "from the argument gu")], kept  # (da, the loss's constant, aside)
    wide = lambda gu: jnp.sum(gated_activation(gu[:, :16], gu[:, 16:], activation) * da)
    want = jax.grad(wide)(gu.astype(jnp.float32))
    got = jax.grad(loss)(gu)
    assert got.dtype == jnp.bfloat16
    assert rel_rmse(got, want) < 4e-3
