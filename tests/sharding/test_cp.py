"""Context-parallel KDA, short conv and MLA on 8 fake CPU devices equal the unsplit ops."""

import pytest

from tests.sharding.multidevice import run_worker
from tests.tolerances import F32_RTOL


@pytest.fixture(scope="module")
def results():
    return run_worker("tests.sharding.cp_worker")


@pytest.mark.parametrize("case", ["kda", "kda_seq8", "conv"])
def test_matches_single_device(results, case):
    r = results[case]
    assert all(v <= F32_RTOL for v in r.values()), r


def test_kda_collectives_independent_of_length(results):
    short, long = results["collectives_T64"], results["collectives_T128"]
    assert short, "expected the (M, N) exchanges in the compiled HLO"
    # the state pass is a prefix scan of log2(shards) neighbour exchanges, not a gather of every shard's pair
    assert not any("all-gather" in c for c in short), short
    assert short == long, (short, long)


def test_length_not_divisible_names_sizes(results):
    msg = results["err_length"]
    assert "T=40" in msg and "4 × 8 = 32" in msg, msg
