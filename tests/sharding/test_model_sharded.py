"""Acceptance: tiny() (float32) forward and gradients on four meshes of 8 fake CPU devices equal
the single-device result; sharded init equals plain init."""

import pytest

from tests.sharding.multidevice import run_worker
from tests.tolerances import F32_RTOL

MESHES = ["data8", "data2_expert4", "data2_expert2_seq2", "seq4_expert2"]


@pytest.fixture(scope="module")
def results():
    return run_worker("tests.sharding.model_worker", timeout=1200)


@pytest.mark.parametrize("mesh", MESHES)
def test_forward_and_grads_match_one_device(results, mesh):
    r = results[mesh]
    assert r["fwd"] <= F32_RTOL, r
    assert r["grad"] <= F32_RTOL, r  # the worst parameter leaf
    assert r["loads_equal"], r  # router loads (QB input) identical: no token lost or duplicated
    assert r["ep_dropped"] == 0, r


def test_sharded_init(results):
    assert results["sharded_init_equal"]
    assert results["w1_shard_shape"] == [4, 32, 32]  # 16 experts over expert=4, latent 32 whole
