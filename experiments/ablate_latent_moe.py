"""Ablation: LatentMoE against full-width experts at equal active expert FLOPs (one size).

Hypothesis (K3 report, after NVIDIA's LatentMoE; SPEC §4): routing in a latent L = D/2 halves the
cost of each expert, which buys twice the experts and twice the experts per token at the same
active FLOPs and the same expert parameters — more combinations per token — and lowers the loss.
Differs from the baseline: ``moe.latent_dim = None`` (no down/up projection, no latent norm), E and
k halved (224 / 4 → 112 / 2, so E/k stays 56), expert width F unchanged: routed expert FLOPs and
parameters are equal; the baseline additionally spends 2·D·L per token on its projections and
has a router twice as wide (0.603 M against 0.543 M active parameters at width 96; the table lists
each run's FLOPs per token, so the difference is visible).
Measured: held-out loss, FLOPs per token, parameters.
Command (part of ``experiments/ablations.py``; alone ≈ 1 min on an H200):
    PYTHONPATH=. python experiments/ablate_latent_moe.py [--tiny] [--out experiments/results]
Writes <out>/ablate_latent_moe.{json,md,png}.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import ablation, common, families

NAME = "ablate_latent_moe"


def variants(width: int) -> dict:
    base = families.k3_baseline(width)
    return {"LatentMoE L = D/2 (baseline)": base, "full-width experts": families.full_width_experts(base)}


def summarise(records: dict) -> dict:
    return {label: {"held_out_loss": r["held_out_loss"], "flops_per_token": r["flops_per_token"],
                    "params_total": r["params_total"], "params_active": r["params_active"]}
            for label, r in records.items()}


def markdown(result: dict) -> str:
    text = ablation.intro(result, "LatentMoE vs full-width experts at equal routed-expert FLOPs")
    return text + common.markdown_table(ablation.LOSS_HEADER, ablation.loss_rows(result["runs"]))


def plot(result: dict, path: Path) -> bool:
    def draw(axes):
        ablation.plot_losses(axes[0][0], result["runs"])

    return common.save_figure(draw, path)


def main(argv=None) -> dict:
    return ablation.ablation_main(NAME, __doc__, variants, summarise, markdown, plot, argv)


if __name__ == "__main__":
    common.cli(main)
