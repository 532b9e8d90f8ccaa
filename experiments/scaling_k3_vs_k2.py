"""Scaling study: loss against training compute for a K2-style and a K3-style family of small models.

Hypothesis (K3 report): the K3 changes together (hybrid 3:1 KDA/MLA, SiTU-GLU, Block AttnRes,
LatentMoE with E/k = 56, two shared experts, Quantile Balancing) reach a given loss with less
training compute than the K2 design (the report: 2.5× less). Here: the same comparison at 1-12 M
parameters, on bytes of Python source.

Families (``experiments/families.py``): K2-style = MLA+RoPE every layer, SwiGLU, plain residual,
full-width experts, E/k = 48, one shared expert, sign-update balancing; K3-style = the list
above. Same depth (4 layers), head sizes, expert width, k, vocabulary, data, seed and recipe.
Sizes: hidden width 64, 96, 128, 160 per family (≈ 23× compute from the smallest to the largest).
Tokens: 20 per active parameter (Chinchilla's rule, on the parameters a token touches), in
batches of 32 × 512 bytes of the interpreter's standard library (``experiments/runs.py``).
Recipe: per-head Muon + AdamW + QK-Clip (k3jax defaults), cosine schedule with 5 % warmup; the
peak learning rate is tuned once per family at the smallest width over ``LRS`` (the best of
those runs is also that width's point) and reused at every larger width.
Compute: training FLOPs per token (``k3jax.train.metrics.flops_per_token``: 6 · active
parameters plus the attention / KDA terms at 512 tokens) × tokens trained. Fit, target loss and
bootstrap interval: ``experiments/scaling_fit.py``.

How far this is from the report: the report's runs are ~10^3-10^5× larger in parameters and
~10^6× in tokens, on a web-scale multilingual corpus with the 160 K-token BPE; here 4 layers,
byte-level Python source, a few million tokens per run and one seed per point. A multiplier here
says which design is more compute-efficient for tiny models on this data, not at K3's scale.

Command (one H200; estimated ≈ 7-9 min with 12 compilations, not yet measured there; resumable — rerun the same command to
continue a study stopped by ``--budget_s`` or by the session):
    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 experiments/scaling_k3_vs_k2.py --budget_s 480
CPU smoke test: ``--tiny``. Redraw the plot and table from the JSON: ``--plot_only``.
Writes <out>/scaling_k3_vs_k2.{json,md,png} and one JSON per finished run in <out>/scaling_runs/.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from experiments import common, families, runs, scaling_fit

NAME = "scaling_k3_vs_k2"


@dataclasses.dataclass(frozen=True)
class Study:
    widths: tuple[int, ...] = (64, 96, 128, 160)
    lrs: tuple[float, ...] = (2e-3, 5e-3, 1.2e-2)
    tokens_per_param: float = 20.0
    batch: int = 32
    seq: int = families.SEQ_LEN
    eval_batches: int = 8

    def steps(self, active_params: int) -> int:
        return max(1, math.ceil(self.tokens_per_param * active_params / (self.batch * self.seq)))


TINY = Study(widths=(64, 96), lrs=(5e-3,), tokens_per_param=0.002, batch=2, seq=64, eval_batches=2)


def run_name(family: str, width: int, lr: float) -> str:
    return f"{family}_d{width}_lr{lr:g}"


def plan(study: Study, best_lr: dict[str, float]) -> list[tuple[str, int, float]]:
    """Runs in order: the learning-rate sweep at the smallest width, then each larger width with the
    family's best rate (known once its sweep is done), widths ascending, families alternating."""
    first = [(f, study.widths[0], lr) for f in families.FAMILIES for lr in study.lrs]
    rest = [(f, w, best_lr[f]) for w in study.widths[1:] for f in families.FAMILIES if f in best_lr]
    return first + rest


def best_rates(study: Study, done: dict[str, dict]) -> dict[str, float]:
    """The sweep's winner per family whose sweep is complete."""
    best = {}
    for f in families.FAMILIES:
        sweep = [done.get(run_name(f, study.widths[0], lr)) for lr in study.lrs]
        if all(sweep):
            best[f] = min(zip(sweep, study.lrs), key=lambda p: p[0]["held_out_loss"])[1]
    return best


def recipe_for(study: Study, family: str, width: int, lr: float) -> runs.Recipe:
    """The run's recipe: the tokens-per-parameter rule sets its steps."""
    active = runs.model_numbers(families.family_model(family, width), study.seq)["params_active"]
    return runs.Recipe(learning_rate=lr, steps=study.steps(active), batch_size=study.batch, seq_len=study.seq)


