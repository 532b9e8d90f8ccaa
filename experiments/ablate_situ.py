"""Ablation: SiTU-GLU against SwiGLU in every MLP (K3-style baseline, one size).

Hypothesis (K3 report; SPEC §4): SwiGLU's product ``silu(g)·u`` is unbounded, so the largest
activation inside the routed experts keeps growing during training (the outliers that hurt
low-precision training and serving); SiTU-GLU ``β1 tanh(g/β1)σ(g) · β2 tanh(u/β2)`` caps it at
β1·β2 = 100 while matching SwiGLU near 0, at no loss cost.
Differs from the baseline: ``mlp.activation = "swiglu"`` (routed, shared and dense MLPs).
Measured: held-out loss, and on a fixed held-out batch during training the largest |g|, |u| and
|act(g, u)| inside the routed experts of every MoE layer (recomputed from the expert inputs).
Caveat: a few hundred steps at width 96 may never reach activations near the cap; then the two
activations coincide and the result says only that.
Command (part of ``experiments/ablations.py``; alone ≈ 1 min on an H200):
    PYTHONPATH=. python experiments/ablate_situ.py [--tiny] [--out experiments/results]
Writes <out>/ablate_situ.{json,md,png}.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import ablation, common, families, probes

NAME = "ablate_situ"
KEYS = ("max_act", "max_gate", "max_up")


def variants(width: int) -> dict:
    base = families.k3_baseline(width)
    return {"SiTU-GLU (baseline)": base, "SwiGLU": families.with_activation(base, "swiglu")}


def expert_maxima(record: dict, key: str) -> tuple[list[int], list[float]]:
    """Per probe step, the largest value of ``key`` over the MoE layers."""
    steps, _, values = probes.by_layer(record["probes"], "experts", key)
    return steps, [max(row) for row in values]


def summarise(records: dict) -> dict:
    out = {}
    for label, r in records.items():
        out[label] = {"held_out_loss": r["held_out_loss"]}
        for key in KEYS:
            steps, maxima = expert_maxima(r, key)
            out[label][key] = {"steps": steps, "max_over_layers": maxima, "max_over_training": max(maxima)}
    return out


def markdown(result: dict) -> str:
    s = result["summary"]
    text = ablation.intro(result, "SiTU-GLU vs SwiGLU")
    text += common.markdown_table(ablation.LOSS_HEADER, ablation.loss_rows(result["runs"]))
    rows = [[label] + [f"{v[k]['max_over_layers'][-1]:.3g} (max {v[k]['max_over_training']:.3g})" for k in KEYS]
            for label, v in s.items()]
    text += "\nInside the routed experts (held-out batch; final step, and the maximum over training):\n\n"
    text += common.markdown_table(["run", "max abs act(g, u)", "max abs g", "max abs u"], rows)
    return text


def plot(result: dict, path: Path) -> bool:
    def draw(axes):
        ablation.plot_losses(axes[0][0], result["runs"])
        ax = axes[0][1]
        for i, (label, v) in enumerate(result["summary"].items()):
            ax.plot(v["max_act"]["steps"], v["max_act"]["max_over_layers"], "o-", color=f"C{i}", label=f"{label}: |act|")
            ax.plot(v["max_gate"]["steps"], v["max_gate"]["max_over_layers"], ":", color=f"C{i}", label=f"{label}: |g|")
        ax.axhline(100.0, color="k", lw=0.8, ls="--", label="SiTU bound β1·β2 = 100")
        ax.set(xlabel="step", ylabel="largest value inside the experts", yscale="log", title="expert activations")
        ax.legend(fontsize=6)

    return common.save_figure(draw, path, ncols=2)


def main(argv=None) -> dict:
    return ablation.ablation_main(NAME, __doc__, variants, summarise, markdown, plot, argv)


if __name__ == "__main__":
    common.cli(main)
