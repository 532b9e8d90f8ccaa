"""One decoder layer of ``kimi_k3()`` at its real width, as one device of a 16-way expert-parallel
layout trains it: fwd+bwd time, MFU per layer kind, activation memory, where the time goes.

    PYTHONPATH=. python3 benchmarks/bench_layer.py --tokens 8192,65536 --remat none,layer --out $OUT/layer.json
    PYTHONPATH=. python3 benchmarks/bench_layer.py --model tiny --local-experts 8 --top-k 2 --tokens 256  # CPU

The layers are ``k3jax.layers.block.DecoderLayer`` itself (AttnRes mixes, norms, the mixer, the
LatentMoE with its shared experts), not a re-implementation: a KDA layer (96 heads) and an MLA layer
(96 heads) from the middle of the stack (index 46 / 47, so the AttnRes mixes read 4 stored blocks,
about the stack's mean), each with its MoE (7168 → 3584 latent, experts F = 3072, 2 shared experts
of 3072 at full width).

**The expert-parallel stand-in.** K3 routes each token to 16 of 896 experts; with 16-way expert
parallelism a device holds 56 of them. Each of the 16 devices sends its T tokens' 16·T assignments
to the ranks owning the experts, so under balanced routing a device receives 16·16·T/16 = 16·T rows
for its 56 experts. The layer here routes its own T tokens top-16 over 56 local experts: the same
16·T rows through the same grouped matmuls at the same widths (its router is 7168 × 56 instead of
7168 × 896, 0.6 % of the layer's FLOPs, and the all-to-all itself is not timed — it is
communication, measured by ``bench_sharding.py``). A top-1 stand-in would give the experts only T
rows, a 16th of a rank's real work.

**Counting.** Model FLOPs per token (``k3jax.train.metrics``, as ``experiments/accounting.py``):
6 × the parameters a token touches (routed experts: top_k / E of the stacks) plus the token mixer's
term (chunkwise KDA, or causal MLA at T / 2 keys); rematerialisation is not counted. MFU is over the
989 TFLOP/s datasheet peak; the bf16 8192³ ``jnp.dot`` measured in the same call is printed beside.

**Memory.** Per case: the residuals the backward keeps (``saved_residuals``: what one layer of a
stack holds from its forward until its backward, its inputs and weights excluded; ``--residuals``
lists them by origin, traced for an H200 on any host), the same measured on the device (the
buffers a jitted ``jax.vjp`` forward returns that are not its inputs, and the growth of bytes in
use over that call), the compiled fwd+bwd's temporaries (``memory_analysis``) and the device's
peak so far (monotonic over the process, so cases run in order of growing memory).

**Compiler options.** Each case compiles with the train step's XLA options (``TrainConfig``'s
``excess_precision`` and ``xla_options`` defaults); ``--variant NAME:OPTION=VALUE,…`` adds builds
with other options, timed interleaved with the base one in this process
(the H200's clocks drift too much between processes for a 1-2 % A/B).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
import traceback

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax._src.ad_checkpoint import saved_residuals

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmarks.timing import timeit_interleaved  # noqa: E402
from k3jax.config import LayerKind, ModelConfig, preset  # noqa: E402
from k3jax.layers.attn_res import ResidualStream  # noqa: E402
from k3jax.layers.block import DecoderLayer  # noqa: E402
from k3jax.train.config import TrainConfig, xla_compiler_options  # noqa: E402
from k3jax.train.metrics import _active_size, _kda_flops, _mla_flops, peak_flops  # noqa: E402
from layer_breakdown import breakdown  # noqa: E402

REMATS = ("none", "layer", "moe")
GiB = 2**30


def layer_config(model: str, local_experts: int, top_k: int, param_dtype: str) -> ModelConfig:
    """``model``'s config with the MoE as one expert-parallel rank sees it (module docstring)."""
    cfg = preset(model)
    if not 1 <= top_k <= local_experts:
        raise ValueError(f"top_k={top_k} must lie in [1, local_experts={local_experts}]")
    moe = dataclasses.replace(cfg.moe, num_experts=local_experts, top_k=top_k)
    return dataclasses.replace(cfg, moe=moe, param_dtype=jnp.dtype(param_dtype))


