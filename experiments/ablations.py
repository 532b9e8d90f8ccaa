"""All five one-change ablations of the K3-style baseline, one command (the baseline trains once).

Runs, in order: ``ablate_attn_res``, ``ablate_situ``, ``ablate_kda_gate``, ``ablate_latent_moe``,
``ablate_balance`` (each script's docstring has its hypothesis). Seven training runs in all
(baseline + plain residual, SwiGLU, softplus gate, full-width experts, sign, none), stored in
``<out>/ablation_runs/``: a stopped call resumes, finished runs are loaded, not retrained.
Command (one H200; measured 2026-12-02: ≈ 11 min, ~90 s a run plus the first compile, so run it twice
within a 10-minute call limit — the second call resumes):
    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 experiments/ablations.py
Tiny CPU smoke version: ``--tiny``. Redraw plots from the JSON: ``--plot_only``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import (ablate_attn_res, ablate_balance, ablate_kda_gate, ablate_latent_moe, ablate_situ,
                         common)

ABLATIONS = (ablate_attn_res, ablate_situ, ablate_kda_gate, ablate_latent_moe, ablate_balance)


def main(argv=None) -> dict:
    common.parser(__doc__).parse_args(argv)  # reject bad flags before any work
    forwarded = list(argv if argv is not None else sys.argv[1:])
    start = time.perf_counter()
    results = {}
    for module in ABLATIONS:
        results[module.NAME] = module.main(forwarded)
        print(f"{module.NAME} done at {time.perf_counter() - start:.0f} s", flush=True)
    return results


if __name__ == "__main__":
    common.cli(main)
