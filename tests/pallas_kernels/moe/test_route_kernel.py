"""The router's one-kernel top-k (``kernel_gpu_route``) against ``routing.topk_route``'s XLA reference:
interpreted on CPU over generated scores with ties and ``-inf`` biases, compiled on the GPU; its
gradient, the default's choice of path and the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.moe import kernel_gpu_route, routing
from pallas_kernels.target import Target, compile_for


def _scores(seed, T, E, ties: bool, blocked: int):
    """Sigmoid-like scores (from 5 values when ``ties``, so rows hold many equal scores) and a bias
    with ``blocked`` experts at ``-inf``."""
    rng = np.random.default_rng(seed)
    s = rng.choice(np.linspace(0.1, 0.9, 5), size=(T, E)) if ties else rng.uniform(0, 1, size=(T, E))
    bias = rng.normal(scale=0.05, size=E)
    bias[rng.choice(E, blocked, replace=False)] = -np.inf
    return jnp.asarray(s, jnp.float32), jnp.asarray(bias, jnp.float32)


def _route(scores, bias, k, implementation, renormalize=True, scaling=2.5, interpret=False):
    return routing.topk_route(scores, bias, k, renormalize=renormalize, scaling=scaling,
                              implementation=implementation, interpret=interpret)


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), T=st.sampled_from([1, 3, 16, 40]), E=st.sampled_from([8, 64]),
       k=st.sampled_from([1, 2, 4]), ties=st.booleans(), blocked=st.integers(0, 6), renormalize=st.booleans())
def test_interpreted_kernel_matches_reference(seed, T, E, k, ties, blocked, renormalize):
    """Ids exactly ``lax.top_k``'s (ties to the lower index, more ``-inf`` biases than free experts
    included: the taken mask keeps the ids distinct); weights bitwise (the CPU sums in one order)."""
    scores, bias = _scores(seed, T, E, ties, blocked)
    ids, w = _route(scores, bias, k, "pallas", renormalize, interpret=True)
    ref_ids, ref_w = _route(scores, bias, k, "xla", renormalize)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
    np.testing.assert_array_equal(np.asarray(w), np.asarray(ref_w))
    assert all(len(set(row)) == k for row in np.asarray(ids).tolist())


def test_gradient_is_the_references():
    """The kernel's custom VJP: the reference's gradient of the weights given the chosen ids; the
    bias gets none."""
    scores, bias = _scores(1, 5, 16, False, 0)
    ct = jnp.asarray(np.random.default_rng(2).normal(size=(5, 4)), jnp.float32)
    loss = lambda impl: lambda s, b: jnp.sum(_route(s, b, 4, impl, interpret=impl == "pallas")[1] * ct)
    got = jax.grad(loss("pallas"), argnums=(0, 1))(scores, bias)
    ref = jax.grad(loss("xla"), argnums=(0, 1))(scores, bias)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(ref[0]), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(got[1]), np.zeros(16, np.float32))


def _has_pallas_call(scores, bias, k) -> bool:
    return "pallas_call" in str(jax.make_jaxpr(lambda s, b: _route(s, b, k, None))(scores, bias))


def test_default_picks_the_kernel_on_a_cuda_target():
    """``implementation=None``: the kernel when tracing for a CUDA GPU and it takes the shapes (not
    for E = 48 experts, no power of two); XLA for a CPU target."""
    fits, odd = _scores(0, 1, 64, False, 0), _scores(0, 1, 48, False, 0)
    with compile_for(Target("gpu", "NVIDIA H200", cuda=True)):
        assert _has_pallas_call(*fits, 8)
        assert not _has_pallas_call(*odd, 8)
    with compile_for("cpu"):
        assert not _has_pallas_call(*fits, 8)


def test_block_rows():
    assert [kernel_gpu_route.block_rows(t) for t in (1, 6, 40, 64, 8192)] == [1, 2, 8, 16, 16]


@pytest.mark.unchecked
def test_bad_inputs_raise():
    scores, bias = _scores(0, 2, 48, False, 0)
    with pytest.raises(ValueError, match="implementation must be one of"):
        _route(scores, bias, 4, "triton")
    with pytest.raises(ValueError, match=r"E \(scores.shape\[1\]\) a power of two in \[2, 1024\], got 48"):
        _route(scores, bias, 4, "pallas", interpret=True)
    scores, bias = _scores(0, 2, 64, False, 0)
    with pytest.raises(ValueError, match="top_k a power of two below E=64, got 3"):
        _route(scores, bias, 3, "pallas", interpret=True)
    with pytest.raises(ValueError, match="scores must be \\[T, E\\] and bias \\[E\\]"):
        _route(scores, bias[:8], 4, "pallas", interpret=True)
    with pytest.raises(ValueError, match="must be float32"):
        _route(scores.astype(jnp.bfloat16), bias, 4, "pallas", interpret=True)
    with compile_for("cpu"), pytest.raises(ValueError, match="needs a CUDA GPU"):
        _route(scores, bias, 4, "pallas")


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,k", [(1, 64, 8), (64, 64, 8), (8192, 256, 8), (3, 1024, 16)])
def test_compiled_kernel_matches_reference(T, E, k):
    """On the GPU: ids exact; weights within an ulp (XLA may sum the k weights in another order)."""
    for ties in (False, True):
        scores, bias = _scores(T + E, T, E, ties, 2)
        ids, w = jax.jit(lambda s, b: _route(s, b, k, "pallas"))(scores, bias)
        ref_ids, ref_w = jax.jit(lambda s, b: _route(s, b, k, "xla"))(scores, bias)
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
        np.testing.assert_allclose(np.asarray(w), np.asarray(ref_w), rtol=3e-7, atol=0)
