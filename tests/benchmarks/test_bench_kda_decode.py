"""benchmarks/bench_kda_decode.py: its four paths run on the same inputs and agree (the kernels interpreted),
so the ratios it prints compare like with like; its inputs are laid out as the KDA layer packs them."""

import json

from benchmarks.bench_kda_decode import SHAPES, inputs, main
from pallas_kernels.kda.kernel_gpu_decode import fused_accepts
from tests.tolerances import BF16_FWD_RTOL


def test_interpreted_run_agrees_with_xla(tmp_path):
    out = tmp_path / "kda_decode.json"
    assert main(["--interpret", "--steps", "2", "--shapes", "small b1,small b1 t4", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["shapes"]
    assert set(rows) == {"small b1", "small b1 t4"}
    for name, row in rows.items():
        assert set(row["us"]) == {"xla", "unfused", "fused", "fused_z"}
        assert max(row["rel_deviation"].values()) <= BF16_FWD_RTOL, (name, row)


def test_inputs_are_the_layers():
    """small()'s packed KDA projections are 4232 wide (q, k, v, the output gate 4 × 8 × 128, β 8, f_a 128);
    the fused kernel takes every shape the benchmark times."""
    for name, (B, T, H, K) in SHAPES.items():
        xs, static = inputs(B, T, H, K)
        assert fused_accepts(*xs, static["offsets"]), name
    assert inputs(1, 1, 8, 128)[0][0].shape[-1] == 4232