def run_study(study: Study, out: Path, cache: Path, budget_s: float | None, tiny: bool) -> dict[str, dict]:
    """Train every planned run not yet in ``<out>/scaling_runs/`` (stored runs of another recipe are redone)."""
    store = common.RunStore(out / f"scaling_runs{'_tiny' if tiny else ''}")
    budget = common.Budget(budget_s)
    max_steps = max(recipe_for(study, f, study.widths[-1], 1.0).steps for f in families.FAMILIES)
    data = held = None
    done = {n: r for n, r in store.all().items()
            if r["recipe"] == dataclasses.asdict(recipe_for(study, r["family"], r["width"], r["recipe"]["learning_rate"]))}
    while True:
        todo = [p for p in plan(study, best_rates(study, done)) if run_name(*p) not in done]
        if not todo:
            return done
        family, width, lr = todo[0]
        model = families.family_model(family, width)
        recipe = recipe_for(study, family, width, lr)
        if not budget.allows(recipe.steps):
            print(f"budget: {budget.elapsed():.0f} s used of {budget_s} s; stopping before {run_name(*todo[0])} "
                  f"({len(todo)} runs left; rerun the same command to continue)", flush=True)
            return done
        if data is None:
            data = runs.cached_batches(cache, "train", study.batch, study.seq, max_steps)
            held = runs.cached_batches(cache, "validation", study.batch, study.seq, study.eval_batches)
        print(f"run {run_name(*todo[0])}: {recipe.steps} steps", flush=True)
        record = runs.train(model, recipe, data, held)
        record.update(family=family, width=width, compute=record["flops_per_token"] * record["tokens"])
        store.put(run_name(*todo[0]), record)
        done[run_name(*todo[0])] = record
        budget.record(record["seconds"], recipe.steps, fixed=record["compile_seconds"])


def analyse(study: Study, done: dict[str, dict]) -> dict:
    """The points of each family's curve (best rate per width), the sweep, and the fit when possible."""
    best = best_rates(study, done)
    points = {}
    for f in families.FAMILIES:
        if f not in best:
            continue
        rows = [done[run_name(f, w, best[f])] for w in study.widths if run_name(f, w, best[f]) in done]
        points[f] = {"width": [r["width"] for r in rows], "compute": [r["compute"] for r in rows],
                     "loss": [r["held_out_loss"] for r in rows], "batch_losses": [r["held_out_losses"] for r in rows]}
    sweep = {f: {f"{lr:g}": done[run_name(f, study.widths[0], lr)]["held_out_loss"] for lr in study.lrs
                 if run_name(f, study.widths[0], lr) in done} for f in families.FAMILIES}
    fit = None
    if len(points) == 2 and all(len(p["compute"]) >= 2 for p in points.values()):
        fit = scaling_fit.summary(points)
    complete = all(len(points.get(f, {}).get("compute", [])) == len(study.widths) for f in families.FAMILIES)
    edge = {f: len(study.lrs) > 1 and lr in (min(study.lrs), max(study.lrs)) for f, lr in best.items()}
    return {"best_lr": best, "best_lr_at_sweep_edge": edge, "points": points, "lr_sweep": sweep, "fit": fit,
            "complete": complete}


