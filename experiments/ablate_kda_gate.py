"""Ablation: K3's lower-bounded KDA decay gate against Kimi-Linear's softplus gate (one size).

Hypothesis (K3 report; SPEC §2): with ``g = −5·sigmoid(exp(A_log)·z)`` every per-token log decay
is above −5, so over a 16-token tile the cumulative log decay stays in (−80, 0) and the
anchor-relative factors ``e^{±G}`` fit bf16/fp32 (|G| < 88.7): the diagonal tiles can be dense
matmuls. The unbounded softplus gate ``−exp(A_log)·softplus(z)`` lets a tile's decay exceed that
range, where ``e^{−G}`` overflows to inf. The bound should cost no loss.
Differs from the baseline: ``kda.gate_lower_bound = None`` (the softplus gate; it always runs the
XLA chunk scan, which is what every run here uses anyway).
Measured: held-out loss, and on a fixed held-out batch during training, per KDA layer: the most
negative and the 1st-percentile cumulative log decay of a 16-token tile, the fraction of
(tile, channel) pairs with |G| > 88.7 (e^{−G} overflows bf16 and fp32), and the fraction of
per-token decays e^g that are exactly 1 once rounded to bf16 (why SPEC §2 keeps them in fp32).
Command (part of ``experiments/ablations.py``; alone ≈ 1 min on an H200):
    PYTHONPATH=. python experiments/ablate_kda_gate.py [--tiny] [--out experiments/results]
Writes <out>/ablate_kda_gate.{json,md,png}.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import ablation, common, families, probes

NAME = "ablate_kda_gate"
KEYS = ("min_tile_log_decay", "p01_tile_log_decay", "overflow_fraction", "bf16_decay_is_one")
# The combining rule over KDA layers of each summary: the worst layer, or the mean for fractions.
COMBINE = {"min_tile_log_decay": min, "p01_tile_log_decay": min, "overflow_fraction": max,
           "bf16_decay_is_one": lambda v: sum(v) / len(v)}


def variants(width: int) -> dict:
    base = families.k3_baseline(width)
    return {"lower-bounded gate (baseline)": base, "softplus gate": families.with_softplus_gate(base)}


def summarise(records: dict) -> dict:
    out = {}
    for label, r in records.items():
        out[label] = {"held_out_loss": r["held_out_loss"]}
        for key in KEYS:
            steps, _, values = probes.by_layer(r["probes"], "decay", key)
            out[label][key] = {"steps": steps, "over_layers": [COMBINE[key](row) for row in values]}
    return out


def markdown(result: dict) -> str:
    s = result["summary"]
    text = ablation.intro(result, "lower-bounded vs softplus KDA gate")
    text += common.markdown_table(ablation.LOSS_HEADER, ablation.loss_rows(result["runs"]))
    rows = [[label, f"{v['min_tile_log_decay']['over_layers'][-1]:.1f} (min over training "
                    f"{min(v['min_tile_log_decay']['over_layers']):.1f})",
             f"{v['p01_tile_log_decay']['over_layers'][-1]:.1f}",
             f"{max(v['overflow_fraction']['over_layers']):.2e}", f"{v['bf16_decay_is_one']['over_layers'][-1]:.3f}"]
            for label, v in s.items()]
    text += (f"\nCumulative log decay G of a {probes.TILE}-token tile (held-out batch, all KDA layers; e^-G "
             f"overflows bf16/fp32 when -G > {probes.BF16_EXP_LIMIT:.1f}):\n\n")
    text += common.markdown_table(["run", "most negative G (final)", "1st percentile of G (final)",
                                   "fraction overflowing (max over training)", "e^g == 1 in bf16 (final)"], rows)
    return text


def plot(result: dict, path: Path) -> bool:
    def draw(axes):
        ablation.plot_losses(axes[0][0], result["runs"])
        ax = axes[0][1]
        for i, (label, v) in enumerate(result["summary"].items()):
            ax.plot(v["min_tile_log_decay"]["steps"], [-x for x in v["min_tile_log_decay"]["over_layers"]], "o-",
                    color=f"C{i}", label=f"{label}: most negative")
            ax.plot(v["p01_tile_log_decay"]["steps"], [-x for x in v["p01_tile_log_decay"]["over_layers"]], ":",
                    color=f"C{i}", label=f"{label}: 1st percentile")
        ax.axhline(probes.BF16_EXP_LIMIT, color="k", ls="--", lw=0.8, label="e^-G overflows bf16/fp32")
        ax.axhline(5 * probes.TILE, color="gray", ls=":", lw=0.8, label="bound 5 × 16")
        ax.set(xlabel="step", ylabel="-G: decay over a 16-token tile", yscale="log", title="tile log-decay range")
        ax.legend(fontsize=6)

    return common.save_figure(draw, path, ncols=2)


def main(argv=None) -> dict:
    return ablation.ablation_main(NAME, __doc__, variants, summarise, markdown, plot, argv)


if __name__ == "__main__":
    common.cli(main)
