"""Quantile Balancing vs the DeepSeek-V3 sign update on a simulated, drifting, skewed router.

Hypothesis: QB (SPEC §6; exact and histogram) brings a skewed router to max/min expert load
≤ 1.1 within a few steps and keeps it there while the router drifts, because each update solves
for the bias instead of stepping it; the sign update (γ = 1e-3) needs on the order of
(bias spread)/γ steps; "none" stays imbalanced (experts with no tokens).

What differs from the baseline (method "sign"): only the bias update applied after each step
(`k3jax.balance.update_bias` with method qb_exact / qb_hist / sign / none, default histogram
settings). Scores, tokens and drift are identical across methods (same seeds); every batch is
routed with the bias computed from the previous batches only.

Simulated router: scores = sigmoid(x·Wᵀ/√r + p), r = 16, token features x ~ N(0, I_r), expert
embeddings W ~ N(0, I_r), popularity offsets p ~ N(0, 0.5²). Three regimes per (E, k):
  static  one fixed token batch, no drift: how fast each method converges;
  drift   one fixed token batch, p walks with std --drift (1e-3) per step: tracking;
  fresh   new tokens every step plus the drift, as in training: loads carry sampling noise, so
          the max/min of uniformly random top-k routing at the same T, E, k is reported as the
          floor ("noise_floor_max_min").
--weight_drift also walks W (token-level churn near every threshold, like fresh tokens).

Command (E = 896, k = 16 with 4096 tokens/step and E = 64, k = 8 with 16384; 250 steps; measured
213 s of CPU time, 9.4 min wall on a 2-core machine shared with other jobs):
    cd /work/main && PYTHONPATH=. /root/.cache/k3jax/venv/bin/python \
        experiments/balance_qb_vs_sign.py [--steps 250] [--tokens_896 4096] [--tokens_64 16384]
Writes runs/balance_qb_vs_sign/balance_qb_vs_sign.{json,png} (the committed measurement is
experiments/results/balance_qb_vs_sign.{json,png}: `--out experiments/results/balance_qb_vs_sign`).
The plot needs matplotlib (`pip install -e '.[experiments]'`; `make demo` installs it).

The short tiny-model training comparison is `tiny_training_run`, kept separate (it needs the
trainer in k3jax/train); `--train [--train_steps 60] [--train_data stdlib]` runs only it and
writes <out>_train_<data>.json.
The same methods on the K3-style ablation baseline, in the full training step on real text:
experiments/ablate_balance.py (it imports METHODS from here).
"""

import dataclasses
import functools
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from k3jax import balance, cli

DEFAULT_OUT = Path("runs") / "balance_qb_vs_sign" / "balance_qb_vs_sign"  # relative to the working directory
METHODS = ("qb_exact", "qb_hist", "sign", "none")
TARGET = 1.1  # max/min expert load counted as balanced


@dataclasses.dataclass(frozen=True)
class SimConfig:
    num_experts: int = 896
    k: int = 16
    tokens: int = 4096  # tokens routed per step
    steps: int = 250
    rank: int = 16  # width of the simulated token/expert embeddings
    skew: float = 0.5  # std of the per-expert popularity offsets (logit units)
    drift: float = 1e-3  # per-step random-walk std of the popularity offsets p (logit units)
    weight_drift: float = 0.0  # per-step random-walk std of W (token-level churn, logit units)
    fresh_tokens: bool = True
    seed: int = 0
    num_bins: int = balance.BalanceConfig.num_bins  # qb_hist histogram
    margin_range: tuple[float, float] = balance.BalanceConfig.margin_range


def get_config(
    steps=250, tokens_896=4096, tokens_64=16384, drift=1e-3, weight_drift=0.0
) -> dict[str, SimConfig]:
    """Per (E, k): "static" (fixed tokens, no drift: convergence speed), "drift" (fixed tokens,
    drifting popularity: tracking), "fresh" (new tokens every step plus drift: as in training)."""
    configs = {}
    for base in (
        SimConfig(896, 16, tokens_896, steps, drift=drift, weight_drift=weight_drift),
        SimConfig(64, 8, tokens_64, steps, drift=drift, weight_drift=weight_drift),
    ):
        name = f"E{base.num_experts}_k{base.k}"
        configs[f"{name}_static"] = dataclasses.replace(base, drift=0.0, fresh_tokens=False)
        configs[f"{name}_drift"] = dataclasses.replace(base, fresh_tokens=False)
        configs[f"{name}_fresh"] = base
    return configs


def simulate(sim: SimConfig, method: str) -> dict[str, jax.Array]:
    """Per-step load metrics of `method` on the simulated router (one lax.scan over steps)."""
    shape = (sim.num_experts, sim.k, sim.tokens, sim.steps, sim.rank)
    cfg = balance.BalanceConfig(method, num_bins=sim.num_bins, margin_range=sim.margin_range)
    knobs = jnp.array([sim.skew, sim.drift, sim.weight_drift, float(sim.fresh_tokens)])
    return _simulate(shape, cfg, knobs, sim.seed)


