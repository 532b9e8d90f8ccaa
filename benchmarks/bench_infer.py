"""Inference benchmark: decode throughput against the HBM roofline, million-token chunked prefill,
and the mean accepted length of a briefly trained speculative draft.

1. Decode tokens/s at batch 1 and 64 for small() (bf16 weights; ``--mxfp4`` also with MXFP4 routed
   experts), after a prompt of ``--prompt`` tokens, and the bytes a step reads against the HBM
   roofline (``--hbm-tbps``; default the GPU's datasheet figure, ``hbm_tbps``): "all weights" (every
   parameter but the embedding table, plus the KDA states and the MLA latents up to the current length)
   and "needed weights" (the same less the experts no token of this batch was routed to, counted from
   the router's loads of one step). Each is printed again with the cache a step writes back added (every
   KDA state and conv tail, one latent row a sequence in each MLA layer): at batch 64 small()'s float32 KDA
   states alone are 0.3 GB written a step, which the read-only rooflines leave out.
   Steps run as one device-side loop on per-layer weights, shaped as ``generate``'s and compiled with
   its ``DECODE_XLA_OPTIONS`` (``k3jax.infer.decode``; per-layer weights as ``decode_layout`` and the
   serving engine run them); with ``--host-loop`` the step time of a Python
   loop of jitted ``decode_step`` calls is printed beside it. ``--variant NAME:KEY=VALUE,…`` builds
   the decode loop again with XLA options (``xla_…``) or ``ModelConfig`` overrides and times every
   build round-robin in this process, so an A/B of decode does not compare two machines' clocks.
   ``--long-steps N`` also times each build's loop at ``--decode-steps`` and at N steps with one program and splits a
   call's time into a step's (the slope) and the call's own (the intercept, which every ``generate`` call pays
   once; stop 74 on an H100: ~2.5 ms, 6 % of a 64-step call at batch 1).
2. Chunked prefill of ``--prefill-tokens`` (1,048,576) tokens at batch 1: time, model FLOPs (forward,
   causal attention; ``k3jax.train.metrics``) and their rate against a bf16 matmul measured in the
   same process, peak device memory, and the memory split (KDA states, MLA latents, weights)
   against the KV cache a full-attention model of the same depth would need.
3. A draft trained for ``--draft-minutes`` on the standard-library corpus (byte tokens) against the
   target (random init unless ``--target CHECKPOINT``), then the mean accepted length (tokens per
   target call) of speculative decoding, greedy and at temperature 1.

    PYTHONPATH=$PWD python3 benchmarks/bench_infer.py --out $OUT/bench_infer.json   # H200
    PYTHONPATH=$PWD python3 benchmarks/bench_infer.py --quick                       # CPU, tiny() sizes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k3jax import config
from k3jax.data import ByteTokenizer, stdlib_corpus
from k3jax.infer.cache import KDACache, MLACache, init_cache, tree_bytes
from k3jax.infer.decode import decode_layout, decode_step, prefill_jit
from k3jax.infer.draft import train_draft
from k3jax.infer.speculative import speculative_generate
from k3jax.layers import mxfp4
from k3jax.model import Transformer
from k3jax.train.metrics import flops_per_token
from k3jax.train.batched_calls import batch_random_draws

from benchmarks.decode_loop import compile_loop, decode_variants, loop_args, step_and_call_ms
from benchmarks.timing import timeit_interleaved


def build(cfg, seed=0):
    # One random draw per parameter shape: compiles in seconds rather than minutes on a GPU.
    init = batch_random_draws(Transformer(cfg).init)
    variables = jax.jit(init)(jax.random.key(seed), jnp.zeros((1, 8), jnp.int32))
    return nn.meta.unbox(variables)


def weight_bytes(variables) -> int:
    """Weights a step may read: every parameter (MXFP4 experts at their packed size; the kernels
    ``decode_layout`` moved to its ``decode`` collection) but the embedding table, of which a step
    reads only its tokens' rows."""
    return (tree_bytes(variables["params"]) - tree_bytes(variables["params"]["embed"])
            + tree_bytes(variables.get(mxfp4.COLLECTION, {})) + tree_bytes(variables.get("decode", {})))


