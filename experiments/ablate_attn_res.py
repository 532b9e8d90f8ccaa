"""Ablation: Block AttnRes against the plain pre-norm residual (K3-style baseline, one size).

Hypothesis (K3 report; SPEC §5): with the plain pre-norm residual every layer adds to one stream,
so the hidden state entering deeper layers grows in norm (PreNorm dilution) and each layer's
contribution shrinks relative to it; Block AttnRes feeds each layer a softmax mix of block sums,
which keeps that input's scale flat with depth, and lowers the loss.
Differs from the baseline: ``attn_res=None`` (``families.without_attn_res``); nothing else.
Measured: held-out loss, and the RMS of the input of every layer's attention norm (the stream for
the plain residual, the AttnRes mix for the baseline) on a fixed held-out batch during training.
Caveat: 4 layers (block size 2) is the shallowest stack with a block structure; the norm growth
the report targets is over 93 layers.
Command (part of ``experiments/ablations.py``; alone ≈ 1 min on an H200):
    PYTHONPATH=. python experiments/ablate_attn_res.py [--tiny] [--out experiments/results]
Writes <out>/ablate_attn_res.{json,md,png}.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import ablation, common, families, probes

NAME = "ablate_attn_res"


def variants(width: int) -> dict:
    base = families.k3_baseline(width)
    return {"Block AttnRes (baseline)": base, "plain residual": families.without_attn_res(base)}


def summarise(records: dict) -> dict:
    out = {}
    for label, r in records.items():
        steps, layers, values = probes.by_layer(r["probes"], "hidden")
        final = values[-1]
        out[label] = {"held_out_loss": r["held_out_loss"], "final_hidden_rms": dict(zip(layers, final)),
                      "last_over_first_layer": final[-1] / final[0]}
    return out


def markdown(result: dict) -> str:
    s = result["summary"]
    text = ablation.intro(result, "Block AttnRes vs plain residual")
    text += common.markdown_table(ablation.LOSS_HEADER, ablation.loss_rows(result["runs"]))
    layers = list(next(iter(s.values()))["final_hidden_rms"])
    rows = [[label] + [f"{v['final_hidden_rms'][l]:.3g}" for l in layers] + [f"{v['last_over_first_layer']:.2f}"]
            for label, v in s.items()]
    text += "\nRMS of each layer's input at the end of training (held-out batch):\n\n"
    text += common.markdown_table(["run"] + layers + ["last / first"], rows)
    return text


def plot(result: dict, path: Path) -> bool:
    def draw(axes):
        ablation.plot_losses(axes[0][0], result["runs"])
        ax = axes[0][1]
        for i, (label, r) in enumerate(result["runs"].items()):
            steps, layers, values = probes.by_layer(r["probes"], "hidden")
            for j, (step, row) in enumerate(zip(steps, values)):
                if j in (0, len(steps) // 2, len(steps) - 1):
                    ax.plot(range(len(layers)), row, color=f"C{i}", alpha=0.4 + 0.6 * j / max(len(steps) - 1, 1),
                            marker="o", label=f"{label}, step {step}")
        ax.set(xlabel="layer", ylabel="RMS of the layer's input", yscale="log", title="hidden-state norm by depth")
        ax.legend(fontsize=6)

    return common.save_figure(draw, path, ncols=2)


def main(argv=None) -> dict:
    return ablation.ablation_main(NAME, __doc__, variants, summarise, markdown, plot, argv)


if __name__ == "__main__":
    common.cli(main)
