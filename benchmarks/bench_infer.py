"""Inference benchmark: decode throughput against the HBM roofline, million-token chunked prefill,
and the mean accepted length of a briefly trained speculative draft.

1. Decode tokens/s at batch 1 and 64 for small() (bf16 weights), after a prompt of ``--prompt``
   tokens, and the share of the HBM roofline: bytes read per step (all weights — the roofline's
   upper bound — or only the active ones, plus the KDA states and the MLA latents up to the
   current length) over ``--hbm-tbps``, divided by the measured step time. Steps run as one
   device-side loop (as ``generate`` runs them); the step time of a Python loop of jitted
   ``decode_step`` calls is printed beside it (the figure recorded before 2026-11-30's last run).
2. Chunked prefill of ``--prefill-tokens`` (1,048,576) tokens at batch 1: time, peak device memory,
   and the memory split (KDA states, MLA latents, weights) against the KV cache a full-attention
   model of the same depth would need (per head uncompressed K and V, every layer).
3. A draft trained for ``--draft-minutes`` on the standard-library corpus (byte tokens) against the
   target (random init unless ``--target CHECKPOINT``), then the mean accepted length (tokens per
   target call) of speculative decoding, greedy and at temperature 1.

    PYTHONPATH=$PWD python3 benchmarks/bench_infer.py --out $OUT/bench_infer.json   # H200
    PYTHONPATH=$PWD python3 benchmarks/bench_infer.py --quick                       # CPU, tiny() sizes
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k3jax import config
from k3jax.data import ByteTokenizer, stdlib_corpus
from k3jax.infer.cache import KDACache, MLACache, init_cache, tree_bytes
from k3jax.infer.decode import decode_step, prefill_jit
from k3jax.infer.draft import train_draft
from k3jax.infer.speculative import speculative_generate
from k3jax.layout import to_per_layer
from k3jax.model import Transformer
from k3jax.train.batched_calls import batch_random_draws


def build(cfg, seed=0):
    # One random draw per parameter shape: compiles in seconds rather than minutes on a GPU.
    init = batch_random_draws(Transformer(cfg).init)
    variables = jax.jit(init)(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))
    return nn.meta.unbox(variables)


def active_weight_bytes(cfg, variables) -> int:
    """Weights a single token reads: everything but the E−k unused experts and the embedding table."""
    total = tree_bytes(variables["params"]) - tree_bytes(variables["params"]["embed"])
    m = cfg.moe
    params = jax.eval_shape(lambda v: to_per_layer(v, cfg), variables)["params"]  # shapes per layer, no copy
    for i, is_moe in enumerate(cfg.moe_layers):
        if is_moe:
            experts = sum(tree_bytes(params[f"layers_{i}"]["moe"][w]) for w in ("w1", "w2", "w3"))
            total -= experts * (m.num_experts - m.top_k) // m.num_experts
    return total


def _layer_caches(cache) -> list:
    """Every layer cache, the scanned stack's stacked ones included."""
    return jax.tree.leaves(cache.layers, is_leaf=lambda x: isinstance(x, (KDACache, MLACache)))


def cache_read_bytes(cfg, cache, length: int) -> int:
    """Cache bytes one decode step reads: KDA state and conv tails, MLA latents up to ``length``."""
    total = 0
    for layer in _layer_caches(cache):
        if isinstance(layer, KDACache):
            total += tree_bytes(layer)
        else:
            *lead, _, C = layer.latent.shape  # [B, S, C], or [R, B, S, C] in the scanned stack
            total += int(np.prod(lead)) * length * C * jnp.dtype(layer.latent.dtype).itemsize
    return total


def _greedy_loop(variables, tok, cache, *, cfg, steps):
    """``steps`` greedy decode steps in one ``fori_loop``; returns the last tokens."""
    def body(_, carry):
        tok, cache = carry
        logits, cache = decode_step(variables, cfg, tok, cache)
        return jnp.argmax(logits, -1).astype(jnp.int32), cache

    return jax.lax.fori_loop(0, steps, body, (tok, cache))[0]


