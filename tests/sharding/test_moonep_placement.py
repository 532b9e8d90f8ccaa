"""The MoonEP planner: conservation, never worse, near-perfect balance on Zipf loads; routing to replicas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sharding.moonep_placement import (active_replicas, plan_replicas, planned_rank_loads, share_intervals,
                                       update_placement, valid_slots)

_plan = jax.jit(plan_replicas, static_argnums=(1, 2))
_planned = jax.jit(planned_rank_loads, static_argnums=3)
_intervals = jax.jit(share_intervals, static_argnums=(2, 3))


def zipf_loads(num_experts, exponent, seed=0):
    pop = 1.0 / np.arange(1, num_experts + 1) ** exponent
    np.random.default_rng(seed).shuffle(pop)
    return jnp.asarray(pop / pop.sum() * num_experts * 100, jnp.float32)


@pytest.mark.parametrize("num_experts,ep,replicas,exponent,bound", [(64, 8, 16, 1.0, 1.01), (64, 8, 16, 0.6, 1.001),
                                                                    (64, 8, 8, 0.6, 1.1)])
def test_zipf_loads_balanced(num_experts, ep, replicas, exponent, bound):
    loads = zipf_loads(num_experts, exponent)
    planned = _planned(loads, *_plan(loads, ep, replicas), ep)
    home = loads.reshape(ep, -1).sum(1)
    assert float(planned.max() / planned.mean()) <= bound < float(home.max() / home.mean())


@settings(max_examples=10, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=32, max_size=32), st.sampled_from([(4, 8), (8, 16)]))
def test_conserves_and_never_raises_the_max(raw, layout):
    ep, replicas = layout
    loads = jnp.asarray(raw, jnp.float32)
    expert, share = _plan(loads, ep, replicas)
    planned = _planned(loads, expert, share, ep)
    home = loads.reshape(ep, -1).sum(1)
    assert bool(jnp.all(valid_slots(expert, 32, ep)))
    assert bool(jnp.all((share >= 0) & (share <= 1)))
    np.testing.assert_allclose(float(planned.sum()), float(loads.sum()), rtol=1e-5)
    assert float(planned.max()) <= float(home.max()) * (1 + 1e-5) + 1e-3
    home_frac, lo, hi = _intervals(expert, share, 32, ep)
    assert bool(jnp.all(home_frac >= 0)) and bool(jnp.all(hi <= 1 + 1e-6))


def test_bad_layout_names_the_sizes():
    with pytest.raises(ValueError, match="redundant_experts=6.*8"):
        plan_replicas(jnp.ones(64), 8, 6)
    with pytest.raises(ValueError, match="num_experts=60"):
        plan_replicas(jnp.ones(60), 8, 8)


def test_update_replans_every_n_steps_on_stacked_layers():
    loads = jnp.stack([zipf_loads(32, 1.0, seed) for seed in range(3)]).astype(jnp.int32)
    node = {"placement_loads": jnp.zeros((3, 32)), "replica_expert": jnp.zeros((3, 8), jnp.int32),
            "replica_share": jnp.zeros((3, 8))}
    update = jax.jit(lambda node, step: update_placement(node, loads, step, every=2, ep=8))
    kept = update(node, jnp.int32(3))
    assert not bool(jnp.any(kept["replica_share"])) and bool(jnp.all(kept["placement_loads"] == loads))
    new = update(kept, jnp.int32(4))
    assert not bool(jnp.any(new["placement_loads"]))
    np.testing.assert_array_equal(new["replica_expert"][1], _plan(2.0 * loads[1].astype(jnp.float32), 8, 8)[0])
    assert int(active_replicas(new["replica_expert"], new["replica_share"], 32, 8)) > 0
