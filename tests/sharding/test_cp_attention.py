"""Context-parallel MLA attention (sharding/cp_attention.py) on 8 fake CPU devices equals the unsharded op.

The flash path (interpreted) must reproduce the unsharded flash kernel's rows with and without the
zig-zag schedule — its row maxima exactly (same tiles), its outputs to the rounding of the bf16
probabilities, which the key-chunk loop scales by each chunk's maximum instead of the row's — and
both the fp32 reference within bf16 tolerances; the XLA path the reference to fp32 rounding. Lowered for CUDA,
the flash path runs the Triton kernels (two of each when balanced) and moves only the gathered
latent, the query/output halves and their gradients. The MLA layer under a sequence mesh takes the
flash path and reproduces the unsharded layer's output.
"""

import pytest

from sharding.cp_attention import zigzag_routes
from tests.sharding.multidevice import run_worker
from tests.tolerances import BF16_FWD_RTOL, BF16_GRAD_RTOL, BF16_MODEL_RTOL, F32_RTOL

FLASH_CASES = ["seq4_balanced", "seq4_unbalanced", "seq2_balanced", "seq2_unbalanced"]


@pytest.fixture(scope="module")
def results():
    return run_worker("tests.sharding.cp_attention_worker")


@pytest.mark.parametrize("case", FLASH_CASES)
def test_flash_path_equals_unsharded(results, case):
    r = results[case]
    assert r["o_vs_flash"] <= BF16_FWD_RTOL and r["max_logit_vs_flash"] <= F32_RTOL, r
    assert r["o_vs_ref"] <= BF16_FWD_RTOL and r["max_logit_vs_ref"] <= BF16_FWD_RTOL, r
    assert r["grad_vs_ref"] <= BF16_GRAD_RTOL, r


def test_xla_path_equals_reference(results):
    assert all(v <= F32_RTOL for v in results["seq4_xla"].values()), results["seq4_xla"]


def test_mla_layer_runs_flash_under_context_parallel(results):
    r = results["mla_layer_seq4"]
    assert r["paths"] == ["pallas"], r
    assert r["y"] <= BF16_FWD_RTOL and r["max_logit"] <= F32_RTOL, r  # bf16 probabilities per key chunk
    # Parameter gradients also sum bf16 partials over the 8 token shards outside attention: the same
    # layer on a data × tensor mesh (no CP) differs from one device by 1.8e-2 too (q_a, kv_a).
    assert r["grads"] <= BF16_MODEL_RTOL, r


def test_flash_path_lowers_for_cuda(results):
    kernels = ["mla_flash_dkdv", "mla_flash_dq", "mla_flash_fwd"]
    balanced, plain = results["lower_balanced"], results["lower_unbalanced"]
    assert plain["kernels"] == kernels and balanced["kernels"] == sorted(kernels * 2)
    # Forward: latent, rope key, segment ids gathered; backward: the two gradients reduce-scattered.
    assert plain["collectives"] == {"all_gather": 3, "reduce_scatter": 2}
    # Balanced: two query halves out and two outputs back, the same again for their cotangents.
    assert balanced["collectives"] == {"all_gather": 3, "reduce_scatter": 2, "collective_permute": 8}


def test_train_step_with_pallas_attention_lowers_under_context_parallel(results):
    # Balanced: two kernel calls per pass; the forward runs twice (remat per layer).
    assert results["train_step_kernels"] == {"mla_flash_fwd": 4, "mla_flash_dkdv": 2, "mla_flash_dq": 2}


def test_balanced_needs_two_halves_per_shard(results):
    assert "T=40" in results["err_balanced"] and "= 16" in results["err_balanced"], results["err_balanced"]


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_zigzag_routes_balance_the_causal_work(shards):
    computed = {s: [] for s in range(shards)}
    for h, route in enumerate(zigzag_routes(shards)):
        assert sorted(d for _, d in route) == list(range(shards))  # a permutation per half
        for s, d in route:
            computed[d].append(2 * s + h)
    # Chunk c reaches c + 1 key chunks: every shard gets 2R + 1 of them.
    assert all(sum(c + 1 for c in chunks) == 2 * shards + 1 for chunks in computed.values()), computed
