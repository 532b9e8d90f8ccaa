"""benchmarks/bench_mla_decode.py ``--op output``: XLA's epilogue and the output kernel (interpreted) run on the
same inputs and agree, below and within one row group, so the ratio it prints compares like with like."""

import json

from benchmarks.bench_mla_decode import main
from tests.tolerances import BF16_FWD_RTOL


def test_output_op_interpreted_agrees_with_xla(tmp_path):
    out = tmp_path / "mla_output.json"
    assert main(["--op", "output", "--interpret", "--steps", "2", "--batches", "1,3", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["batches"]
    assert set(rows) == {"1", "3"}
    for batch, row in rows.items():
        assert set(row["us"]) == {"xla", "kernel"}
        assert row["rel_deviation"] <= BF16_FWD_RTOL, (batch, row)
