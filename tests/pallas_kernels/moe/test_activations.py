import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe.activations import gated_activation, situ_glu, swiglu
from tests.tolerances import F32_RTOL, rel_rmse


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


def test_bad_input():
    with pytest.raises(ValueError, match="activation"):
        gated_activation(jnp.ones(2), jnp.ones(2), "gelu")
    with pytest.raises(ValueError, match="u.shape"):
        situ_glu(jnp.ones(2), jnp.ones(3))
