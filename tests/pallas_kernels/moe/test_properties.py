"""MoE properties over generated inputs (chex + hypothesis), each shown to catch a broken op.

- the routed FFN is equivariant under any permutation of the tokens;
- the grouped matmul does not depend on its tiling: the tile loop at 8, 16 and 40 rows == the
  ragged_dot reference, for generated group sizes (empty groups, all rows in one group);
- an empty group's weight gradient is exactly zero, and rows past the groups are exactly zero.

The kernels' own tilings are covered by the interpreter tests (``test_partial_tiles_gpu_interpret``,
``test_tgmm_gpu_interpret``); shapes here are fixed so every example reuses a compiled function.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.moe import grouped_matmul, moe_ffn
from pallas_kernels.moe.tiled import grouped_matmul_tiled
from tests.pallas_kernels.moe.conftest import group_sizes_strategy, random_gmm_inputs, random_moe_inputs

M, K, N, E = 40, 8, 8, 4
T, L, F, TOPK = 12, 8, 16, 2
TILES = (8, 16, 40)
TOL = dict(rtol=1e-5, atol=1e-5)


@functools.cache
def _ffn():
    return jax.jit(lambda x, ids, w, w1, w3, w2: moe_ffn(x, ids, w, w1, w3, w2))


def check_token_permutation(ffn, inputs, perm):
    x, ids, w, w1, w3, w2 = inputs
    out = ffn(x, ids, w, w1, w3, w2)
    permuted = ffn(x[perm], ids[perm], w[perm], w1, w3, w2)
    chex.assert_shape(permuted, (T, L))
    chex.assert_trees_all_close(permuted, out[perm], **TOL)


@settings(max_examples=5, deadline=None)
@given(perm=st.permutations(range(T)), seed=st.integers(0, 2**16))
def test_moe_ffn_token_permutation_equivariant(perm, seed):
    check_token_permutation(_ffn(), random_moe_inputs(seed, T, L, F, E, TOPK, jnp.float32), np.asarray(perm))


def test_permutation_property_catches_a_position_dependent_combine():
    """A combine that pairs each token with the next token's router weights."""
    off_by_one = jax.jit(lambda x, ids, w, *ws: moe_ffn(x, ids, jnp.roll(w, 1, axis=0), *ws))
    inputs = random_moe_inputs(0, T, L, F, E, TOPK, jnp.float32)
    with pytest.raises(AssertionError):
        check_token_permutation(off_by_one, inputs, np.arange(T)[::-1])


@functools.cache
def _value_and_grads(tile: int | None):
    fn = (lambda a, b, g: grouped_matmul(a, b, g, implementation="xla")) if tile is None else (
        functools.partial(grouped_matmul_tiled, tile=tile))
    loss = lambda a, b, g: jnp.sum(fn(a, b, g) * jnp.cos(jnp.arange(M * N, dtype=jnp.float32).reshape(M, N)))
    return jax.jit(lambda a, b, g: (fn(a, b, g), jax.grad(loss, argnums=(0, 1))(a, b, g)))


def check_tiling_independent(variants, reference, group_sizes):
    lhs, rhs = random_gmm_inputs(int(group_sizes.sum()), M, K, N, E, jnp.float32)
    want = reference(lhs, rhs, group_sizes)
    for run in variants:
        got = run(lhs, rhs, group_sizes)
        chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
        chex.assert_trees_all_close(got, want, **TOL)
    out, (_, drhs) = want
    assert not np.asarray(out)[int(group_sizes.sum()):].any()  # rows past the groups
    assert not np.asarray(drhs)[np.asarray(group_sizes) == 0].any()  # empty groups get no gradient


@settings(max_examples=6, deadline=None)
@given(group_sizes=group_sizes_strategy(E, M))
def test_grouped_matmul_independent_of_tiling(group_sizes):
    group_sizes = jnp.asarray(group_sizes)
    check_tiling_independent([_value_and_grads(t) for t in TILES], _value_and_grads(None), group_sizes)


def test_tiling_property_catches_a_dropped_partial_tile():
    """A tile loop that skips the rows of a group's last, partial tile."""
    def drops_partial(lhs, rhs, gs):
        out, grads = _value_and_grads(16)(lhs, rhs, gs)
        ends = jnp.cumsum(gs)
        row = jnp.arange(M)[:, None]
        partial = jnp.any((row >= ends // 16 * 16) & (row < ends), axis=1)
        return jnp.where(partial[:, None], 0.0, out), grads
    with pytest.raises(AssertionError):
        check_tiling_independent([drops_partial], _value_and_grads(None), jnp.asarray([5, 0, 20, 11], jnp.int32))
