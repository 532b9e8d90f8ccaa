"""Acceptance: tiny() (float32) forward and gradients on meshes of 8 fake CPU devices equal the
single-device result; sharded init equals plain init.

The default run takes a 3-layer cut of tiny() on the two meshes that shard every axis
(data2_expert2_seq2, seq4_expert2; every layer kind, two AttnRes blocks) and on data2_expert4 (4
expert shards, and no sequence split, where KDA's short conv takes ``short_convs`` instead of the
context-parallel conv); ``-m slow`` runs the 6-layer tiny() on all four meshes. What only the slow
run adds: pure data parallelism over 8 (data8, a special case of the data axis the fast meshes shard).
Sharded init on data2_expert4 stays in the default run.
"""

import pytest

from tests.sharding.multidevice import run_worker
from tests.tolerances import F32_RTOL

FAST_MESHES = ["data2_expert2_seq2", "seq4_expert2", "data2_expert4"]
ALL_MESHES = ["data8", *FAST_MESHES]


@pytest.fixture(scope="module")
def results():
    return run_worker("tests.sharding.model_worker", timeout=1200)


@pytest.mark.parametrize("mesh", FAST_MESHES)
def test_forward_and_grads_match_one_device(results, mesh):
    _check(results[mesh])


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ALL_MESHES)
def test_full_tiny_on_all_meshes_matches_one_device(mesh):
    _check(run_worker("tests.sharding.model_worker", timeout=2400, args=("--all",))[mesh])


def _check(r):
    assert r["fwd"] <= F32_RTOL, r
    assert r["grad"] <= F32_RTOL, r  # the worst parameter leaf
    assert r["loads_equal"], r  # router loads (QB input) identical: no token lost or duplicated
    assert r["ep_dropped"] == 0, r


def test_sharded_init(results):
    assert results["sharded_init_equal"]
    assert results["w1_shard_shape"] == [4, 32, 32]  # 16 experts over expert=4, latent 32 whole