@functools.partial(jax.jit, static_argnames=("shape", "cfg"))
def _simulate(shape, cfg, knobs, seed):
    # Only shapes and the balancing config are static: the three regimes share one compilation.
    num_experts, k, tokens, steps, rank = shape
    skew, drift, weight_drift, fresh = knobs
    kx, kw, kp, kwalk = jax.random.split(jax.random.PRNGKey(seed), 4)
    x0 = jax.random.normal(kx, (tokens, rank))
    w0 = jax.random.normal(kw, (num_experts, rank))
    p0 = skew * jax.random.normal(kp, (num_experts,))

    def step(carry, t):
        bias, w, p = carry
        x = jnp.where(fresh > 0, jax.random.normal(jax.random.fold_in(kx, t), x0.shape), x0)
        logits = jnp.einsum("TR,ER->TE", x, w) / math.sqrt(rank) + p  # [T, E]
        scores = jax.nn.sigmoid(logits)
        stats = balance.step_statistics(cfg, scores, bias, k)  # routes with the old bias
        metrics = balance.load_metrics(stats["loads"])
        new_bias = balance.update_bias(cfg, bias, stats, k)  # used from the next step on
        dw, dp = jax.random.split(jax.random.fold_in(kwalk, t))
        w = w + weight_drift * jax.random.normal(dw, w.shape)
        p = p + drift * jax.random.normal(dp, p.shape)
        return (new_bias, w, p), {**metrics, "bias_std": jnp.std(bias)}

    carry = (jnp.zeros(num_experts, jnp.float32), w0, p0)
    _, history = jax.lax.scan(step, carry, jnp.arange(steps))
    return history


@functools.partial(jax.jit, static_argnames=("sim", "draws"))
def noise_floor(sim: SimConfig, draws: int = 16) -> jax.Array:
    """Mean max/min load of uniformly random top-k routing: the fresh-token sampling noise."""
    keys = jax.random.split(jax.random.PRNGKey(sim.seed + 1), draws)

    def one(key):
        ids, _ = balance.biased_topk(
            jax.random.uniform(key, (sim.tokens, sim.num_experts)),
            jnp.zeros(sim.num_experts),
            sim.k,
        )
        return balance.load_metrics(balance.expert_loads(ids, sim.num_experts))["max_min_ratio"]

    return jnp.mean(jax.lax.map(one, keys))


def summarise(ratio: np.ndarray) -> dict:
    """First step at max/min ≤ TARGET, the step from which it stays there, late-phase mean."""
    ok = ratio <= TARGET
    first = int(np.argmax(ok)) if ok.any() else None
    settled = int(len(ok) - np.argmin(ok[::-1])) if ok.any() and ok[-1] else None
    if ok.all():
        settled = 0
    tail = ratio[int(0.8 * len(ratio)) :]
    zero_steps = int(np.sum(~np.isfinite(tail)))
    return {
        "first_step_le_target": first,
        "settled_from_step": settled,
        # None: some tail step left an expert without tokens, so max/min is infinite there
        "tail_mean_max_min": None if zero_steps else float(np.mean(tail)),
        "tail_zero_expert_steps": zero_steps,
    }


def _ratio_text(value: float | None) -> str:
    return "∞ (experts without tokens)" if value is None else f"{value:.3f}"


