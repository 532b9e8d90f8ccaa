"""Shared KDA test inputs: L2-normalised q/k, K3's bounded gate g = -5*sigmoid(.), beta = sigmoid(.)."""

import jax
import jax.numpy as jnp
import pytest


@pytest.fixture
def x64():
    """float64 end to end for exactness tests (chunked == recurrent to rounding)."""
    with jax.enable_x64(True):
        yield


def l2norm(x):
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))


def kda_inputs(seed, B, T, H, K, V, dtype=jnp.float64, gate_shift=-2.0, state=True):
    """``(q, k, v, g, beta, s0)``; ``gate_shift`` < 0 keeps decays mild so long memory is exercised
    while the spread (std 2) still reaches the -5 bound."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    f = jnp.float64 if dtype == jnp.float64 else jnp.float32
    q = l2norm(jax.random.normal(ks[0], (B, T, H, K), f)).astype(dtype)
    k = l2norm(jax.random.normal(ks[1], (B, T, H, K), f)).astype(dtype)
    v = jax.random.normal(ks[2], (B, T, H, V), f).astype(dtype)
    g = -5.0 * jax.nn.sigmoid(gate_shift + 2.0 * jax.random.normal(ks[3], (B, T, H, K), f))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H), f))
    s0 = jax.random.normal(ks[5], (B, H, K, V), f) if state else None
    return q, k, v, g, beta, s0


def segments_from_lengths(lengths, ids=None):
    """One row of segment ids from document lengths (ids default 0, 1, 2, ...)."""
    ids = range(len(lengths)) if ids is None else ids
    return jnp.concatenate([jnp.full((n,), i, jnp.int32) for i, n in zip(ids, lengths)])
