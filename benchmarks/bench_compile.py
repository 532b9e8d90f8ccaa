"""Compile cost of a preset's step, scanned layer stack against unrolled: trace + lower seconds, HLO size,
and (``--compile``) XLA's compile seconds.

Everything is abstract: parameters, optimizer state, caches and batches are ``jax.eval_shape``
results, so ``kimi_k3()`` (2.78 T parameters) is measured on a CPU host without memory. Stages:
``abstract`` (the model's abstract init, and for ``train`` the Trainer's abstract state), ``lower``
(trace + lower of the jitted step to StableHLO; the HLO size is its text), ``compile`` (optional).

    # this 2-core CPU: the kimi_k3() train step, scanned and unrolled forward (issue 19)
    PYTHONPATH=$PWD python3 benchmarks/bench_compile.py --model kimi_k3 --step train --layout scanned
    PYTHONPATH=$PWD python3 benchmarks/bench_compile.py --model kimi_k3 --step forward --layout both
    # where the HLO goes: the first N layers of the pattern at real widths (N=1: layer 0 and the rest)
    PYTHONPATH=$PWD python3 benchmarks/bench_compile.py --model kimi_k3 --step train --layout scanned --layers 9
    # H200: small()'s train step compile, scanned vs unrolled (bench_train.py's step settings)
    PYTHONPATH=. python3 benchmarks/bench_compile.py --model small --step train --batch 8 --seq 4096 \\
        --remat layer --layout both --compile --out $OUT/compile_small.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

from k3jax.config import first_layers, preset
from k3jax.infer.cache import init_cache
from k3jax.infer.decode import decode_step
from k3jax.layout import scan_plan, unrolled
from k3jax.model import Transformer
from k3jax.train.config import DataConfig, TrainConfig
from k3jax.train.step import BATCH_KEYS, Trainer

STEPS = ("forward", "train", "decode")


def _abstract_variables(cfg):
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    return nn.unbox(jax.eval_shape(Transformer(cfg).init, jax.random.key(0), tokens))


def _forward(cfg, a):
    variables = _abstract_variables(cfg)
    tokens = jax.ShapeDtypeStruct((a.batch, a.seq), jnp.int32)
    fn = jax.jit(lambda v, t: Transformer(cfg, remat=a.remat).apply(v, t))
    return lambda: fn.lower(variables, tokens)


def _decode(cfg, a):
    variables = _abstract_variables(cfg)
    cache = jax.eval_shape(lambda: init_cache(cfg, a.batch, a.seq))
    tokens = jax.ShapeDtypeStruct((a.batch, 1), jnp.int32)
    return lambda: decode_step.lower(variables, cfg, tokens, cache)


def _train(cfg, a):
    tcfg = TrainConfig(model=cfg, batch_size=a.batch, seq_len=a.seq, remat=a.remat, steps=10,
                       data=DataConfig(source="random"))
    trainer = Trainer(tcfg)
    state = trainer.abstract_state()
    batch = {k: jax.ShapeDtypeStruct((a.batch, a.seq), jnp.int32) for k in BATCH_KEYS}

    def lower():
        with trainer._context():
            return trainer._jit_step.lower(state, batch, trainer.horizon)

    return lower


def measure(cfg, a) -> dict:
    """Seconds of each stage and the HLO size of ``a.step`` for ``cfg``."""
    t0 = time.perf_counter()
    lower = {"forward": _forward, "train": _train, "decode": _decode}[a.step](cfg, a)
    t1 = time.perf_counter()
    lowered = lower()
    t2 = time.perf_counter()
    out = {"abstract_s": round(t1 - t0, 1), "trace_lower_s": round(t2 - t1, 1),
           "hlo_chars": len(lowered.as_text()),
           "plan": None if scan_plan(cfg) is None else scan_plan(cfg).describe()}
    if a.compile:
        lowered.compile()
        out["compile_s"] = round(time.perf_counter() - t2, 1)
    out["total_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps({"layout": "scanned" if cfg.scan_layers else "unrolled", **out}), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="kimi_k3")
    p.add_argument("--step", default="train", choices=STEPS)
    p.add_argument("--layout", default="both", choices=("scanned", "unrolled", "both"))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--remat", default="layer", choices=("none", "layer", "moe"))
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers (real widths)")
    p.add_argument("--compile", action="store_true", help="also compile (XLA) and time it")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    cfg = preset(a.model) if a.layers is None else first_layers(preset(a.model), a.layers)
    layouts = {"scanned": [cfg], "unrolled": [unrolled(cfg)], "both": [cfg, unrolled(cfg)]}[a.layout]
    results = {"model": a.model, "layers": cfg.num_layers, "step": a.step, "batch": a.batch, "seq": a.seq, "remat": a.remat,
               "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
               "cpus": os.cpu_count(), "load_before": [round(x, 1) for x in os.getloadavg()]}
    for c in layouts:
        results["scanned" if c.scan_layers else "unrolled"] = measure(c, a)
    results["load_after"] = [round(x, 1) for x in os.getloadavg()]
    if a.layout == "both":
        s, u = results["scanned"], results["unrolled"]
        results["hlo_ratio"] = round(u["hlo_chars"] / s["hlo_chars"], 1)
        seconds = lambda r: r["trace_lower_s"] + r.get("compile_s", 0.0)  # the step's trace + lower (+ compile)
        results["speedup"] = round(seconds(u) / seconds(s), 1)
    print(json.dumps(results), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