def bench_decode(cfg, variables, batch, prompt, steps, hbm):
    tokens = jax.random.randint(jax.random.key(1), (batch, prompt), 0, cfg.vocab_size, jnp.int32)
    cache = init_cache(cfg, batch, prompt + steps + 1)
    _, cache = prefill_jit(variables, cfg, tokens, jnp.full((batch,), prompt, jnp.int32), cache)
    tok = tokens[:, -1:]
    logits, c2 = decode_step(variables, cfg, tok, cache)  # compile
    jax.block_until_ready(logits)
    t0 = time.perf_counter()
    host_cache = cache
    for _ in range(steps):
        logits, host_cache = decode_step(variables, cfg, tok, host_cache)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
    jax.block_until_ready(tok)
    host_step_s = (time.perf_counter() - t0) / steps
    # The same greedy steps as one device-side loop (as `generate` runs them): no per-step dispatch.
    loop = jax.jit(functools.partial(_greedy_loop, cfg=cfg, steps=steps))
    jax.block_until_ready(loop(variables, tokens[:, -1:], cache))  # compile
    t0 = time.perf_counter()
    jax.block_until_ready(loop(variables, tokens[:, -1:], cache))
    step_s = (time.perf_counter() - t0) / steps
    w_all = tree_bytes(variables["params"]) - tree_bytes(variables["params"]["embed"])
    w_act = active_weight_bytes(cfg, variables)
    c_bytes = cache_read_bytes(cfg, cache, prompt + steps // 2)
    roof = lambda b: b / (hbm * 1e12)
    return {"batch": batch, "prompt": prompt, "step_ms": step_s * 1e3, "tokens_per_s": batch / step_s,
            "host_loop_step_ms": host_step_s * 1e3,
            "bytes_per_step_all_weights": w_all + c_bytes, "bytes_per_step_active_weights": w_act + c_bytes,
            "roofline_pct_all_weights": 100 * roof(w_all + c_bytes) / step_s,
            "roofline_pct_active_weights": 100 * roof(w_act + c_bytes) / step_s}


def peak_bytes():
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def bench_prefill(cfg, variables, n_tokens, chunk):
    tokens = jax.random.randint(jax.random.key(2), (1, n_tokens), 0, cfg.vocab_size, jnp.int32)
    cache = init_cache(cfg, 1, n_tokens)
    lengths = jnp.full((1,), n_tokens, jnp.int32)
    compiled = prefill_jit.lower(variables, cfg, tokens, lengths, cache, chunk=chunk).compile()
    t0 = time.perf_counter()
    last, cache = compiled(variables, tokens, lengths, cache)
    jax.block_until_ready(last)
    seconds = time.perf_counter() - t0
    kda = sum(tree_bytes(c) for c in _layer_caches(cache) if isinstance(c, KDACache))
    mla = sum(tree_bytes(c.latent) for c in _layer_caches(cache) if isinstance(c, MLACache))
    m = cfg.mla
    full_kv = cfg.num_layers * n_tokens * m.num_heads * (m.qk_head_dim + m.v_head_dim) * jnp.dtype(cfg.dtype).itemsize
    analysis = compiled.memory_analysis()
    return {"tokens": n_tokens, "chunk": chunk, "seconds": seconds, "tokens_per_s": n_tokens / seconds,
            "peak_device_bytes": peak_bytes(),
            "compiled_temp_bytes": getattr(analysis, "temp_size_in_bytes", None),
            "kda_state_bytes": kda, "mla_latent_bytes": mla, "weight_bytes": tree_bytes(variables["params"]),
            "full_attention_kv_bytes": full_kv, "cache_vs_full_attention": (kda + mla) / full_kv,
            "finite": bool(np.isfinite(np.asarray(last)).all())}


def corpus_batches(batch, length, seed=0):
    """Random byte windows of standard-library files (``k3jax.data``'s built-in corpus)."""
    corpus, tok, rng = stdlib_corpus("train"), ByteTokenizer(), np.random.default_rng(seed)
    while True:
        rows = []
        while len(rows) < batch:
            ids = tok.encode(corpus[int(rng.integers(len(corpus)))])
            if len(ids) > length:
                start = int(rng.integers(len(ids) - length))
                rows.append(ids[start:start + length])
        yield np.stack(rows).astype(np.int32)


def bench_draft(cfg, variables, minutes, batch, length, gamma, max_new):
    batches = corpus_batches(batch, length)
    log = []

    def until_deadline(deadline):
        while time.perf_counter() < deadline or not log:  # at least one step
            yield next(batches)

    train_t0 = time.perf_counter()
    params = train_draft(variables, cfg, until_deadline(train_t0 + 60 * minutes), num_steps=None,
                         log=lambda i, loss, rates: log.append((loss, rates)))
    train_s = time.perf_counter() - train_t0
    prompts = [list(map(int, next(batches)[0][:64]))] * 4
    _, tau_greedy = speculative_generate(variables, cfg, params, prompts, max_new_tokens=max_new, gamma=gamma,
                                         temperature=0.0)
    _, tau_t1 = speculative_generate(variables, cfg, params, prompts, max_new_tokens=max_new, gamma=gamma,
                                     temperature=1.0, seed=1)
    return {"train_steps": len(log), "train_seconds": train_s, "first_loss": log[0][0], "last_loss": log[-1][0],
            "last_step_acceptance_rates": log[-1][1], "gamma": gamma,
            "mean_accepted_length_greedy": tau_greedy, "mean_accepted_length_t1": tau_t1}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny() at toy sizes (CPU smoke run)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth (H200 datasheet: 4.8 TB/s)")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=1_048_576)
    ap.add_argument("--prefill-chunk", type=int, default=8192)
    ap.add_argument("--draft-minutes", type=float, default=3.0)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: prefill, draft")
    ap.add_argument("--target", default=None, help="checkpoint for the target (HF folder or orbax run dir)")
    args = ap.parse_args()
    if args.quick:
        cfg = dataclasses.replace(config.tiny(), name="tiny")
        args.prompt, args.decode_steps, args.prefill_tokens, args.prefill_chunk = 32, 8, 4096, 512
        args.draft_minutes, batches, draft_shape = 0.0, (1, 4), dict(batch=2, length=64, gamma=3, max_new=8)
    else:
        cfg = dataclasses.replace(config.small(), param_dtype=jnp.bfloat16)
        batches, draft_shape = (1, 64), dict(batch=4, length=256, gamma=4, max_new=64)
    if args.target:
        from k3jax.checkpoint_source import load_variables

        cfg, variables = load_variables(args.target)
    else:
        variables = build(cfg)
    results = {"device": jax.devices()[0].device_kind, "config": cfg.name, "hbm_tbps": args.hbm_tbps,
               "target": args.target or "random init"}
    print(f"{cfg.name} built on {results['device']}; timing decode at batches {batches}", flush=True)
    results["decode"] = [bench_decode(cfg, variables, b, args.prompt, args.decode_steps, args.hbm_tbps)
                         for b in batches]
    for r in results["decode"]:
        print(f"decode B={r['batch']:3d}: {r['tokens_per_s']:10.1f} tok/s, step {r['step_ms']:.2f} ms "
              f"(one step per jitted call from Python: {r['host_loop_step_ms']:.2f} ms), "
              f"roofline {r['roofline_pct_all_weights']:.1f}% (all weights) / "
              f"{r['roofline_pct_active_weights']:.1f}% (active)", flush=True)
    if "prefill" not in args.skip.split(","):
        results["prefill"] = p = bench_prefill(cfg, variables, args.prefill_tokens, args.prefill_chunk)
        print(f"prefill {p['tokens']} tokens (chunk {p['chunk']}): {p['seconds']:.1f} s, peak {p['peak_device_bytes']} B; "
              f"KDA {p['kda_state_bytes'] / 2**20:.1f} MiB, MLA {p['mla_latent_bytes'] / 2**20:.1f} MiB, "
              f"weights {p['weight_bytes'] / 2**20:.1f} MiB vs full-attention KV {p['full_attention_kv_bytes'] / 2**20:.1f} MiB",
              flush=True)
    if "draft" not in args.skip.split(","):
        results["draft"] = d = bench_draft(cfg, variables, args.draft_minutes, **draft_shape)
        print(f"draft: {d['train_steps']} steps in {d['train_seconds']:.0f} s, loss {d['first_loss']:.3f} -> "
              f"{d['last_loss']:.3f}; mean accepted length (gamma={d['gamma']}) greedy {d['mean_accepted_length_greedy']:.2f}, "
              f"T=1 {d['mean_accepted_length_t1']:.2f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
