"""``benchmarks.moe_groups``: a fresh router's near-even group sizes (``--groups router``) and the default
uneven draw."""

import jax
import numpy as np
import pytest

import benchmarks.moe_groups as moe_groups


@pytest.mark.parametrize("m, e", [(262144, 64), (1003, 4), (40, 8)])
def test_router_group_sizes_sum_to_m_near_evenly(m, e):
    sizes = np.asarray(moe_groups.router_group_sizes(jax.random.PRNGKey(0), m, e))
    assert sizes.shape == (e,) and sizes.sum() == m and sizes.min() >= 0
    if m >= 1000 * e:  # the counts of m / 8 tokens' 8 distinct experts: within a few % of m / E
        assert sizes.max() - sizes.min() < 0.1 * m / e, sizes


def test_groups_flag_picks_the_spread(monkeypatch):
    key = jax.random.PRNGKey(1)
    monkeypatch.setattr(moe_groups, "GROUPS", "router")
    router = np.asarray(moe_groups.random_group_sizes(key, 65536, 16))
    monkeypatch.setattr(moe_groups, "GROUPS", "uneven")
    uneven = np.asarray(moe_groups.random_group_sizes(key, 65536, 16))
    assert router.sum() == uneven.sum() == 65536
    assert np.ptp(router) < np.ptp(uneven)