def expert_bytes(variables) -> int:
    """Bytes of every MoE layer's routed experts together (bf16 params or MXFP4)."""
    if mxfp4.COLLECTION in variables:
        return tree_bytes(variables[mxfp4.COLLECTION])
    leaves = jax.tree_util.tree_flatten_with_path(variables["params"])[0]
    return sum(tree_bytes(x) for path, x in leaves if str(getattr(path[-1], "key", "")) in mxfp4.EXPERT_WEIGHTS)


def experts_touched(cfg, variables, tok, cache) -> np.ndarray:
    """Distinct experts each MoE layer routes ``tok`` to in one decode step: ``[MoE layers]``. Counted
    on the XLA decode path, which sows the router's loads (every decode path routes the same way)."""
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, decode_implementation="xla"))
    run = jax.jit(lambda v, t, c: Transformer(cfg).apply(v, t, c, method=Transformer.decode, mutable=["stats"])[1])
    stats = run(variables, tok, cache.layers)
    leaves = jax.tree_util.tree_flatten_with_path(stats)[0]
    loads = [np.asarray(x).reshape(-1, cfg.moe.num_experts) for path, x in leaves  # sown: (..., "loads", 0)
             if any(getattr(p, "key", None) == "loads" for p in path)]
    return (np.concatenate(loads) > 0).sum(axis=1)


def needed_weight_bytes(cfg, variables, touched: np.ndarray) -> int:
    """Weights a step needs: all of :func:`weight_bytes` less the experts no token was routed to."""
    per_layer_expert = expert_bytes(variables) / len(touched)
    unused = sum((cfg.moe.num_experts - n) / cfg.moe.num_experts for n in touched)
    return int(weight_bytes(variables) - unused * per_layer_expert)


def _layer_caches(cache) -> list:
    """Every layer cache, the scanned stack's stacked ones included."""
    return jax.tree.leaves(cache.layers, is_leaf=lambda x: isinstance(x, (KDACache, MLACache)))


def _cache_bytes(cache, latent_rows: int) -> int:
    """Every KDA state and conv tail whole, plus ``latent_rows`` latent rows a sequence in every MLA layer."""
    total = 0
    for layer in _layer_caches(cache):
        if isinstance(layer, KDACache):
            total += tree_bytes(layer)
        else:
            *lead, _, C = layer.latent.shape  # [B, S, C], or [R, B, S, C] in the scanned stack
            total += int(np.prod(lead)) * latent_rows * C * jnp.dtype(layer.latent.dtype).itemsize
    return total


def cache_read_bytes(cfg, cache, length: int) -> int:
    """Cache bytes one decode step reads: KDA state and conv tails, MLA latents up to ``length``."""
    return _cache_bytes(cache, length)


def cache_write_bytes(cache) -> int:
    """Cache bytes one decode step writes: every KDA state and conv tail anew (the float32 state is read
    and written whole each step), one latent row a sequence in every MLA layer."""
    return _cache_bytes(cache, 1)


def _host_loop_step(cfg, variables, tok, cache, steps) -> float:
    """Seconds per step of a Python loop of jitted ``decode_step`` calls (host dispatch included)."""
    jax.block_until_ready(decode_step(variables, cfg, tok, cache)[0])  # compile
    t0 = time.perf_counter()
    for _ in range(steps):
        logits, cache = decode_step(variables, cfg, tok, cache)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
    jax.block_until_ready(tok)
    return (time.perf_counter() - t0) / steps


