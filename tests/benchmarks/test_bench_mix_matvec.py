"""benchmarks/bench_mix_matvec.py: every case it times runs the kernel (interpreted) and XLA's path on the
same inputs and agrees with it to the input's rounding, so the ratio it prints compares like with like."""

import json

from benchmarks.bench_mix_matvec import cases, main


def test_interpreted_run_agrees_with_xla(tmp_path):
    out = tmp_path / "mix.json"
    assert main(["--interpret", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["cases"]
    assert set(rows) == {n for n in cases() if not n.startswith("k3") and "head" not in n}
    for name, row in rows.items():
        assert row["max_diff_bf16_ulp"] <= 1.0, (name, row)


def test_cases_are_the_decode_steps_projections():
    """small()'s packed KDA inputs are 4232 outputs (q, k, v 3 × 8 × 128, the gates' ranks and heads), its MLA
    ones 704 (q_a 384, kv_a 256 + 64); K3 mixes over 9 sources at 7168 wide."""
    c = cases()
    assert (c["small kda inputs"]["N"], c["small mla inputs"]["N"]) == (4232, 704)
    assert (c["k3 kda inputs"]["D"], c["k3 kda inputs"]["sources"]) == (7168, 9)
