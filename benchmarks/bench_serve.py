"""Serving benchmark: prefix reuse across turns, continuous batching against fixed batches, and
compilations after warm-up, for small() (random weights, bf16) on one GPU.

(a) A conversation's second turn sharing a ``--prefix``-token prefix with the first: its
    time-to-first-token (TTFT) with the prefix cache, against the cold prefill of the same prompt
    on an engine without it (goal: <= 10 %). The first turn's own cold TTFT is printed too.
(b) ``--requests`` concurrent requests of mixed prompt lengths and output lengths (greedy, no stop
    tokens) through the engine (``--slots`` slots), against the same requests run as fixed batches
    of ``--batch`` with ``k3jax.generate`` (each batch padded to the longest prompt and run for the
    longest output, as one compiled program): useful output tokens per second of each.
(c) XLA compilations while (a) and (b) run through the engine, after ``warm_up()`` (goal: 0).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/bench_serve.py --out $OUT/bench_serve.json   # H200
    PYTHONPATH=. python3 benchmarks/bench_serve.py --tiny --out /tmp/bench_serve.json           # CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from k3jax import config
from k3jax.infer.cache import init_cache
from k3jax.infer.generate import _run, as_variables  # generate's own program, at one fixed shape
from k3jax.serve import Engine, EngineConfig, SamplingParams, compilations


def build(cfg, seed=0):
    sys.path.insert(0, "benchmarks")
    from bench_infer import build as build_random  # one random draw per shape: compiles in seconds

    return build_random(cfg, seed)


def settings(tiny: bool) -> dict:
    if tiny:
        cfg = dataclasses.replace(config.tiny(), dtype=jnp.float32)
        ecfg = EngineConfig(num_slots=8, page_size=16, max_context=256, chunk=32, buckets=(4, 16))
        return dict(cfg=cfg, ecfg=ecfg, prefix=160, turn=16, answer=8, requests=12, batch=4,
                    prompt_range=(8, 48), output_range=(2, 12))
    ecfg = EngineConfig(num_slots=64, page_size=256, max_context=34816, chunk=2048, buckets=(16, 136))
    return dict(cfg=config.small(), ecfg=ecfg, prefix=32768, turn=512, answer=64, requests=64, batch=16,
                prompt_range=(64, 2048), output_range=(16, 256))


def ttft(engine: Engine, prompt, max_tokens: int) -> tuple[float, list[int]]:
    req = engine.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    while req.finish_reason is None:
        engine.step()
    return req.first_token_at - req.submitted, req.generated


def second_turn(s: dict, warm: Engine, cold: Engine, rng) -> dict:
    vocab = s["cfg"].vocab_size
    first = list(rng.integers(0, vocab, s["prefix"] - s["answer"]))
    cold_first, answer = ttft(warm, first, s["answer"])
    turn2 = first + answer + list(rng.integers(0, vocab, s["turn"]))
    hits = warm.stats["hit_tokens"]
    warm_ttft, _ = ttft(warm, turn2, 4)
    cold_ttft, _ = ttft(cold, turn2, 4)
    return {"prefix_tokens": len(first) + len(answer) - 1, "turn2_prompt_tokens": len(turn2),
            "reused_tokens": warm.stats["hit_tokens"] - hits, "first_turn_cold_ttft_s": cold_first,
            "second_turn_ttft_s": warm_ttft, "second_turn_cold_ttft_s": cold_ttft,
            "ttft_ratio": warm_ttft / cold_ttft, "goal_ratio": 0.10}


def mixed(s: dict, rng) -> tuple[list, list]:
    lo, hi = s["prompt_range"]
    prompts = [list(rng.integers(0, s["cfg"].vocab_size, int(n))) for n in rng.integers(lo, hi + 1, s["requests"])]
    outputs = [int(n) for n in rng.integers(s["output_range"][0], s["output_range"][1] + 1, s["requests"])]
    return prompts, outputs


def through_engine(engine: Engine, prompts, outputs) -> dict:
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in outputs]
    start = time.perf_counter()
    reqs = [engine.submit(p, q) for p, q in zip(prompts, params)]
    while any(r.finish_reason is None for r in reqs):
        engine.step()
    elapsed = time.perf_counter() - start
    tokens = sum(len(r.generated) for r in reqs)
    return {"seconds": elapsed, "output_tokens": tokens, "tokens_per_s": tokens / elapsed,
            "mean_ttft_s": float(np.mean([r.first_token_at - r.submitted for r in reqs]))}


def fixed_batches(variables, cfg, prompts, outputs, batch: int) -> dict:
    """Fixed batches as ``k3jax.generate`` runs them (ragged prefill, then decode until the batch's
    longest output), every batch right-padded to the longest prompt of all so that one program
    serves them all (``generate`` itself would compile one per distinct batch shape)."""
    longest, most = max(map(len, prompts)), max(outputs)

    def run(rows):
        tokens = np.zeros((batch, longest), np.int32)
        lengths = np.ones((batch,), np.int32)  # short last batch: one-token dummy rows
        for b, r in enumerate(rows):
            tokens[b, :len(r)], lengths[b] = r, len(r)
        cache = init_cache(cfg, batch, longest + most)
        return _run(as_variables(variables, cfg), jnp.asarray(tokens), jnp.asarray(lengths), cache,
                    jax.random.key(0), cfg=cfg, max_new=most, temperature=0.0, top_k=None, top_p=1.0, stop=(),
                    streaming=False, chunk=min(2048, longest))

    jax.block_until_ready(run(prompts[:batch]))  # compile
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        jax.block_until_ready(run(prompts[i:i + batch]))
    elapsed = time.perf_counter() - start
    useful = sum(outputs)
    return {"seconds": elapsed, "useful_output_tokens": useful, "tokens_per_s": useful / elapsed,
            "note": "each batch runs to the longest output; only the requested tokens count"}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny() on CPU (a check that the script runs)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    s = settings(args.tiny)
    cfg, ecfg = s["cfg"], s["ecfg"]
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    variables = build(cfg, args.seed)
    warm, cold = Engine(variables, cfg, ecfg), Engine(variables, cfg, dataclasses.replace(ecfg, prefix_cache=False))
    warm.warm_up()
    cold.warm_up()
    warmed = compilations()
    print(f"warm-up done: {warmed} compilations in {time.perf_counter() - t0:.1f} s", flush=True)
    results = {"device": jax.devices()[0].device_kind, "model": cfg.name, "engine": dataclasses.asdict(ecfg),
               "warm_up_s": time.perf_counter() - t0, "compilations_in_warm_up": warmed}

    def record(key, value):  # printed and written at once: a run cut short keeps what it measured
        results[key] = value
        print(key, json.dumps(value), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)

    record("warm_up_s", results["warm_up_s"])
    record("second_turn", second_turn(s, warm, cold, rng))
    prompts, outputs = mixed(s, rng)
    record("engine_mixed", through_engine(warm, prompts, outputs))
    record("compilations_after_warm_up", compilations() - warmed)
    record("engine_metrics", warm.metrics())
    record("fixed_batches", fixed_batches(variables, cfg, prompts, outputs, s["batch"]))
    record("speedup", results["engine_mixed"]["tokens_per_s"] / results["fixed_batches"]["tokens_per_s"])
    record("total_s", time.perf_counter() - t0)
    return results


if __name__ == "__main__":
    main()