def bench_decode(variants, variables, batch, prompt, steps, hbm, profile=None, host_loop=False,
                 long_steps=None) -> list[dict]:
    """One row per variant (``decode_variants``); the variants' device-side loops are timed round-robin
    in this process (``timing.timeit_interleaved``), so each is compared on the same clocks. With ``long_steps``
    every row also splits a call's time into a step's and the call's own (``decode_loop.step_and_call_ms``)."""
    cfg = variants["base"][0]
    tokens = jax.random.randint(jax.random.key(1), (batch, prompt), 0, cfg.vocab_size, jnp.int32)
    args = loop_args(cfg, variables, tokens, steps)
    cache = args[2]
    host_step_s = _host_loop_step(cfg, *args, steps) if host_loop else float("nan")
    # The greedy steps as one device-side loop shaped as `generate`'s: no per-step dispatch.
    calls, last = {}, {}
    for name, variant in variants.items():
        calls[name] = (compile_loop(variant, steps, args), args)
        last[name] = np.asarray(calls[name][0](*args))
    ms = timeit_interleaved(calls, reps=10, warmup=1, min_ms=50.0)
    if profile:  # one more run of the base loop under the profiler (benchmarks/trace_summary.py reads it)
        loop = compile_loop(variants["base"], steps, args, traced=True)
        jax.block_until_ready(loop(*args))
        with jax.profiler.trace(profile, create_perfetto_trace=True):
            jax.block_until_ready(loop(*args))
    split = step_and_call_ms(variants, variables, tokens, steps, long_steps) if long_steps else None
    touched = experts_touched(cfg, variables, tokens[:, -1:], cache)
    w_all, w_need = weight_bytes(variables), needed_weight_bytes(cfg, variables, touched)
    c_bytes, c_written = cache_read_bytes(cfg, cache, prompt + steps // 2), cache_write_bytes(cache)
    roof = lambda b: b / (hbm * 1e12)
    rows = []
    for name in variants:
        step_s = ms[name] / 1e3 / steps
        rows.append({"variant": name, "batch": batch, "prompt": prompt, "steps": steps, "step_ms": step_s * 1e3,
                     "tokens_per_s": batch / step_s,
                     "same_tokens_as_base": bool(np.array_equal(last[name], last["base"])),
                     "host_loop_step_ms": host_step_s * 1e3 if name == "base" else float("nan"),
                     "experts_touched_per_layer": touched.tolist(),
                     "weight_bytes_all": w_all, "weight_bytes_needed": w_need, "cache_bytes_read": c_bytes,
                     "bytes_per_step_all_weights": w_all + c_bytes, "bytes_per_step_needed_weights": w_need + c_bytes,
                     "roofline_ms_all_weights": 1e3 * roof(w_all + c_bytes),
                     "roofline_ms_needed_weights": 1e3 * roof(w_need + c_bytes),
                     "roofline_pct_all_weights": 100 * roof(w_all + c_bytes) / step_s,
                     "roofline_pct_needed_weights": 100 * roof(w_need + c_bytes) / step_s,
                     # the rooflines above count what a step reads; these add the cache it writes back
                     "cache_bytes_written": c_written,
                     "roofline_pct_all_weights_read_and_written": 100 * roof(w_all + c_bytes + c_written) / step_s,
                     "roofline_pct_needed_weights_read_and_written":
                         100 * roof(w_need + c_bytes + c_written) / step_s})
        if split:  # a step's time without the call's own (from `long_steps`)
            step_ms, call_ms = split[name]
            rows[-1].update({"long_steps": long_steps, "step_ms_without_call": step_ms, "call_ms": call_ms,
                             "roofline_pct_all_weights_without_call": 100 * roof(w_all + c_bytes) / step_ms * 1e3,
                             "roofline_pct_needed_weights_without_call":
                                 100 * roof(w_need + c_bytes) / step_ms * 1e3})
    return rows


def peak_bytes():
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def matmul_ceiling(n: int = 8192, iters: int = 10) -> float:
    """Measured bf16 matmul FLOP/s of an ``n³`` product (the prefill's compute ceiling)."""
    a = jax.random.normal(jax.random.key(3), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda x: x @ x)
    jax.block_until_ready(mm(a))
    t0 = time.perf_counter()
    for _ in range(iters):
        out = mm(a)
    jax.block_until_ready(out)
    return 2 * n ** 3 * iters / (time.perf_counter() - t0)


def bench_prefill(cfg, variables, n_tokens, chunk, ceiling_n=8192):
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
    flops = n_tokens * flops_per_token(cfg, n_tokens) / 3  # forward model FLOPs (causal attention)
    ceiling = matmul_ceiling(ceiling_n)
    return {"tokens": n_tokens, "chunk": chunk, "seconds": seconds, "tokens_per_s": n_tokens / seconds,
            "model_flops": flops, "tflops_per_s": flops / seconds / 1e12, "matmul_ceiling_tflops": ceiling / 1e12,
            "pct_of_matmul_ceiling": 100 * flops / seconds / ceiling,
            "peak_device_bytes": peak_bytes(),
            "compiled_temp_bytes": getattr(analysis, "temp_size_in_bytes", None),
            "kda_state_bytes": kda, "mla_latent_bytes": mla,
            "weight_bytes": tree_bytes((variables["params"], variables.get("decode", {}))),
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


# HBM bandwidth by device kind (datasheets; the SXM parts lent here): an H100 run's roofline at the H200's
# figure understates its percentages by 30 %
HBM_TBPS = {"H200": 4.8, "H100": 3.35}


def hbm_tbps(device_kind: str, given: float | None) -> tuple[float, str]:
    """``(TB/s, where it came from)``: ``given`` (``--hbm-tbps``), else the datasheet figure of the first
    ``HBM_TBPS`` name in ``device_kind``, else the H200's (a CPU smoke run), said so."""
    if given is not None:
        return given, "--hbm-tbps"
    for name, tbps in HBM_TBPS.items():
        if name in device_kind:
            return tbps, f"{name} datasheet"
    return HBM_TBPS["H200"], f"no datasheet figure for {device_kind!r}: the H200's; pass --hbm-tbps"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny() at toy sizes (CPU smoke run)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--hbm-tbps", type=float, default=None,
                    help="HBM bandwidth, TB/s (default: the GPU's datasheet figure, HBM_TBPS)")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--long-steps", type=int, default=None,
                    help="also time each loop at this many steps and split a call's time into a step's (the "
                         "slope) and the call's own (the intercept)")
    ap.add_argument("--prefill-tokens", type=int, default=1_048_576)
    ap.add_argument("--prefill-chunk", type=int, default=8192)
    ap.add_argument("--draft-minutes", type=float, default=3.0)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: decode, prefill, draft")
    ap.add_argument("--host-loop", action="store_true", help="also time a Python loop of jitted steps")
    ap.add_argument("--profile", default=None, help="trace one decode loop per batch into this folder "
                    "(compiled without WHILE / CONDITIONAL command buffers, under which the loop is one event)")
    ap.add_argument("--mxfp4", action="store_true", help="also time decode with MXFP4 expert weights")
    ap.add_argument("--batches", default=None, help="comma list of decode batch sizes (default 1,64; quick 1,4)")
    ap.add_argument("--target", default=None, help="checkpoint for the target (HF folder or orbax run dir)")
    ap.add_argument("--variant", dest="variants", action="append", default=[], metavar="NAME:KEY=VALUE,…",
                    help="also time decode built with these XLA options (xla_…=VALUE), ModelConfig overrides "
                         "(moe.decode_implementation=xla), the logits' argmax (head=logits) or module constants set "
                         "while it compiles (@pallas_kernels.mla_attention.kernel_gpu_decode.NUM_STAGES=2), "
                         "interleaved with the base build (repeatable)")
    args = ap.parse_args()
    if args.quick:
        cfg = dataclasses.replace(config.tiny(), name="tiny")
        args.prompt, args.decode_steps, args.prefill_tokens, args.prefill_chunk = 32, 8, 4096, 512
        args.draft_minutes, batches, draft_shape = 0.0, (1, 4), dict(batch=2, length=64, gamma=3, max_new=8)
    else:
        cfg = dataclasses.replace(config.small(), param_dtype=jnp.bfloat16)
        batches, draft_shape = (1, 64), dict(batch=4, length=256, gamma=4, max_new=64)
    if args.long_steps is not None and args.long_steps <= args.decode_steps:
        ap.error(f"--long-steps={args.long_steps} must exceed --decode-steps={args.decode_steps}")
    skip = args.skip.split(",")
    if args.batches:
        batches = tuple(int(b) for b in args.batches.split(","))
    if args.target:
        from k3jax.checkpoint_source import load_variables

        cfg, variables = load_variables(args.target)
    else:
        variables = build(cfg)
    variables, cfg = decode_layout(variables, cfg)  # as generate and the serving engine decode
    device = jax.devices()[0].device_kind
    args.hbm_tbps, source = hbm_tbps(device, args.hbm_tbps)
    results = {"device": device, "config": cfg.name, "hbm_tbps": args.hbm_tbps,
               "target": args.target or "random init", "xla_flags": os.environ.get("XLA_FLAGS", "")}
    print(f"{cfg.name} built on {results['device']} (rooflines at {args.hbm_tbps} TB/s: {source}); timing decode "
          f"at batches {batches}", flush=True)
    results["decode"] = []
    weights = {"bf16": variables} if "decode" not in skip else {}
    if args.mxfp4 and weights:
        t0 = time.perf_counter()
        weights["mxfp4"] = mxfp4.quantize_experts(variables)
        results["mxfp4_quantize_seconds"] = time.perf_counter() - t0
    for name, v in weights.items():
        for b in batches:
            trace = f"{args.profile}/{name}_b{b}" if args.profile else None
            rows = bench_decode(decode_variants(cfg, args.variants), v, b, args.prompt, args.decode_steps,
                                args.hbm_tbps, trace, args.host_loop, args.long_steps)
            for r in rows:
                r["experts"] = name
                results["decode"].append(r)
                base = r["variant"] == "base"
                label = name if base else f"{name} {r['variant']}"
                host = f" (from Python: {r['host_loop_step_ms']:.2f} ms)" if args.host_loop and base else ""
                same = "" if r["same_tokens_as_base"] else " (last tokens differ from base)"
                print(f"decode {label} B={r['batch']:3d}: {r['tokens_per_s']:10.1f} tok/s, step {r['step_ms']:.3f} ms"
                      f"{host}; bytes/step {r['bytes_per_step_all_weights'] / 1e9:.3f} GB "
                      f"all / {r['bytes_per_step_needed_weights'] / 1e9:.3f} GB needed (experts touched per layer "
                      f"{min(r['experts_touched_per_layer'])}-{max(r['experts_touched_per_layer'])}); roofline "
                      f"{r['roofline_ms_all_weights']:.3f} / {r['roofline_ms_needed_weights']:.3f} ms = "
                      f"{r['roofline_pct_all_weights']:.1f}% / {r['roofline_pct_needed_weights']:.1f}%; with the "
                      f"{r['cache_bytes_written'] / 1e9:.3f} GB of cache written "
                      f"{r['roofline_pct_all_weights_read_and_written']:.1f}% / "
                      f"{r['roofline_pct_needed_weights_read_and_written']:.1f}%{same}",
                      flush=True)
                if "call_ms" in r:
                    print(f"  without the call's own {r['call_ms']:.2f} ms ({r['steps']} and {r['long_steps']} "
                          f"steps): step {r['step_ms_without_call']:.3f} ms = "
                          f"{r['roofline_pct_all_weights_without_call']:.1f}% / "
                          f"{r['roofline_pct_needed_weights_without_call']:.1f}%", flush=True)
    if "prefill" not in skip:
        results["prefill"] = p = bench_prefill(cfg, variables, args.prefill_tokens, args.prefill_chunk,
                                               1024 if args.quick else 8192)
        print(f"prefill {p['tokens']} tokens (chunk {p['chunk']}): {p['seconds']:.1f} s, "
              f"{p['model_flops']:.3g} FLOPs = {p['tflops_per_s']:.1f} TFLOP/s = {p['pct_of_matmul_ceiling']:.1f}% "
              f"of the measured matmul ceiling ({p['matmul_ceiling_tflops']:.1f} TFLOP/s); peak {p['peak_device_bytes']} B; "
              f"KDA {p['kda_state_bytes'] / 2**20:.1f} MiB, MLA {p['mla_latent_bytes'] / 2**20:.1f} MiB, "
              f"weights {p['weight_bytes'] / 2**20:.1f} MiB vs full-attention KV {p['full_attention_kv_bytes'] / 2**20:.1f} MiB",
              flush=True)
    if "draft" not in skip:
        results["draft"] = d = bench_draft(cfg, variables, args.draft_minutes, **draft_shape)
        print(f"draft: {d['train_steps']} steps in {d['train_seconds']:.0f} s, loss {d['first_loss']:.3f} -> "
              f"{d['last_loss']:.3f}; mean accepted length (gamma={d['gamma']}) greedy {d['mean_accepted_length_greedy']:.2f}, "
              f"T=1 {d['mean_accepted_length_t1']:.2f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
