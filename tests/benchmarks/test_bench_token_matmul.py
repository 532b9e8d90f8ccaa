"""benchmarks/bench_token_matmul.py: XLA's product and the kernel agree on every small() case (interpreted), so
the ratios it prints compare like with like."""

import json

from benchmarks.bench_token_matmul import cases, main
from pallas_kernels.mix_matvec.kernel_gpu_tokens import accepts


def test_interpreted_run_agrees_with_xla(tmp_path):
    out = tmp_path / "token_matmul.json"
    assert main(["--interpret", "--tokens", "8", "--cases", "small up_proj,small shared gate+up", "--out",
                 str(out)]) == 0
    rows = json.loads(out.read_text())["cases"]
    assert set(rows) == {"small up_proj", "small shared gate+up"}
    assert all(row["max_diff_bf16_ulp"] <= 1.0 for row in rows.values()), rows


def test_the_kernel_takes_every_case():
    import jax
    import jax.numpy as jnp

    for name, (D, N, n_w) in cases().items():
        x = jax.ShapeDtypeStruct((64, D), jnp.bfloat16)
        ws = (jax.ShapeDtypeStruct((N, D), jnp.bfloat16),) * n_w
        assert accepts(x, ws, (("activation", "situ"),) if n_w == 2 else None), name
