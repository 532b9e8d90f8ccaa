"""Decode on 8 fake devices (data 2 × tensor 4) equals decode on one (decode_worker.py, a subprocess):
the prefill and greedy steps of tiny(); the decode kernels' calls (KDA step, MLA attention) run per
shard in ``shard_map``, since XLA cannot partition a Pallas kernel."""

from tests.sharding.multidevice import run_worker
from tests.tolerances import F32_RTOL


def test_decode_on_a_mesh_matches_one_device():
    r = run_worker("tests.sharding.decode_worker")
    assert r["shape"][1] == 4  # the prefill's last logits and three steps
    assert r["decode_rel"] <= F32_RTOL
    assert r["attention_rel"] <= F32_RTOL
    assert r["shard_map"]
    # inside decode the KDA steps and the MLA attention run per shard (shard_map), not gathered; a
    # scanned run of layers traces its body once, so the call sites are at most the layers
    assert 1 <= r["kda_steps_per_shard"] <= r["kda_layers"]
    assert 1 <= r["mla_attention_per_shard"] <= r["mla_layers"]
