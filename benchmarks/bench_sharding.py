"""Sharded train-step throughput: forward + backward of ``small()`` on 1 GPU vs a mesh.

For every layout it builds the mesh, places the parameters by their logical names
(``sharding.shard_params``), jits ``value_and_grad`` of the next-token cross entropy of the train
step (``k3jax.train.loss.head_cross_entropy``, ``--loss-chunk`` tokens at a time, so the
163840-wide logits never exist for the whole sequence) and
times ``--iters`` steps after ``--warmup``. On a mesh the loss runs per device
(``sharding.reduce.head_cross_entropy_sharded``). Printed: tokens/s in total and per GPU, per-GPU
throughput relative to the 1-GPU run (1.0 = perfect scaling), and the EP overflow count (assignments
past the a2a buffers, summed over layers: those calls ran further all-to-all rounds; ``--ep-reserve``).

Layouts (the tokens per step grow with the devices that split the batch):
  1gpu            mesh of one device, B = 1
  data_expert     data × expert over every device (experts split, tokens travel all-to-all)
  sequence        sequence = 2, the rest data (KDA/MLA context parallel, T split in two)

Run on the 2-GPU machine:
  PYTHONPATH=$PWD python3 benchmarks/bench_sharding.py --seq-len 65536
EP strategies alone (a2a vs all-gather/reduce-scatter), e.g. on 8 fake CPU devices:
  XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=$PWD python3 \\
      benchmarks/bench_sharding.py --ep-bench --f32 --iters 3
CPU smoke run (no timing value):
  XLA_FLAGS=--xla_force_host_platform_device_count=2 PYTHONPATH=$PWD python3 \\
      benchmarks/bench_sharding.py --preset tiny --seq-len 128 --iters 1 --warmup 1 --f32
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

from k3jax.config import preset
from k3jax.model import Transformer
from k3jax.train.batched_calls import batch_random_draws
from k3jax.train.loss import head_cross_entropy
from sharding import current, logical_axes, make_mesh, shard_params, use_mesh
from sharding.reduce import head_cross_entropy_sharded


def make_step(model, cfg, chunk):
    """``value_and_grad`` of the chunked head CE; aux: the EP overflow count summed over layers.

    On a mesh the loss runs per device (``sharding.reduce.head_cross_entropy_sharded``): under
    plain jit its chunk loop over the flattened tokens all-gathers the features and every device
    computes the head for the whole batch.
    """
    def loss_fn(params, variables, tokens, labels):
        (features, _), mutated = model.apply({**variables, "params": params}, tokens, method="features",
                                             mutable=["stats"])
        ones = jnp.ones(labels.shape, jnp.float32)
        head = params["head"]["kernel"]
        ce = head_cross_entropy if current() is None else head_cross_entropy_sharded
        overflow = [v for path, v in jax.tree_util.tree_leaves_with_path(mutated)
                    if "ep_overflow" in jax.tree_util.keystr(path)]
        overflow = sum(jnp.sum(v) for v in overflow) if overflow else jnp.zeros((), jnp.int32)
        return ce(features, head, labels, ones, chunk) / labels.size, overflow

    @jax.jit
    def step(variables, tokens, labels):
        return jax.value_and_grad(loss_fn, has_aux=True)(variables["params"], variables, tokens, labels)

    return step


def run_layout(name, mesh_axes, devices, model, cfg, boxed, variables, args):
    mesh = make_mesh(**mesh_axes, devices=devices)
    batch_split = mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["expert"]
    B, T = args.batch * batch_split, args.seq_len
    tokens = jax.random.randint(jax.random.PRNGKey(1), (B, T), 0, cfg.vocab_size)
    labels = jnp.roll(tokens, -1, axis=1)
    placed = shard_params(variables, logical_axes(boxed), mesh)
    with use_mesh(mesh, ep_reserve=args.ep_reserve) as ctx:
        tokens = jax.device_put(tokens, ctx.sharding("batch", "length"))
        labels = jax.device_put(labels, ctx.sharding("batch", "length"))
        step = make_step(model, cfg, args.loss_chunk)
        print(f"{name:12s} compiling and running the first step ...", flush=True)
        start = time.perf_counter()
        (loss, overflow), grads = step(placed, tokens, labels)
        jax.block_until_ready(grads)
        compile_s = time.perf_counter() - start
        for _ in range(args.warmup - 1):
            jax.block_until_ready(step(placed, tokens, labels))
        start = time.perf_counter()
        for _ in range(args.iters):
            (loss, overflow), grads = step(placed, tokens, labels)
        jax.block_until_ready(grads)
        seconds = (time.perf_counter() - start) / args.iters
    n = len(devices)
    tps = B * T / seconds
    print(f"{name:12s} mesh={dict(mesh.shape)} B={B} T={T} loss={float(loss):.4f} "
          f"step={seconds * 1e3:.1f} ms  tokens/s={tps:,.0f}  per GPU={tps / n:,.0f}  "
          f"EP overflow={int(overflow)}  (first call {compile_s:.1f} s)", flush=True)
    return tps / n


def bench_ep(args):
    """Time ``moe_ffn_ep`` fwd+bwd with each strategy on every device (expert axis = all of them)."""
    from sharding.ep import moe_ffn_ep

    n = len(jax.devices())
    E, k, L, F, N = args.ep_shape
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    dt = jnp.float32 if args.f32 else jnp.bfloat16
    x = jax.random.normal(keys[0], (N * n, L), dt)
    logits = jax.random.normal(keys[1], (N * n, E))
    _, ids = jax.lax.top_k(logits, k)
    w = jax.nn.softmax(jnp.take_along_axis(logits, ids, 1), -1)
    ws = [(0.05 * jax.random.normal(kk, s)).astype(dt) for kk, s in zip(keys[2:], [(E, L, F), (E, L, F), (E, F, L)])]
    mesh = make_mesh(data=1, expert=n)
    for strategy in ("a2a", "gather"):
        with use_mesh(mesh, ep_strategy=strategy, ep_reserve=0.5):
            loss = lambda x, w1: jnp.sum(moe_ffn_ep(x, ids, w, w1, ws[1], ws[2])[0].astype(jnp.float32))
            f = jax.jit(jax.value_and_grad(loss, (0, 1)))
            jax.block_until_ready(f(x, ws[0]))
            start = time.perf_counter()
            for _ in range(args.iters):
                out = f(x, ws[0])
            jax.block_until_ready(out)
            ms = (time.perf_counter() - start) / args.iters * 1e3
        print(f"ep {strategy:6s} E={E} k={k} L={L} F={F} tokens/device={N} devices={n}: {ms:.1f} ms fwd+bwd",
              flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq-len", type=int, default=65536)
    parser.add_argument("--batch", type=int, default=1, help="rows per batch-splitting device")
    parser.add_argument("--loss-chunk", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--remat", default="layer", choices=["none", "layer", "moe"])
    parser.add_argument("--f32", action="store_true", help="float32 compute (CPU smoke runs)")
    parser.add_argument("--layouts", default="1gpu,data_expert,sequence")
    parser.add_argument("--ep-reserve", type=float, default=0.25,
                        help="EP a2a buffer reserve over the plan (overflow falls back to the gather path)")
    parser.add_argument("--ep-bench", action="store_true", help="only compare the EP strategies")
    parser.add_argument("--ep-shape", type=int, nargs=5, default=[64, 8, 512, 512, 1024],
                        metavar=("E", "K", "L", "F", "N"), help="experts, top-k, width, expert F, tokens/device")
    args = parser.parse_args()
    if args.ep_bench:
        return bench_ep(args)

    cfg = preset(args.preset)
    if args.f32:
        cfg = dataclasses.replace(cfg, dtype=jnp.float32)
    model = Transformer(cfg, remat=args.remat)
    devices = jax.devices()
    n = len(devices)
    boxed = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 128), jnp.int32))
    init = batch_random_draws(model.init)  # one draw per parameter shape: a short compile
    variables = jax.jit(lambda k: nn.unbox(init(k, jnp.zeros((1, 128), jnp.int32))))(jax.random.PRNGKey(0))
    print(f"{args.preset}: {n} x {devices[0].device_kind}, T={args.seq_len}, remat={args.remat}", flush=True)
    layouts = {
        "1gpu": (dict(data=1), devices[:1]),
        "data_expert": (dict(data=-1, expert=min(n, 2) if n > 1 else 1), devices),
        "sequence": (dict(data=-1, sequence=2), devices),
    }
    base = None
    for name in args.layouts.split(","):
        axes, devs = layouts[name]
        if name == "sequence" and n % 2:
            print("sequence: needs an even number of devices; skipped")
            continue
        try:
            per_gpu = run_layout(name, axes, devs, model, cfg, boxed, variables, args)
        except Exception as err:  # an out-of-memory layout should not hide the others
            print(f"{name:12s} failed: {type(err).__name__}: {str(err).splitlines()[0][:300]}", flush=True)
            continue
        if name == "1gpu":
            base = per_gpu
        elif base:
            print(f"{'':12s} per-GPU throughput vs 1 GPU: {per_gpu / base:.2f}x", flush=True)


if __name__ == "__main__":
    main()
