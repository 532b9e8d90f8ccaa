"""benchmarks/bench_expert_layout.py: its candidate kernels (W1 / W3 stored ``[E, F, L]``, and W2 ``[E, L, F]``)
compute what the package's decode kernels compute, so the timing it prints compares like with like."""

import json

import jax.numpy as jnp
import numpy as np

from benchmarks.bench_expert_layout import laid_out, main


def test_candidate_layouts_match_todays_kernels(tmp_path):
    """Interpreted at 16 experts of 128 × 128, k = 2: every kernel variant of either path within one
    bf16 ulp of the package's kernel on today's layout; the XLA read is only a rate."""
    out = tmp_path / "layout.json"
    assert main(["--interpret", "--experts", "16,128,128,2", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results["gather"]) == {"today bf=32 w=4", "t13 bf=32 w=4", "t13 bf=32 w=8"}
    assert len(results["dense"]) == 7
    for path in ("gather", "dense"):
        for name, row in results[path].items():
            if name != "xla read of the bytes":
                assert row["max_diff_ulp"] <= 1.0, (path, name, row)


def test_laid_out_swaps_the_named_stacks():
    ws = [jnp.zeros((2, 3, 5)), jnp.zeros((2, 3, 5)), jnp.zeros((2, 5, 3))]
    assert [w.shape for w in laid_out(ws, "plain")] == [(2, 3, 5), (2, 3, 5), (2, 5, 3)]
    assert [w.shape for w in laid_out(ws, "t13")] == [(2, 5, 3), (2, 5, 3), (2, 5, 3)]
    assert [w.shape for w in laid_out(ws, "t123")] == [(2, 5, 3), (2, 5, 3), (2, 3, 5)]
    assert np.array_equal(laid_out([jnp.arange(6.0).reshape(1, 2, 3)], "t13")[0][0], np.arange(6.0).reshape(2, 3).T)
