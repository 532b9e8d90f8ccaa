"""MoonEP on 8 fake CPU devices: a Zipf-skewed router, exact against the no-redundancy EP path and one
device, every rank within its static buffers; a re-plan mid-training changes nothing but the placement."""

import pytest

from tests.sharding.multidevice import run_worker
from tests.tolerances import F32_RTOL


@pytest.fixture(scope="module")
def layer():
    return run_worker("tests.sharding.moonep_worker")["expert8"]


def test_exact_against_ep_and_one_device(layer):
    assert layer["fwd"] <= F32_RTOL and layer["grad"] <= F32_RTOL, layer
    assert layer["fwd_vs_ep"] <= F32_RTOL and layer["grad_vs_ep"] <= F32_RTOL, layer
    assert layer["dropped"] == 0


def test_skewed_router_fits_the_static_buffers(layer):
    # Without redundancy the same reserve overflows (the mesh-wide fallback runs); with the plan
    # no rank receives more than its buffers, so the all-to-all path runs alone.
    assert layer["ep_overflow"] > 0 and layer["ep_received_max_mean"] > 1.5, layer
    assert layer["overflow"] == 0, layer
    assert layer["received_max_mean"] <= 1 + layer["reserve"], layer  # the stated run-time bound
    assert layer["planned_max_mean"] <= 1.01 and layer["replicas"] > 0, layer
    assert layer["received_max_mean"] < layer["ep_received_max_mean"], layer


@pytest.mark.slow
def test_placement_change_mid_training_is_bit_identical():
    r = run_worker("tests.sharding.moonep_train_worker")
    assert r["plan_changed"] and r["replicas"] > 0, r
    assert r["bit_identical"], r


def test_beyond_the_plan_is_computed_not_dropped(layer):
    r = layer["beyond_plan"]  # buffers with no reserve: the micro-batch's deviation from the plan overflows
    assert r["overflow"] > 0 and r["dropped"] == 0, r
    assert r["fwd"] <= F32_RTOL, r