def layer_index(cfg: ModelConfig, kind: str) -> int:
    """The MoE layer of ``kind`` nearest the middle of the stack."""
    kinds = {"kda": LayerKind.KDA, "mla": LayerKind.MLA}
    if kind not in kinds:
        raise ValueError(f"kind={kind!r} must be one of {tuple(kinds)}")
    want = kinds[kind]
    found = [i for i, k in enumerate(cfg.layer_kinds) if k is want and cfg.moe_layers[i]]
    if not found:
        raise ValueError(f"kind={kind!r}: {cfg.name} has no MoE layer of that kind")
    return min(found, key=lambda i: abs(i - cfg.num_layers // 2))


def stream_at(cfg: ModelConfig, index: int, tokens: int, key) -> ResidualStream:
    """A random residual stream as layer ``index`` receives it (its stored AttnRes blocks included)."""
    stored = 0 if cfg.attn_res is None else -(-index // cfg.attn_res.block_size)
    keys = jax.random.split(key, stored + 1)
    draw = lambda k: jax.random.normal(k, (1, tokens, cfg.hidden), cfg.compute_dtype)
    return ResidualStream(partial=draw(keys[0]), stored=tuple(draw(k) for k in keys[1:]),
                          max_blocks=cfg.num_attn_res_blocks)


def make_case(cfg: ModelConfig, kind: str, tokens: int, remat: str, key, abstract: bool = False):
    """(loss(params, stream, cot), (params, stream, cot), index) for one layer: loss = ⟨output, cot⟩.
    ``abstract``: params and stream as shapes only (nothing allocated; for ``residual_report``)."""
    if remat not in REMATS:
        raise ValueError(f"remat={remat!r} must be one of {REMATS}")
    index = layer_index(cfg, kind)
    layer = (nn.remat(DecoderLayer) if remat == "layer" else DecoderLayer)(cfg, index, remat_moe=remat == "moe")
    k_init, k_x, k_cot = jax.random.split(key, 3)
    build = jax.eval_shape if abstract else lambda f, *a: f(*a)
    stream = build(lambda k: stream_at(cfg, index, tokens, k), k_x)
    variables = build(jax.jit(layer.init), k_init, stream)
    params = nn.unbox(variables["params"])  # plain arrays: the FLOP count reads their paths
    balance = jax.tree.map(lambda v: jnp.zeros(v.shape, v.dtype), variables["balance"])  # the bias starts at 0
    cot = build(lambda k: jax.random.normal(k, (1, tokens, cfg.hidden), jnp.float32), k_cot)

    def loss(p, s, c):
        out = layer.apply({"params": p, "balance": balance}, s)
        return jnp.sum(out.partial.astype(jnp.float32) * c)

    return loss, (params, stream, cot), index


def layer_flops(cfg: ModelConfig, params, kind: str, tokens: int) -> float:
    """Model FLOPs of one fwd+bwd of the layer over ``tokens`` (module docstring)."""
    mixer = _kda_flops(cfg) if kind == "kda" else _mla_flops(cfg, tokens)
    return tokens * (6.0 * _active_size(params, cfg) + mixer)


def residuals(loss, inputs) -> list[tuple[int, str, str]]:
    """``(bytes, shape, where from)`` of each residual the backward keeps, largest first; the layer's
    inputs, weights and the loss's cotangent (arguments) and constants are not activations."""
    params, stream, cot = inputs
    if isinstance(cot, jax.ShapeDtypeStruct):  # abstract inputs: the cotangent is still a constant
        cot = np.ones(cot.shape, cot.dtype)
    # differentiated w.r.t. the weights and the stream only, as the step is
    rows = [(int(np.prod(a.shape)) * a.dtype.itemsize, a.str_short(), why)
            for a, why in saved_residuals(lambda p, s: loss(p, s, cot), params, stream)
            if not why.startswith(("from the argument", "from a constant", "from a literal"))]
    return sorted(rows, key=lambda r: -r[0])


def activation_bytes(loss, inputs) -> int:
    """Bytes of the residuals the backward keeps (``residuals``)."""
    return sum(b for b, _, _ in residuals(loss, inputs))


def _origin(why: str) -> str:
    """``why``'s op and source line, with paths relative to the repository."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    return why.replace(root, "")


def residual_report(cfg: ModelConfig, kind: str, tokens: int, remat: str, top: int = 12) -> dict:
    """The residuals of one layer traced for an H200 on any host (abstract, nothing allocated), so the
    kernels' GPU paths decide what is saved: total GiB and the largest residuals by origin."""
    from pallas_kernels.target import Target, compile_for

    with compile_for(Target("gpu", "NVIDIA H200", 132, cuda=True)):
        loss, inputs, index = make_case(cfg, kind, tokens, remat, jax.random.key(0), abstract=True)
        rows = residuals(loss, inputs)
    total = sum(b for b, _, _ in rows)
    print(f"{kind} layer {index}, T={tokens}, remat={remat}: {total / GiB:.2f} GiB in {len(rows)} residuals")
    for b, shape, why in rows[:top]:
        print(f"  {b / 2**20:9.1f} MiB  {shape:28s} {_origin(why)}")
    return {"kind": kind, "index": index, "tokens": tokens, "remat": remat, "activation_gib": total / GiB,
            "largest": [{"mib": b / 2**20, "shape": shape, "origin": _origin(why)} for b, shape, why in rows[:top]]}


def measured_activation_bytes(loss, inputs) -> tuple[int, int] | None:
    """Device bytes a jitted ``jax.vjp`` forward's residuals hold: (the residual buffers that are not
    the inputs' own, bytes in use after the call minus before); None where the backend keeps no stats."""
    dev = jax.devices()[0]
    if dev.memory_stats() is None:
        return None
    fwd = jax.jit(lambda p, s, c: jax.vjp(lambda p, s: loss(p, s, c), p, s)[1])
    jax.block_until_ready(fwd(*inputs))  # compile and warm outside the measurement
    before = dev.memory_stats()["bytes_in_use"]
    out = fwd(*inputs)
    jax.block_until_ready(out)
    grown = dev.memory_stats()["bytes_in_use"] - before
    own = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(inputs)}
    held = sum(x.nbytes for x in jax.tree.leaves(out) if x.unsafe_buffer_pointer() not in own)
    del out
    return int(held), int(grown)


def matmul_ceiling() -> float:
    """bf16 8192³ ``jnp.dot`` TFLOP/s in this process (the measured tensor-core ceiling)."""
    a = jax.random.normal(jax.random.key(0), (8192, 8192), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (8192, 8192), jnp.bfloat16)
    ms = timeit_interleaved({"dot": (jax.jit(jnp.dot), (a, b))}, reps=5)["dot"]
    return 2 * 8192**3 / ms / 1e9


def parse_variant(spec: str, taken=("base",)) -> tuple[str, list[str]]:
    """A ``--variant`` of this script or ``bench_train.py``: ``NAME:KEY=VALUE,…`` -> (NAME, the
    ``KEY=VALUE`` strings; a comma inside a value, as in a tuple, stays; a KEY may start with ``@``,
    ``bench_infer.py``'s module constants), NAME not in ``taken``."""
    name, sep, body = spec.partition(":")
    if not sep or not name or name in taken or not body:
        raise ValueError(f"--variant={spec!r} must read NAME:KEY=VALUE[,KEY=VALUE…] with a new NAME (not 'base')")
    return name, re.split(r",(?=@?[\w.]+=)", body)


def compiler_variants(specs: list[str]) -> dict[str, dict]:
    """``{"base": the train step's XLA options, NAME: them with OPTION=VALUE, …}`` for each
    ``NAME:OPTION=VALUE,…`` of ``specs`` (``ValueError`` naming a malformed one)."""
    base = xla_compiler_options(TrainConfig.excess_precision, TrainConfig.xla_options)
    variants = {"base": base}
    for spec in specs:
        name, options = parse_variant(spec, variants)
        variants[name] = {**base, **xla_compiler_options(base["xla_allow_excess_precision"], options)}
    return variants


def run_case(args, cfg: ModelConfig, kind: str, tokens: int, remat: str) -> list[dict]:
    """One row per compiler variant (``--variant``), the variants timed interleaved in this process."""
    loss, inputs, index = make_case(cfg, kind, tokens, remat, jax.random.key(tokens))
    params, stream, _ = inputs
    base = {"kind": kind, "index": index, "tokens": tokens, "remat": remat, "param_dtype": str(cfg.param_dtype),
            "stored_blocks": len(stream.stored), "flops": layer_flops(cfg, params, kind, tokens)}
    base["activation_gib"] = activation_bytes(loss, inputs) / GiB
    held = measured_activation_bytes(loss, inputs) if tokens <= args.measure_tokens else None
    if held is not None:
        base["measured_activation_gib"], base["measured_growth_gib"] = held[0] / GiB, held[1] / GiB
    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*inputs)

    def build(variant):
        t0 = time.perf_counter()
        try:
            compiled = lowered.compile(compiler_options=args.variants[variant])
        except Exception as ex:  # noqa: BLE001 (an option XLA rejects is recorded; the other builds still run)
            return dict(base, variant=variant, error=repr(ex)[:400]), None
        row = dict(base, variant=variant, compile_s=round(time.perf_counter() - t0, 1))
        mem = compiled.memory_analysis()
        if mem is not None:
            row["compiled_temp_gib"] = mem.temp_size_in_bytes / GiB
        return row, compiled

    # One after another: builds compiled side by side on one GPU broke each other's autotuning (CUDA
    # stream capture invalidated, an MLA build failed; RESULTS.md, stop 39).
    built = {variant: build(variant) for variant in args.variants}
    failed = [row for row, compiled in built.values() if compiled is None]
    rows = {variant: row for variant, (row, compiled) in built.items() if compiled is not None}
    calls = {variant: (compiled, inputs) for variant, (_, compiled) in built.items() if compiled is not None}
    ms = timeit_interleaved(calls, reps=args.reps, min_ms=1.0)
    stats = jax.devices()[0].memory_stats()
    peak = peak_flops(args.peak_flops)
    for variant, row in rows.items():
        row["ms"] = ms[variant]
        if stats:
            row["peak_so_far_gib"] = stats["peak_bytes_in_use"] / GiB
        row["tflops"] = row["flops"] / row["ms"] / 1e9
        row["mfu"] = None if peak is None else row["flops"] / (row["ms"] * 1e-3) / peak
        if args.profile and tokens == min(args.tokens):
            row["breakdown"] = breakdown(calls[variant][0], inputs,
                                         os.path.join(args.profile, f"{kind}_{remat}_{variant}"))
    return list(rows.values()) + failed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="kimi_k3")
    p.add_argument("--kinds", default="kda,mla")
    p.add_argument("--tokens", default="8192,65536")
    p.add_argument("--remat", default="none,layer")
    p.add_argument("--local-experts", type=int, default=56)
    p.add_argument("--top-k", type=int, default=16)
    p.add_argument("--param-dtype", default="bfloat16",
                   help="stored weights; bfloat16 as a bf16 working copy of the master weights would be")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--measure-tokens", type=int, default=8192,
                   help="measure the residuals on the device (one more compile) up to this many tokens")
    p.add_argument("--peak-flops", type=float, default=None)
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="trace 2 steps of each case at the smallest token count; print the device time per kernel")
    p.add_argument("--residuals", action="store_true",
                   help="only trace each case for an H200 (any host, nothing allocated) and list what its backward keeps")
    p.add_argument("--variant", dest="variants", action="append", default=[], metavar="NAME:OPTION=VALUE,…",
                   help="also compile with these XLA options on top of the train step's and time it interleaved "
                        "with the base build, e.g. xla_excess:xla_allow_excess_precision=true")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    try:
        a.variants = compiler_variants(a.variants)
    except ValueError as e:
        p.error(str(e))
    a.tokens = [int(t) for t in a.tokens.split(",")]
    cfg = layer_config(a.model, a.local_experts, a.top_k, a.param_dtype)
    if a.residuals:
        rows = [residual_report(cfg, kind, t, remat) for t in a.tokens for kind in a.kinds.split(",")
                for remat in a.remat.split(",")]
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"model": a.model, "residuals": rows}, f, indent=1)
        return
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "model": a.model,
              "local_experts": a.local_experts, "top_k": a.top_k, "cases": []}
    if jax.default_backend() == "gpu":
        result["matmul_ceiling_tflops"] = matmul_ceiling()
        print(f"bf16 8192^3 jnp.dot: {result['matmul_ceiling_tflops']:.0f} TFLOP/s", flush=True)
    for tokens in a.tokens:  # cases in order of growing memory (the peak is the process's so far)
        for kind in a.kinds.split(","):
            for remat in reversed(a.remat.split(",")):
                try:
                    rows = run_case(a, cfg, kind, tokens, remat)
                except Exception as ex:  # noqa: BLE001 (an out-of-memory case is recorded, the rest still run)
                    traceback.print_exc()
                    rows = [{"kind": kind, "tokens": tokens, "remat": remat, "error": repr(ex)[:400]}]
                result["cases"] += rows
                for row in rows:
                    print(json.dumps({k: v for k, v in row.items() if k != "breakdown"}), flush=True)
                if a.out:
                    with open(a.out, "w") as f:
                        json.dump(result, f, indent=1)
    print_table(result)


def print_table(result: dict) -> None:
    print("| kind | T | remat | variant | ms | TFLOP/s | MFU | activations GiB (saved / measured) | temp GiB | peak so far GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in result["cases"]:
        if "error" in r:
            print(f"| {r['kind']} | {r['tokens']} | {r['remat']} | {r.get('variant', '')} | error: {r['error'][:80]} |")
            continue
        f = lambda k, fmt="{:.2f}": "–" if r.get(k) is None else fmt.format(r[k])
        print(f"| {r['kind']} | {r['tokens']} | {r['remat']} | {r['variant']} | {f('ms')} | {f('tflops', '{:.0f}')} | "
              f"{f('mfu', '{:.1%}')} | {f('activation_gib')} / {f('measured_activation_gib')} | "
              f"{f('compiled_temp_gib')} | {f('peak_so_far_gib')} |")


if __name__ == "__main__":
    main()
