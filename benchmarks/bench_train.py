"""Training throughput of a preset (default small()) on one device: tokens/s and model-FLOPs utilisation.

    PYTHONPATH=$PWD python3 benchmarks/bench_train.py --steps 10 --batch 8 --seq 4096 --remat layer

Compiles ahead of time (trace, lower and compile seconds printed for the init and the step),
runs ``--warmup`` untimed steps, then times ``--steps`` steps (blocking on the
result). MFU = model FLOPs per token (``k3jax.train.metrics.flops_per_token``) × tokens/s ÷ the
device's dense bf16 peak (``--peak-flops`` to override). Data: uniform random tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax

from k3jax.config import preset
from k3jax.train.config import DataConfig, TrainConfig, override
from k3jax.train.loop import make_data
from k3jax.train.metrics import flops_per_token, peak_flops
from k3jax.train.step import Trainer


def _staged(name, jitted, *args):
    """``jitted`` compiled ahead of time, printing trace / lower / compile seconds."""
    t0 = time.perf_counter()
    traced = jitted.trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    print(f"{name}: trace {t1 - t0:.1f} s, lower {t2 - t1:.1f} s, compile {t3 - t2:.1f} s", flush=True)
    return compiled, t3 - t0


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
    a = p.parse_args()
    if a.profile_ops:  # read when the backend starts, i.e. before the first computation below
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
    cfg = TrainConfig(model=preset(a.model), batch_size=a.batch, seq_len=a.seq, micro_batches=a.micro,
                      remat=a.remat, steps=a.warmup + a.steps + 1, data=DataConfig(source="random"))
    cfg = override(cfg, a.assignments)
    trainer = Trainer(cfg)
    # Long GPU runs must show where the time goes: each stage is timed and printed as it ends.
    init, _ = _staged("init", jax.jit(trainer._init), jax.random.key(0))
    state = init(jax.random.key(0))
    jax.block_until_ready(state)
    data = make_data(cfg)
    batch = next(data)
    with trainer._context():
        compiled, compile_s = _staged("step", trainer._jit_step, state, batch, trainer.horizon)
        step = lambda state, batch: compiled(state, batch, trainer.horizon)  # noqa: E731
        t0 = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        print(f"first step run {time.perf_counter() - t0:.1f} s", flush=True)
        for _ in range(a.warmup):
            state, m = step(state, next(data))
        jax.block_until_ready(m)
        t0 = time.perf_counter()
        for _ in range(a.steps):
            state, m = step(state, next(data))
        jax.block_until_ready(m)
        seconds = (time.perf_counter() - t0) / a.steps
        if a.profile:
            with jax.profiler.trace(a.profile, create_perfetto_trace=True):
                for _ in range(2):
                    state, m = step(state, next(data))
                jax.block_until_ready(m)
            _print_profile(a.profile, by_op=a.profile_ops)
    tokens_per_s = cfg.tokens_per_step / seconds
    fpt = flops_per_token(cfg.model, cfg.seq_len, trainer.abstract["params"].get("mtp"))
    peak = peak_flops(a.peak_flops)
    out = {"model": cfg.model.name, "device": jax.devices()[0].device_kind, "batch": a.batch, "seq": a.seq,
           "micro_batches": a.micro, "remat": a.remat, "compile_s": round(compile_s, 1),
           "step_s": round(seconds, 4), "tokens_per_s": round(tokens_per_s, 1),
           "model_tflops_per_s": round(fpt * tokens_per_s / 1e12, 2),
           "mfu": None if peak is None else round(fpt * tokens_per_s / peak, 4),
           "loss": float(m["loss"])}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
