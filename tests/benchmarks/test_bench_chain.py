"""benchmarks/bench_chain.py: every op it times runs as a chain of dependent calls whose kernels agree with XLA's
product of the same chain, so the µs it prints compare like with like."""

import json

import pytest

from benchmarks.bench_chain import OPS, main


def test_interpreted_chains_agree_with_xla(tmp_path):
    out = tmp_path / "chain.json"
    assert main(["--interpret", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"128"} and set(rows["128"]) == set(OPS)


def test_bad_arguments_name_themselves():
    with pytest.raises(SystemExit, match="unknown --ops"):
        main(["--ops", "matvec,nope"])
    with pytest.raises(SystemExit, match="--widths must be positive multiples of 128, got \\[100\\]"):
        main(["--widths", "100"])