def run_simulations(configs: dict[str, SimConfig]) -> dict:
    results = {}
    for name, sim in configs.items():
        case = {"config": dataclasses.asdict(sim), "methods": {}}
        if sim.fresh_tokens:
            case["noise_floor_max_min"] = float(noise_floor(sim))
        for method in METHODS:
            start = time.perf_counter()
            history = jax.device_get(simulate(sim, method))
            ratio = np.asarray(history["max_min_ratio"], np.float64)
            case["methods"][method] = {
                **summarise(ratio),
                "seconds": round(time.perf_counter() - start, 2),
                "max_min_ratio": [r if math.isfinite(r) else None for r in ratio.tolist()],
                "cv": np.asarray(history["cv"]).tolist(),
                "zero_experts": np.asarray(history["zero_experts"]).tolist(),
                "bias_std": np.asarray(history["bias_std"]).tolist(),
            }
            row = case["methods"][method]
            print(f"{name:>18} {method:>8}: first≤{TARGET} at {row['first_step_le_target']}, "
                  f"settled from {row['settled_from_step']}, tail max/min "
                  f"{_ratio_text(row['tail_mean_max_min'])}, {row['seconds']} s", flush=True)
        results[name] = case
    return results


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(12, 3.2 * len(results)), squeeze=False)
    for row, (name, case) in zip(axes, results.items()):
        for method, res in case["methods"].items():
            ratio = np.array([np.inf if r is None else r for r in res["max_min_ratio"]])
            row[0].plot(np.minimum(ratio, 100.0), label=method)
            row[1].plot(res["cv"], label=method)
        row[0].axhline(TARGET, color="k", lw=0.8, ls="--", label=f"max/min = {TARGET}")
        if "noise_floor_max_min" in case:
            row[0].axhline(case["noise_floor_max_min"], color="gray", lw=0.8, ls=":",
                           label="random-routing floor")
        row[0].set(yscale="log", title=f"{name}: max/min load (∞ drawn at 100)", xlabel="step")
        row[1].set(yscale="log", title=f"{name}: coefficient of variation", xlabel="step")
        row[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def tiny_training_run(
    steps: int = 60, methods=METHODS, batch_size: int = 8, seq_len: int = 64, source: str = "stdlib"
) -> dict:
    """Short tiny-model training per balancing method: loss and router balance per step.

    Separate from the simulation: it needs the trainer (k3jax.train), imported here. Same data,
    seed and init for every method; only `ModelConfig.balance.method` differs. The trainer reports
    the worst layer's max/mean load, the mean CV over layers and the experts without tokens.
    Byte-level text ("stdlib") by default: in the "recall" task about half the tokens of a batch
    are one padding id, and identical router rows cannot be split by any bias.
    """
    from k3jax.config import tiny
    from k3jax.train.config import DataConfig, TrainConfig
    from k3jax.train.loop import make_data
    from k3jax.train.step import Trainer

    keys = ("loss", "load_max_mean", "load_cv", "load_zero_experts")
    runs = {}
    for method in methods:
        model = dataclasses.replace(tiny(), balance=balance.BalanceConfig(method=method))
        cfg = TrainConfig(model=model, steps=steps, batch_size=batch_size, seq_len=seq_len,
                          data=DataConfig(source=source), tensorboard=False)
        trainer, data = Trainer(cfg), make_data(cfg)
        state = trainer.init_state(jax.random.key(cfg.seed))
        history = {key: [] for key in keys}
        start = time.perf_counter()
        for _ in range(steps):
            state, metrics = trainer.step(state, next(data))
            for key in keys:
                history[key].append(float(metrics[key]))
        tail = slice(int(0.8 * steps), None)
        runs[method] = {
            "seconds": round(time.perf_counter() - start, 1),
            "tail_mean": {key: float(np.mean(history[key][tail])) for key in keys},
            **history,
        }
        print(f"train {method:>8}: tail means {runs[method]['tail_mean']}", flush=True)
    return {"model": "tiny", "num_experts": model.moe.num_experts, "k": model.moe.top_k,
            "tokens_per_step": batch_size * seq_len, "steps": steps, "data": source, "runs": runs}


def make_parser():
    parser = cli.make_parser("python experiments/balance_qb_vs_sign.py", __doc__)
    parser.add_argument("--steps", type=int, default=250, help="balancing steps per simulation")
    parser.add_argument("--tokens_896", type=int, default=4096, help="tokens routed per step at E=896, k=16")
    parser.add_argument("--tokens_64", type=int, default=16384, help="tokens routed per step at E=64, k=8")
    parser.add_argument("--drift", type=float, default=1e-3,
                        help="per-step random-walk std of the expert popularity offsets (logit units)")
    parser.add_argument("--weight_drift", type=float, default=0.0,
                        help="per-step random-walk std of the expert embeddings W (token-level churn)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="output path without suffix: writes OUT.json and OUT.png (default: %(default)s)")
    parser.add_argument("--train", action="store_true",
                        help="run the short tiny-model training comparison instead of the simulation")
    parser.add_argument("--train_steps", type=int, default=60, help="training steps per method (--train)")
    parser.add_argument("--train_data", default="stdlib", choices=("recall", "random", "stdlib"),
                        help="training data source (--train)")
    return parser


def parse_args(argv=None):
    return make_parser().parse_args(argv)


def _run(args) -> int:
    for name in ("steps", "tokens_896", "tokens_64", "train_steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}={getattr(args, name)} must be >= 1")
    if args.train:
        train = tiny_training_run(args.train_steps, source=args.train_data)
        path = args.out.with_name(f"{args.out.name}_train_{args.train_data}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(train))
        print(f"wrote {path}")
        return 0
    try:  # before minutes of compute, not after
        import matplotlib  # noqa: F401
    except ImportError:
        raise cli.UserError("the plot needs matplotlib: pip install -e '.[experiments]' (make demo installs it)") from None
    configs = get_config(args.steps, args.tokens_896, args.tokens_64, args.drift, args.weight_drift)
    start = time.perf_counter()
    results = run_simulations(configs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"target_max_min": TARGET, "seconds": round(time.perf_counter() - start, 1),
            "jax": jax.__version__, "backend": jax.default_backend()}
    plot(results, args.out.with_suffix(".png"))
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "cases": results}))
    print(f"wrote {args.out}.json/.png in {meta['seconds']} s")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    return cli.run(lambda: _run(args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
