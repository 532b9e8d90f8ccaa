"""The sharded train step's pieces on 8 fake CPU devices (tests/sharding/scaling_worker.py)."""

import pytest

from tests.sharding.multidevice import run_worker
from tests.tolerances import F32_RTOL


@pytest.fixture(scope="module")
def results():
    return run_worker("tests.sharding.scaling_worker")


@pytest.mark.parametrize("mesh", ["ce_data_expert", "ce_sequence"])
def test_head_ce_sharded_matches_unsharded(results, mesh):
    r = results[mesh]
    assert r["loss"] <= F32_RTOL and r["grad"] <= F32_RTOL, r


@pytest.mark.parametrize("mesh", ["ce_data_expert", "ce_sequence"])
def test_head_ce_sharded_gathers_no_features(results, mesh):
    assert results[mesh]["all_gathers"] == [], results[mesh]


def test_head_ce_sharded_bad_batch_names_sizes(results):
    msg = results["ce_data_expert"]["err"]
    assert msg and "features.shape=(3," in msg and "8" in msg, msg


def test_kda_cp_with_k_not_v_matches_unsplit(results):
    r = results["kda_k_ne_v"]
    assert r["fwd"] <= F32_RTOL and r["grad"] <= F32_RTOL, r


def test_ep_backward_has_no_float_scatter(results):
    assert results["ep_hlo"]["float_scatters"] == [], results["ep_hlo"]


def test_ep_overflow_rounds_hold_no_gathered_assignments(results):
    # The overflow runs further rounds of the a2a exchange (in while loops, forward and backward),
    # never a buffer of every expert rank's assignments (the old all-gather fallback: 14 GiB per
    # layer at K3's widths).
    r = results["ep_hlo"]
    assert r["while_loops"] >= 2, r
    assert r["max_rows"] < r["gather_rows"], r


def test_moe_routes_local_tokens_and_sums_statistics(results):
    r = results["moe_routing"]
    assert r["fwd"] <= F32_RTOL, r
    assert r["stats_equal"] and all(r["stats_equal"].values()), r
    assert r["topk_rows"] == [r["local_tokens"]], r
