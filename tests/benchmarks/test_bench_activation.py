"""benchmarks/bench_activation.py: both sides through the ops, the floor, the comparison (interpreter)."""

import pytest

from benchmarks.bench_activation import _shape, run


@pytest.mark.parametrize("op", ["split", "packed"])
def test_a_case_times_both_sides_and_compares_them(op):
    row = run(op, 32, 256, "situ", reps=1, interpret=True)
    assert set(row["ms"]) == {f"{s} {d}" for s in ("xla", "pallas", "floor") for d in ("forward", "backward")}
    assert len(row["rel_rmse"]) == (2 if op == "packed" else 3) and max(row["rel_rmse"]) < 4e-3
    assert row["forward_speedup"] > 0 and _shape("131072x3072") == (131072, 3072)
