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

``--spec GAMMA`` measures speculative decoding instead: a draft trained for ``--draft-minutes``
against the target (``k3jax.infer.draft.train_draft`` on the built-in corpus; 0: the untrained
draft, which accepts nothing and so shows the overhead), then the ``--requests`` mixed requests
(prompts cut from the corpus) through one engine without and one with ``draft_tokens = GAMMA``,
greedy and at temperature 1: output tokens/s of each, drafts accepted per verification, the
speedup, and what one verification step costs in plain decode steps (the acceptance it needs
to pay). A random-init target's greedy argmax is noise no draft predicts (acceptance ~0); at
temperature 1 acceptance only needs the distributions to overlap.

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/bench_serve.py --out $OUT/bench_serve.json   # H200
    PYTHONPATH=. python3 benchmarks/bench_serve.py --tiny --out /tmp/bench_serve.json           # CPU
    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/bench_serve.py --spec 4 --out $OUT/spec.json   # H200
    PYTHONPATH=. python3 benchmarks/bench_serve.py --tiny --spec 3 --draft-minutes 0.2          # CPU
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


def through_engine(engine: Engine, prompts, outputs, temperature: float = 0.0) -> dict:
    params = [SamplingParams(max_tokens=m, temperature=temperature, seed=i) for i, m in enumerate(outputs)]
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


def recorder(results: dict, out: str | None):
    def record(key, value):  # printed and written at once: a run cut short keeps what it measured
        results[key] = value
        print(key, json.dumps(value), flush=True)
        if out:
            with open(out, "w") as f:
                json.dump(results, f, indent=1)
    return record


def corpus_prompts(s: dict, rng) -> tuple[list, list]:
    """``mixed``'s lengths, the prompts cut from the built-in corpus (byte tokens) the draft trains on."""
    from bench_infer import corpus_batches

    lo, hi = s["prompt_range"]
    windows = corpus_batches(s["requests"], hi, seed=int(rng.integers(2 ** 31)))
    rows = next(windows)
    prompts = [list(map(int, row[:n])) for row, n in zip(rows, rng.integers(lo, hi + 1, s["requests"]))]
    outputs = [int(n) for n in rng.integers(s["output_range"][0], s["output_range"][1] + 1, s["requests"])]
    return prompts, outputs


def trained_draft(cfg, variables, minutes: float, tiny: bool) -> tuple[dict, dict]:
    """A draft trained for ``minutes`` (at least one step) as ``bench_infer.py`` trains it."""
    from bench_infer import corpus_batches
    from k3jax.infer.draft import init_draft, train_draft

    if minutes <= 0:
        return init_draft(cfg, jax.random.key(0)), {"train_steps": 0}
    batches, log = corpus_batches(2 if tiny else 4, 64 if tiny else 256), []
    t0 = time.perf_counter()

    def until_deadline():
        while time.perf_counter() < t0 + 60 * minutes or not log:
            yield next(batches)

    draft = train_draft(variables, cfg, until_deadline(), num_steps=None,
                        log=lambda i, loss, rates: log.append((loss, rates)))
    return draft, {"train_steps": len(log), "train_seconds": time.perf_counter() - t0, "first_loss": log[0][0],
                   "last_loss": log[-1][0], "last_step_acceptance_rates": log[-1][1]}


def speculative(args, s: dict, variables, record) -> None:
    """``--spec``: the same requests without and with speculative decoding (module docstring)."""
    cfg, gamma, rng = s["cfg"], args.spec, np.random.default_rng(args.seed)
    P = s["ecfg"].page_size
    longest = dataclasses.replace(s["ecfg"], max_context=s["prompt_range"][1] + s["output_range"][1] + gamma,
                                  buckets=())
    pages = longest.max_pages  # one page bucket (two programs per engine) holds every request
    ecfg = dataclasses.replace(s["ecfg"], max_context=pages * P - gamma, buckets=(pages,))
    draft, info = trained_draft(cfg, variables, args.draft_minutes, args.tiny)
    if args.save_draft:
        from k3jax.infer.draft import save_draft

        save_draft(args.save_draft, draft)  # for python -m k3jax.serve --draft FILE
    record("draft", info)
    t0 = time.perf_counter()
    plain, spec = Engine(variables, cfg, ecfg), Engine(variables, cfg, dataclasses.replace(ecfg, draft_tokens=gamma),
                                                       draft=draft)
    plain.warm_up()
    spec.warm_up()
    warmed = compilations()
    record("warm_up_s", time.perf_counter() - t0)
    prompts, outputs = corpus_prompts(s, rng)
    for temperature in (1.0, 0.0):  # the one a random-init target can accept first
        row, before = {}, dict(spec.stats)
        for name, engine in (("plain", plain), ("speculative", spec)):
            steps = engine.stats["steps"]
            row[name] = dict(through_engine(engine, prompts, outputs, temperature), steps=engine.stats["steps"] - steps)
        verifies = spec.stats["draft_verifies"] - before["draft_verifies"]
        accepted = (spec.stats["draft_accepted"] - before["draft_accepted"]) / max(verifies, 1)
        speedup = row["speculative"]["tokens_per_s"] / row["plain"]["tokens_per_s"]
        # Tokens a verification emits ~ 1 + accepted; it costs that many plain decode steps / speedup.
        row.update(gamma=gamma, mean_accepted=accepted, speedup=speedup, verify_cost_in_decode_steps=(1 + accepted) / speedup)
        record(f"temperature_{temperature:g}", row)
    record("compilations_after_warm_up", compilations() - warmed)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny() on CPU (a check that the script runs)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--spec", type=int, default=0, metavar="GAMMA",
                        help="measure speculative decoding with GAMMA draft tokens instead of (a)-(c)")
    parser.add_argument("--draft-minutes", type=float, default=1.0, help="with --spec: draft training time")
    parser.add_argument("--save-draft", default=None, help="with --spec: write the trained draft here (.npz)")
    args = parser.parse_args(argv)
    s = settings(args.tiny)
    cfg, ecfg = s["cfg"], s["ecfg"]
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    variables = build(cfg, args.seed)
    if args.spec:
        results = {"device": jax.devices()[0].device_kind, "model": cfg.name}
        speculative(args, s, variables, recorder(results, args.out))
        results["total_s"] = time.perf_counter() - t0
        print("total_s", results["total_s"], flush=True)
        return results
    warm, cold = Engine(variables, cfg, ecfg), Engine(variables, cfg, dataclasses.replace(ecfg, prefix_cache=False))
    warm.warm_up()
    cold.warm_up()
    warmed = compilations()
    print(f"warm-up done: {warmed} compilations in {time.perf_counter() - t0:.1f} s", flush=True)
    results = {"device": jax.devices()[0].device_kind, "model": cfg.name, "engine": dataclasses.asdict(ecfg),
               "warm_up_s": time.perf_counter() - t0, "compilations_in_warm_up": warmed}

    record = recorder(results, args.out)
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