def markdown(result: dict) -> str:
    a, study = result["analysis"], result["study"]
    text = f"# {NAME}: K3-style vs K2-style, loss against training compute\n\n"
    if result["tiny"]:
        text += "**Tiny CPU smoke run (a few steps per model): not a result.**\n\n"
    if a["fit"]:
        f = a["fit"]
        lo, hi = f["interval_95"]
        text += (f"**Compute multiplier at held-out loss {f['target_loss']:.4f} nats/byte: {f['multiplier']:.2f}× "
                 f"(95 % bootstrap interval {lo:.2f}–{hi:.2f})** — K2-style compute ÷ K3-style compute for the same "
                 f"loss{' (extrapolated: the families’ losses do not overlap)' if f['target_extrapolated'] else ''}"
                 f"{'' if a['complete'] else '; the study is not complete (fewer sizes than planned)'}.\n\n")
        text += "".join(f"- {fam}: log L = {v['a']:.3f} {v['b']:+.4f} · log C\n" for fam, v in f["fits"].items())
        text += "\n"
    else:
        text += "Not enough finished runs for a fit yet (two sizes per family are needed).\n\n"
    text += f"Learning-rate sweep at width {study['widths'][0]} (held-out loss; best used for every width): "
    text += "; ".join(f"{fam}: " + ", ".join(f"{lr} → {v:.4f}" for lr, v in sw.items()) for fam, sw in a["lr_sweep"].items())
    text += "\n\n"
    edge = [f for f, at_edge in a["best_lr_at_sweep_edge"].items() if at_edge]
    if edge:
        text += f"The best rate of {', '.join(edge)} is at the edge of the sweep: the optimum may lie outside it.\n\n"
    rows = [[r["family"], r["width"], f"{r['params_total'] / 1e6:.2f} M", f"{r['params_active'] / 1e6:.3f} M",
             f"{r['tokens'] / 1e6:.1f} M", f"{r['compute']:.3g}", f"{r['recipe']['learning_rate']:g}",
             f"{r['held_out_loss']:.4f}", f"{r['compile_seconds']:.0f} + {r['train_seconds'] - r['compile_seconds']:.0f} s"]
            for r in sorted(result["runs"].values(), key=lambda r: (r["family"], r["width"], r["recipe"]["learning_rate"]))]
    text += common.markdown_table(["family", "width", "params", "active", "tokens", "train FLOPs", "peak lr",
                                   "held-out loss", "compile + train"], rows)
    total = [r["params_total"] / 1e6 for r in result["runs"].values()]
    active = [r["params_active"] / 1e6 for r in result["runs"].values()]
    text += (f"\nScale: {families.LAYERS}-layer models of {min(total):.1f}-{max(total):.1f} M parameters "
             f"({min(active):.2f}-{max(active):.2f} M active), byte-level Python source, {study['tokens_per_param']:g} "
             "tokens per active parameter, one seed per point; the report's models are ~10^4× larger and trained on "
             "~10^6× more tokens of web text. This number is about these tiny models and this data.\n")
    return text


def plot(result: dict, path: Path) -> bool:
    a = result["analysis"]

    def draw(axes):
        ax = axes[0][0]
        for i, (fam, p) in enumerate(a["points"].items()):
            ax.plot(p["compute"], p["loss"], "o", color=f"C{i}", label=f"{fam}-style")
            if a["fit"]:
                fit = a["fit"]["fits"][fam]
                c = np.geomspace(min(p["compute"]) / 1.5, max(p["compute"]) * 1.5, 50)
                ax.plot(c, np.exp(fit["a"] + fit["b"] * np.log(c)), "-", color=f"C{i}", lw=0.8)
                ax.axvline(a["fit"]["compute_at_target"][fam], color=f"C{i}", ls=":", lw=0.8)
        if a["fit"]:
            f = a["fit"]
            ax.axhline(f["target_loss"], color="k", ls="--", lw=0.8,
                       label=f"target: {f['multiplier']:.2f}× ({f['interval_95'][0]:.2f}–{f['interval_95'][1]:.2f})")
        ax.set(xscale="log", yscale="log", xlabel="training FLOPs", ylabel="held-out loss (nats/byte)",
               title="loss vs compute")
        ax.legend(fontsize=7)
        ax = axes[0][1]
        for r in result["runs"].values():
            loss = np.array(r["history"]["loss"], np.float64)
            smooth = np.convolve(loss, np.ones(10) / 10, mode="valid") if loss.size >= 10 else loss
            per_step = r["compute"] / len(loss)
            color = f"C{families.FAMILIES.index(r['family'])}"
            ax.plot(per_step * np.arange(len(loss) - len(smooth) + 1, len(loss) + 1), smooth, color=color, lw=0.7)
        ax.set(xscale="log", yscale="log", xlabel="training FLOPs so far", ylabel="training loss (10-step mean)",
               title="every run's curve (C0 k2, C1 k3)")

    return common.save_figure(draw, path, ncols=2)


def main(argv=None) -> dict:
    p = common.parser(__doc__)
    p.add_argument("--budget_s", type=float, default=None, help="start no run expected to end after this many seconds")
    p.add_argument("--target_loss", type=float, default=None, help="loss at which to compare (default: overlap middle)")
    args = p.parse_args(argv)
    study = TINY if args.tiny else Study()

    def compute() -> dict:
        done = run_study(study, args.out, args.cache, args.budget_s, args.tiny)
        analysis = analyse(study, done)
        if args.target_loss is not None and analysis["fit"]:
            analysis["fit"] = scaling_fit.summary(analysis["points"], args.target_loss)
        return {"study": dataclasses.asdict(study), "tiny": args.tiny, "corpus": runs.corpus_fingerprint(),
                "analysis": analysis, "runs": done}

    return common.publish(args, NAME, compute, markdown, plot)

if __name__ == "__main__":
    common.cli(main)
