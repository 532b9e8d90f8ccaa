"""The CPU tile loop (``pallas_kernels.moe.tiled``) against the dense one-hot oracle, and its cost."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from pallas_kernels.moe import grouped_matmul, moe_ffn
from pallas_kernels.moe.ops import resolve_implementation
from pallas_kernels.moe.reference import grouped_matmul_dense, moe_ffn_dense
from pallas_kernels.moe.tiled import grouped_matmul_tiled, schedule
from tests.pallas_kernels.moe.conftest import (
    gmm_value_and_grads,
    group_sizes_strategy,
    random_gmm_inputs,
    random_moe_inputs,
)
from tests.tolerances import BF16_FWD_RTOL, BF16_GRAD_RTOL, F32_RTOL, F64_RTOL, rel_rmse

M, K, N, E = 40, 8, 6, 5


_TILED = {t: gmm_value_and_grads(lambda a, b, g, t=t: grouped_matmul_tiled(a, b, g, tile=t)) for t in (8, 16, 128)}
_DENSE = gmm_value_and_grads(grouped_matmul_dense)


@pytest.mark.parametrize("tile", sorted(_TILED))
@settings(max_examples=10, deadline=None)
@given(gs=group_sizes_strategy(E, M))
def test_tiled_matches_dense(tile, gs):
    """Empty groups, all rows in one group, rows in no group, tiles straddling groups."""
    lhs, rhs = random_gmm_inputs(0, M, K, N, E, jnp.float32)
    gs = jnp.asarray(gs)
    (_, (da, db)), (_, (ea, eb)) = _TILED[tile](lhs, rhs, gs), _DENSE(lhs, rhs, gs)
    out = jax.jit(grouped_matmul_tiled, static_argnames="tile")(lhs, rhs, gs, tile=tile)
    assert rel_rmse(out, grouped_matmul_dense(lhs, rhs, gs)) < F32_RTOL
    assert np.all(np.asarray(out)[int(gs.sum()):] == 0)
    assert rel_rmse(da, ea) < F32_RTOL and rel_rmse(db, eb) < F32_RTOL


def test_tiled_bf16_and_float64():
    gs = jnp.array([7, 0, 20, 1, 9], jnp.int32)
    lhs, rhs = random_gmm_inputs(1, M, K, N, E, jnp.bfloat16)
    f32 = lambda x: x.astype(jnp.float32)
    (_, (da, db)) = gmm_value_and_grads(grouped_matmul_tiled)(lhs, rhs, gs)
    (_, (ea, eb)) = gmm_value_and_grads(grouped_matmul_dense)(f32(lhs), f32(rhs), gs)
    out = grouped_matmul_tiled(lhs, rhs, gs)
    assert out.dtype == jnp.bfloat16 and da.dtype == jnp.bfloat16 and db.dtype == jnp.bfloat16
    assert rel_rmse(out, grouped_matmul_dense(f32(lhs), f32(rhs), gs)) < BF16_FWD_RTOL
    assert rel_rmse(da, ea) < BF16_GRAD_RTOL and rel_rmse(db, eb) < BF16_GRAD_RTOL
    with jax.enable_x64(True):
        lhs, rhs = random_gmm_inputs(2, M, K, N, E, jnp.float64)
        out = grouped_matmul_tiled(lhs, rhs, gs)
        assert out.dtype == jnp.float64
        assert rel_rmse(out, grouped_matmul_dense(lhs, rhs, gs)) < F64_RTOL


def test_schedule_covers_every_row_once():
    """Every (row, its group) pair is in exactly one valid work item, within the static length."""
    gs = jnp.array([0, 3, 0, 0, 30, 2, 0], jnp.int32)
    tile, m = 8, 40
    item_tile, item_expert, valid, rows = map(np.asarray, schedule(gs, m, tile))
    assert len(item_tile) == -(-m // tile) + len(gs) - 1
    seen = np.zeros(m, int)
    for t, e, ok in zip(item_tile, item_expert, valid):
        if ok:
            r = np.arange(t * tile, min((t + 1) * tile, m))
            seen[r[rows[r] == e]] += 1
    np.testing.assert_array_equal(seen, (np.arange(m) < int(gs.sum())).astype(int))


def test_cpu_default_is_the_tile_loop_and_costs_no_expansion():
    """On CPU ``implementation=None`` runs the tile loop: FLOPs near the ideal, not E times it."""
    assert resolve_implementation(None, False, None, jnp.bfloat16) == "tiled"
    assert resolve_implementation("xla", False, None, jnp.bfloat16) == "xla"
    m, k, n, e = 2048, 64, 64, 32
    lhs, rhs = random_gmm_inputs(3, m, k, n, e, jnp.float32)
    gs = jnp.full((e,), m // e, jnp.int32)

    def flops(fn):
        cost = jax.jit(fn).lower(lhs, rhs, gs).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    ideal = 2 * m * k * n
    assert flops(grouped_matmul) < 2 * ideal  # tile 128 over 2048 rows and 32 groups: 1.5x at most
    assert flops(lambda a, b, g: grouped_matmul(a, b, g, implementation="xla")) > 8 * ideal  # why this exists


def test_moe_ffn_default_path_matches_dense():
    x, ids, w, w1, w3, w2 = random_moe_inputs(4, 24, 8, 12, E, 2, jnp.float32)
    out = jax.jit(moe_ffn)(x, ids, w, w1, w3, w2)
    assert rel_rmse(out, moe_ffn_dense(x, ids, w, w1, w3, w2)) < F32_RTOL


def test_tile_must_be_positive():
    lhs, rhs = random_gmm_inputs(5, 8, 4, 4, 2, jnp.float32)
    with pytest.raises(ValueError, match="tile"):
        grouped_matmul_tiled(lhs, rhs, jnp.array([4, 4], jnp.int32), tile=0)
