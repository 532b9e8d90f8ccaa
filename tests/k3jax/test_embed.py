"""The token embedding's lookup comes before its cast (k3jax/layers/embed.py)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.layers.embed import TokenEmbed

V, D = 16, 8


def _grad(module, idx, cot):
    params = module.init(jax.random.key(0), idx)
    fn = lambda p: jnp.sum(module.apply(p, idx).astype(jnp.float32) * cot)
    return jax.jit(jax.grad(fn))(params)["params"]["embedding"]


def test_repeated_token_gradient_sums_in_the_table_dtype():
    """Token 0 repeated 3510 times (token 3 586 times) among 4096: the gradient is the fp32 sum of
    the cotangents (nn.Embed's bf16 scatter-add stalls far below it)."""
    n = 4096
    idx = jnp.zeros((n,), jnp.int32).at[::7].set(3)
    cot = (jax.random.normal(jax.random.key(1), (n, D)) * 0.1 + 1.0).astype(jnp.bfloat16).astype(jnp.float32)
    got = _grad(TokenEmbed(V, D, dtype=jnp.bfloat16, param_dtype=jnp.float32), idx, cot)
    c = np.asarray(cot, np.float64)
    ids = np.asarray(idx)
    want = np.stack([c[ids == v].sum(0) for v in range(V)])
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5)
    flax_got = _grad(nn.Embed(V, D, dtype=jnp.bfloat16, param_dtype=jnp.float32), idx, cot)
    assert np.abs(np.asarray(flax_got[0], np.float64) - want[0]).max() > 100  # the bug this file avoids


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, None])
def test_forward_equals_flax_embed(dtype):
    idx = jax.random.randint(jax.random.key(2), (3, 5), 0, V)
    params = nn.Embed(V, D, dtype=dtype, param_dtype=jnp.float32).init(jax.random.key(0), idx)
    want = nn.Embed(V, D, dtype=dtype, param_dtype=jnp.float32).apply(params, idx)
    got = TokenEmbed(V, D, dtype=dtype, param_dtype=jnp.float32).apply(params, idx)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_rejects_float_ids():
    """A ValueError naming ``inputs`` (under the suite's jaxtyping hook its TypeCheckError, which also does)."""
    with pytest.raises(Exception, match="inputs"):
        TokenEmbed(V, D).init(jax.random.key(0), jnp.zeros((2,), jnp.float32))
