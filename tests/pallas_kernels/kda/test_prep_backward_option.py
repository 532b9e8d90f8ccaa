"""``chunk_kda(gpu_prep_backward=…)`` reaches the GPU kernel path's prep backward, and only it."""

import jax
import jax.numpy as jnp
import pytest

from k3jax.config import KDAConfig
from pallas_kernels.kda import chunk_kda
from pallas_kernels.kda.kernel_gpu import chunk_kda_pallas


def _inputs(B=1, T=64, H=1, D=64):
    ks = jax.random.split(jax.random.key(0), 5)
    l2 = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q, k = (l2(jax.random.normal(kk, (B, T, H, D))).astype(jnp.bfloat16) for kk in ks[:2])
    v = jax.random.normal(ks[2], (B, T, H, D), jnp.bfloat16)
    g = -5.0 * jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H, D)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    return q, k, v, g, beta


@pytest.mark.parametrize("knob, kernel_expected", [({}, True), ({"gpu_prep_backward": "xla"}, False)])
def test_gradient_uses_the_prep_backward_kernels_by_default(knob, kernel_expected):
    """The default is the split Mosaic GPU backward; ``"xla"`` leaves no prep backward kernel."""
    args = _inputs()
    loss = lambda *a: jnp.sum(chunk_kda(*a, implementation="pallas", interpret="gpu", **knob)[0].astype(jnp.float32))
    text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*args))
    assert ("kda_prep_bwd" in text) == kernel_expected


@pytest.mark.unchecked
@pytest.mark.parametrize("value", ["fast", "kernel", "split-saved"])
def test_bad_values_name_the_argument_and_the_allowed_ones(value):
    """Unknown values, and the deleted one-kernel and saved-T backwards, are refused by name."""
    with pytest.raises(ValueError, match=r"gpu_prep_backward must be 'xla' or 'split', got '" + value):
        chunk_kda(*_inputs(), gpu_prep_backward=value)
    with pytest.raises(ValueError, match=r"gpu_prep_backward='" + value + r"' must be 'xla' or 'split'"):
        KDAConfig(num_heads=1, head_dim=16, gpu_prep_backward=value)
    with pytest.raises(ValueError, match=r"prep_bwd must be 'xla', or 'split' with prep='fused'; got '" + value):
        chunk_kda_pallas(*_inputs(), scale=1.0, prep_bwd=value)

