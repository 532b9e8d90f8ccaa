"""benchmarks/bench_greedy_head.py: XLA's head + argmax and the greedy head kernel (interpreted) run on the same
inputs and pick the same tokens, so the ratio it prints compares like with like; a malformed tiling is named."""

import json

import pytest

from benchmarks.bench_greedy_head import main, parse_tiles
from pallas_kernels.head_argmax.kernel_gpu import HeadTiles


def test_interpreted_run_agrees_with_xla(tmp_path):
    out = tmp_path / "greedy_head.json"
    assert main(["--interpret", "--batches", "1,3", "--hidden", "64", "--vocab", "512", "--steps", "2",
                 "--tiles", "V64D32S2W4", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["batch"], r["head"]) for r in rows} == {(b, h) for b in (1, 3) for h in ("xla", "kernel", "V64D32S2W4")}
    assert all(r["same_tokens"] == 1.0 and r["us"] > 0 for r in rows)


def test_tiles_spec():
    assert parse_tiles("V256D64S3W8") == HeadTiles(block_v=256, block_d=64, num_stages=3, num_warps=8)
    with pytest.raises(ValueError, match="V<block_v>D<block_d>S<stages>W<warps>"):
        parse_tiles("V256D64")
