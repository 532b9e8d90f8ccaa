"""``chunk_kda(gpu_prep_backward=…)`` reaches the GPU kernel path's prep backward, and only it."""

import jax
import jax.numpy as jnp
import pytest

from k3jax.config import KDAConfig
from pallas_kernels.kda import chunk_kda


def _inputs(B=1, T=64, H=1, D=64):
    ks = jax.random.split(jax.random.key(0), 5)
    l2 = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q, k = (l2(jax.random.normal(kk, (B, T, H, D))).astype(jnp.bfloat16) for kk in ks[:2])
    v = jax.random.normal(ks[2], (B, T, H, D), jnp.bfloat16)
    g = -5.0 * jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H, D)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    return q, k, v, g, beta


@pytest.mark.parametrize("choice, kernel_expected", [("kernel", True), ("xla", False)])
def test_gradient_uses_the_prep_backward_kernel_only_when_asked(choice, kernel_expected):
    args = _inputs()
    loss = lambda *a: jnp.sum(chunk_kda(*a, implementation="pallas", interpret="gpu",
                                        gpu_prep_backward=choice)[0].astype(jnp.float32))
    text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*args))
    assert ("kda_prep_bwd" in text) == kernel_expected


@pytest.mark.unchecked
def test_bad_values_name_the_argument():
    with pytest.raises(ValueError, match="gpu_prep_backward"):
        chunk_kda(*_inputs(), gpu_prep_backward="fast")
    with pytest.raises(ValueError, match="gpu_prep_backward"):
        KDAConfig(num_heads=1, head_dim=16, gpu_prep_backward="fast")
