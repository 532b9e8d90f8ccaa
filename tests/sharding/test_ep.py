"""Expert-parallel MoE on 8 fake CPU devices equals the single-device oracle (fwd and grads)."""

import pytest

from tests.sharding.multidevice import run_worker
from tests.tolerances import F32_RTOL


@pytest.fixture(scope="module")
def results():
    return run_worker("tests.sharding.ep_worker")


@pytest.mark.parametrize("case", ["a2a", "gather", "data_only"])
def test_matches_reference(results, case):
    r = results[case]
    assert r["fwd"] <= F32_RTOL and r["grad"] <= F32_RTOL, r
    assert r["dropped"] == 0


def test_a2a_path_taken_without_overflow(results):
    assert results["a2a"]["overflow"] == 0


def test_skewed_router_overflows_and_stays_exact(results):
    r = results["skewed"]
    assert r["overflow"] > 0, r  # the reserve was exceeded: the overflow path ran
    assert r["dropped"] == 0
    assert r["fwd"] <= F32_RTOL and r["grad"] <= F32_RTOL, r


def test_bad_input_names_sizes(results):
    assert "num_experts=12" in results["err_experts"] and "8" in results["err_experts"]
    assert "tokens=6" in results["err_tokens"] and "8" in results["err_tokens"]


def test_qb_histogram_pooled_over_every_token_axis(results):
    r = results["reductions"]
    assert r["qb"] <= F32_RTOL and r["mean"] <= F32_RTOL, r
    assert r["qb_local_differs"]  # one shard's histogram alone would give another bias
