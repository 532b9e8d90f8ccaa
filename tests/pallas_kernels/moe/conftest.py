"""Shared helpers for the MoE op tests: random group sizes and inputs."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

# The Pallas GPU interpreter imports the fuser on its first run, which registers a config value
# in JAX's tracing context: every function traced before that would be traced again once after.
from jax.experimental.pallas import fuser  # noqa: F401, E402


def group_sizes_strategy(num_groups: int, m: int):
    """Group sizes summing to at most ``m``: cut points of ``[0, total]`` (equal cuts give empty
    groups), plus explicit all-rows-in-one-group cases."""

    def cuts_to_sizes(total_and_cuts):
        total, cuts = total_and_cuts
        edges = np.concatenate([[0], np.sort(cuts), [total]])
        return np.diff(edges).astype(np.int32)

    uneven = st.integers(0, m).flatmap(
        lambda total: st.tuples(
            st.just(total), st.lists(st.integers(0, total), min_size=num_groups - 1, max_size=num_groups - 1)
        )
    ).map(cuts_to_sizes)
    all_in_one = st.integers(0, num_groups - 1).map(
        lambda i: np.asarray([m if j == i else 0 for j in range(num_groups)], np.int32)
    )
    return st.one_of(all_in_one, uneven)


def random_gmm_inputs(seed: int, m: int, k: int, n: int, e: int, dtype):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    lhs = jax.random.normal(k1, (m, k), jnp.float32).astype(dtype)
    rhs = (jax.random.normal(k2, (e, k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
    return lhs, rhs


def random_moe_inputs(seed: int, t: int, l: int, f: int, e: int, topk: int, dtype):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    x = jax.random.normal(ks[0], (t, l), jnp.float32).astype(dtype)
    # distinct experts per token, as a top-k router gives
    ids = jnp.argsort(jax.random.uniform(ks[1], (t, e)), axis=1)[:, :topk].astype(jnp.int32)
    w = jax.nn.softmax(jax.random.normal(ks[2], (t, topk)), axis=-1).astype(jnp.float32)
    w1 = (jax.random.normal(ks[3], (e, l, f)) / np.sqrt(l)).astype(dtype)
    w3 = (jax.random.normal(ks[4], (e, l, f)) / np.sqrt(l)).astype(dtype)
    w2 = (jax.random.normal(ks[5], (e, f, l)) / np.sqrt(f)).astype(dtype)
    return x, ids, w, w1, w3, w2


def gmm_value_and_grads(fn):
    """Jitted ``(loss, (dlhs, drhs))`` of a fixed cosine-weighted sum of ``fn(lhs, rhs, group_sizes)``."""

    def loss(lhs, rhs, gs):
        out = fn(lhs, rhs, gs)
        return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.size).reshape(out.shape)))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
