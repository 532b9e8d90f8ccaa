"""The shared frame of the one-change ablations: baseline size, recipe, runs, and a ``main``.

Every ablation trains the K3-style baseline (``families.k3_baseline(WIDTH)``: 4 layers 3 KDA : 1
MLA, SiTU-GLU, Block AttnRes, LatentMoE E = 224 / k = 4, QB) and one or two variants that change
exactly one switch, with the same data, seed, recipe and steps. Runs are stored by model name in
``<out>/ablation_runs/``, so the baseline trains once for all five ablations and a stopped call
resumes. All probes (``experiments.probes``) are recorded on every run.

Sizes: WIDTH 96 (5.19 M parameters, 0.60 M active), 400 steps of 32 × 512 bytes (6.6 M tokens,
≈ 11 tokens per active parameter), learning rate 5e-3 (per-head Muon, cosine, 5 % warmup). This is
a few-minute H200 experiment, thousands of times below the report's scale: it can show a
mechanism (norm growth, activation range, decay range, balance) and the sign of a loss change at
this size, not the report's gains.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from experiments import common, probes, runs
from k3jax.config import ModelConfig

WIDTH, STEPS, BATCH, SEQ, LR, EVAL_BATCHES, PROBE_POINTS = 96, 400, 32, 512, 5e-3, 8, 9
TINY = dict(width=64, steps=3, batch=2, seq=64, eval_batches=1, probe_points=2)


def settings(tiny: bool) -> dict:
    full = dict(width=WIDTH, steps=STEPS, batch=BATCH, seq=SEQ, eval_batches=EVAL_BATCHES, probe_points=PROBE_POINTS)
    return TINY if tiny else full


def run_variants(variants: dict[str, ModelConfig], out: Path, cache: Path, tiny: bool, *,
                 lr: float = LR) -> dict[str, dict]:
    """Train (or load) every variant; ``{label: run record}`` (``runs.train``)."""
    s = settings(tiny)
    suffix = "_tiny" if tiny else ""
    store = common.RunStore(out / f"ablation_runs{suffix}")
    recipe = runs.Recipe(learning_rate=lr, steps=s["steps"], batch_size=s["batch"], seq_len=s["seq"])
    data = held = None
    records = {}
    for label, model in variants.items():
        record = store.get(model.name)
        if record is None or record["recipe"] != dataclasses.asdict(recipe):
            if data is None:
                data = runs.cached_batches(cache, "train", s["batch"], s["seq"], s["steps"])
                held = runs.cached_batches(cache, "validation", s["batch"], s["seq"], s["eval_batches"])
            print(f"ablation run {model.name}", flush=True)
            record = runs.train(model, recipe, data, held, probe=probes.make_probe(), probe_points=s["probe_points"])
            store.put(model.name, record)
        records[label] = record
    return records


def intro(result: dict, title: str) -> str:
    """The markdown title and the line that says what was run (and whether it was the tiny smoke run)."""
    s = result["settings"]
    tiny = " **Tiny CPU smoke run: not a result.**" if result["tiny"] else ""
    return (f"# {result['name']}: {title}\n\nK3-style baseline at width {s['width']}; every run {s['steps']} steps of "
            f"{s['batch']} × {s['seq']} bytes (stdlib corpus), peak lr {result['learning_rate']:g}, one seed; "
            f"held-out loss over {s['eval_batches']} validation batches.{tiny}\n\n")


def tail_mean(values: list, fraction: float = 0.2) -> float | None:
    vals = [v for v in values[int(len(values) * (1 - fraction)):] if v is not None]
    return sum(vals) / len(vals) if vals else None


def loss_rows(records: dict[str, dict]) -> list[list]:
    base = next(iter(records.values()))["held_out_loss"]
    return [[label, f"{r['params_total'] / 1e6:.2f} M / {r['params_active'] / 1e6:.3f} M",
             f"{r['flops_per_token'] / 1e6:.2f} M", f"{r['held_out_loss']:.4f}", f"{r['held_out_loss'] - base:+.4f}",
             f"{r['train_seconds']:.0f} s"] for label, r in records.items()]


LOSS_HEADER = ["run", "params total / active", "train FLOPs/token", "held-out loss (nats/byte)", "Δ vs baseline", "time"]


def plot_losses(ax, records: dict[str, dict]) -> None:
    for label, r in records.items():
        loss = r["history"]["loss"]
        ax.plot(range(1, len(loss) + 1), loss, label=f"{label} (held-out {r['held_out_loss']:.3f})")
    ax.set(xlabel="step", ylabel="training loss (nats/byte)", yscale="log", title="loss")
    ax.legend(fontsize=7)


def ablation_main(name: str, doc: str, variants: Callable[[int], dict[str, ModelConfig]],
                  summarise: Callable[[dict], dict], markdown: Callable[[dict], str],
                  plot: Callable[[dict, Path], bool], argv=None) -> dict:
    """Parse the common flags, run (or load) the variants, write ``<out>/<name>.{json,md,png}``."""
    args = common.parser(doc).parse_args(argv)

    def compute() -> dict:
        s = settings(args.tiny)
        records = run_variants(variants(s["width"]), args.out, args.cache, args.tiny)
        return {"name": name, "tiny": args.tiny, "settings": s, "learning_rate": LR,
                "summary": summarise(records), "runs": records}

    return common.publish(args, name, compute, markdown, plot)
