"""Ablation: Quantile Balancing against the sign update and no balancing, in training (one size).

Extends ``experiments/balance_qb_vs_sign.py`` — which compares the bias updates on a simulated
router and in a short tiny() run — to the ablations' K3-style baseline on real text: same methods
(its ``METHODS`` less the exact variant), now inside the full training step.
Hypothesis (K3 report; SPEC §6): QB keeps every expert's load near k·T/E from the first steps
(max/mean load near the sampling floor), the sign update (γ = 1e-3) is still far from balance
after a few hundred steps, and no balancing leaves experts starved; balance costs no loss.
Differs from the baseline (``qb_hist``): ``balance.method`` = "sign" or "none".
Measured: held-out loss, and per step the worst MoE layer's max/mean expert load, the mean load
coefficient of variation and the number of experts without tokens (``k3jax.train.stats``).
Command (part of ``experiments/ablations.py``; alone ≈ 1.5 min on an H200):
    PYTHONPATH=. python experiments/ablate_balance.py [--tiny] [--out experiments/results]
Writes <out>/ablate_balance.{json,md,png}.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import ablation, common, families
from experiments.balance_qb_vs_sign import METHODS

NAME = "ablate_balance"
TRAINED_METHODS = tuple(m for m in METHODS if m != "qb_exact")  # the baseline's qb_hist first
LOAD_KEYS = ("load_max_mean", "load_cv", "load_zero_experts")


def variants(width: int) -> dict:
    base = families.k3_baseline(width)
    label = {"qb_hist": "QB (baseline)", "sign": "sign update", "none": "no balancing"}
    return {label[m]: base if m == base.balance.method else families.with_balance(base, m) for m in TRAINED_METHODS}


def summarise(records: dict) -> dict:
    return {label: {"held_out_loss": r["held_out_loss"], **{f"tail_{k}": ablation.tail_mean(r["history"][k])
                                                            for k in LOAD_KEYS},
                    "first_max_mean": r["history"]["load_max_mean"][0]}
            for label, r in records.items()}


def markdown(result: dict) -> str:
    text = ablation.intro(result, "Quantile Balancing vs sign update vs none")
    text += common.markdown_table(ablation.LOSS_HEADER, ablation.loss_rows(result["runs"]))
    rows = [[label, f"{v['first_max_mean']:.2f}", f"{v['tail_load_max_mean']:.2f}", f"{v['tail_load_cv']:.3f}",
             f"{v['tail_load_zero_experts']:.1f}"] for label, v in result["summary"].items()]
    text += "\nExpert load (worst MoE layer's max/mean; mean CV over layers; last 20 % of the steps):\n\n"
    text += common.markdown_table(["run", "max/mean at step 1", "max/mean", "CV", "experts without tokens"], rows)
    return text


def plot(result: dict, path: Path) -> bool:
    def draw(axes):
        ablation.plot_losses(axes[0][0], result["runs"])
        ax = axes[0][1]
        for label, r in result["runs"].items():
            ax.plot(range(1, len(r["history"]["load_max_mean"]) + 1), r["history"]["load_max_mean"], label=label)
        ax.set(xlabel="step", ylabel="max / mean expert load (worst layer)", yscale="log", title="balance")
        ax.legend(fontsize=7)

    return common.save_figure(draw, path, ncols=2)


def main(argv=None) -> dict:
    return ablation.ablation_main(NAME, __doc__, variants, summarise, markdown, plot, argv)


if __name__ == "__main__":
    common.cli(main)
