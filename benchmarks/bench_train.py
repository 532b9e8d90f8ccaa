"""Training throughput of a preset (default small()) on one device: tokens/s and model-FLOPs utilisation.

    PYTHONPATH=$PWD python3 benchmarks/bench_train.py --steps 10 --batch 8 --seq 4096 --remat layer

Compiles ahead of time (trace, lower and compile seconds printed for the init and the step),
runs ``--warmup`` untimed steps, then times ``--steps`` steps (blocking on the
result). ``--variant NAME:KEY=VALUE,…`` adds configurations timed interleaved with the base
one in this process, one step of each in turn (the GPU's clocks drift too much between processes
for a 1-2 % A/B). MFU = model FLOPs per token (``k3jax.train.metrics.flops_per_token``) × tokens/s ÷ the
device's dense bf16 peak (``--peak-flops`` to override). Data: uniform random tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax

from k3jax.config import preset
from k3jax.train.config import DataConfig, TrainConfig, override
from k3jax.train.loop import make_data
from k3jax.train.metrics import flops_per_token, peak_flops
from k3jax.train.step import Trainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_layer import parse_variant  # noqa: E402  (benchmarks/ is the script's directory)


def _lowered(name, jitted, *args):
    """``jitted`` traced and lowered, printing the seconds of each."""
    t0 = time.perf_counter()
    traced = jitted.trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    print(f"{name}: trace {t1 - t0:.1f} s, lower {time.perf_counter() - t1:.1f} s", flush=True)
    return lowered, time.perf_counter() - t0


def _compiled(name, lowered, seconds):
    t0 = time.perf_counter()
    compiled = lowered.compile()
    print(f"{name}: compile {time.perf_counter() - t0:.1f} s", flush=True)
    return compiled, seconds + time.perf_counter() - t0


def _staged(name, jitted, *args):
    """``jitted`` compiled ahead of time, printing trace / lower / compile seconds."""
    return _compiled(name, *_lowered(name, jitted, *args))


def _variant(spec: str, base: list[str], p: argparse.ArgumentParser) -> tuple[str, list[str]]:
    """``NAME:KEY=VALUE,KEY=VALUE`` -> (NAME, the base overrides followed by these)."""
    try:
        name, sets = parse_variant(spec)
    except ValueError as e:
        p.error(str(e))
    return name, base + sets


def _print_profile(directory: str, top: int = 40, by_op: bool = False) -> None:
    """The traced steps' time per kernel on the device (all threads on a CPU), largest first; with
    ``by_op`` also per JAX name-stack prefix (``tf_op``), which says which layer and op a fusion is."""
    from trace_summary import load_events, summarise  # benchmarks/ is the script's directory

    events, names = load_events(directory)
    process = "" if jax.default_backend() == "cpu" else "GPU"
    for key, depth in [("name", None)] + ([("tf_op", d) for d in (4, 6)] if by_op else []):
        rows = summarise(events, names, process, key, depth)
        grand = sum(ms for _, ms, _ in rows) or 1.0
        print(f"profile of 2 steps by {key}{'' if depth is None else f' (depth {depth})'}: "
              f"{grand:.1f} ms over {len(rows)} groups", flush=True)
        for name, ms, n in rows[:top]:
            print(f"{ms:10.2f} ms {100 * ms / grand:5.1f} % {n:6d}x  {name[:150]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--remat", default="layer", choices=("none", "layer", "moe"))
    p.add_argument("--peak-flops", type=float, default=None)
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after timing, trace 2 steps into DIR and print the device time per kernel "
                        "(benchmarks/trace_summary.py)")
    p.add_argument("--profile-ops", action="store_true",
                   help="with --profile: turn off XLA's CUDA command buffers so every kernel carries its HLO "
                        "op and JAX name stack, and also print the time per name-stack prefix")
    p.add_argument("--set", dest="assignments", action="append", default=[], metavar="KEY=VALUE",
                   help="TrainConfig override, e.g. model.moe.implementation=xla")
    p.add_argument("--variant", dest="variants", action="append", default=[], metavar="NAME:KEY=VALUE,…",
                   help="another configuration (the --set overrides plus these), timed interleaved with the "
                        "base one, e.g. xla_excess:excess_precision=true")
    p.add_argument("--out", default=None, help="also write the results (one JSON object per configuration) here")
    a = p.parse_args()
    variants = dict(_variant(v, a.assignments, p) for v in a.variants)
    if len(variants) != len(a.variants):
        p.error("--variant names must differ")
    if variants and a.profile:
        p.error("--profile traces the base configuration alone: leave out --variant")
    if a.profile_ops:  # read when the backend starts, i.e. before the first computation below
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
    cfg = TrainConfig(model=preset(a.model), batch_size=a.batch, seq_len=a.seq, micro_batches=a.micro,
                      remat=a.remat, steps=a.warmup + a.steps + 1, data=DataConfig(source="random"))
    configs = {"base": override(cfg, a.assignments)}
    configs.update({name: override(cfg, sets) for name, sets in variants.items()})
    trainers = {name: Trainer(c) for name, c in configs.items()}
    trainer = trainers["base"]
    # Long GPU runs must show where the time goes: each stage is timed and printed as it ends.
    init, _ = _staged("init", jax.jit(trainer._init), jax.random.key(0))
    state = init(jax.random.key(0))
    jax.block_until_ready(state)
    data = make_data(configs["base"])
    batch = next(data)
    lowered = {}
    for name, t in trainers.items():
        with t._context():
            lowered[name] = _lowered(f"step {name}", t._jit_step, state, batch, t.horizon)
    # One after another: compiles side by side on one GPU break each other's autotuning (RESULTS.md, stop 39).
    compiled = {name: _compiled(f"step {name}", *low) for name, low in lowered.items()}
    steps = {name: (lambda s, b, c=compiled[name][0], t=t: c(s, b, t.horizon)) for name, t in trainers.items()}
    # Every configuration steps the one state in turn (the same shapes; each step donates it).
    t0 = time.perf_counter()
    for step in steps.values():
        state, m = step(state, batch)
    jax.block_until_ready(m)
    print(f"first step of each run {time.perf_counter() - t0:.1f} s", flush=True)
    for _ in range(a.warmup):
        for step in steps.values():
            state, m = step(state, next(data))
    jax.block_until_ready(m)
    times, losses = {name: [] for name in steps}, {}
    if variants:  # each step timed alone, the order rotating: the clocks' drift hits every run alike
        names = list(steps)
        for r in range(a.steps):
            for name in names[r % len(names):] + names[: r % len(names)]:
                t0 = time.perf_counter()
                state, m = steps[name](state, next(data))
                jax.block_until_ready(m)
                times[name].append(time.perf_counter() - t0)
                losses[name] = float(m["loss"])
    else:  # back to back, as training runs them
        t0 = time.perf_counter()
        for _ in range(a.steps):
            state, m = steps["base"](state, next(data))
        jax.block_until_ready(m)
        times["base"], losses["base"] = [(time.perf_counter() - t0) / a.steps], float(m["loss"])
    if a.profile:
        with trainer._context(), jax.profiler.trace(a.profile, create_perfetto_trace=True):
            for _ in range(2):
                state, m = steps["base"](state, next(data))
            jax.block_until_ready(m)
        _print_profile(a.profile, by_op=a.profile_ops)
    fpt = flops_per_token(cfg.model, cfg.seq_len, trainer.abstract["params"].get("mtp"))
    peak = peak_flops(a.peak_flops)
    results = []
    for name, t in times.items():
        seconds = statistics.median(t)
        tokens_per_s = configs[name].tokens_per_step / seconds
        out = {"model": cfg.model.name, "device": jax.devices()[0].device_kind, "batch": a.batch, "seq": a.seq,
               "micro_batches": a.micro, "remat": a.remat, "compile_s": round(compiled[name][1], 1),
               "step_s": round(seconds, 4), "tokens_per_s": round(tokens_per_s, 1),
               "model_tflops_per_s": round(fpt * tokens_per_s / 1e12, 2),
               "mfu": None if peak is None else round(fpt * tokens_per_s / peak, 4),
               "loss": losses[name]}
        if variants:
            out = {"variant": name, "sets": variants.get(name, a.assignments), **out,
                   "vs_base": round(seconds / statistics.median(times["base"]), 4)}
        print(json.dumps(out))
        results.append(out)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
