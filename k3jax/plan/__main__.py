"""``python -m k3jax.plan``: compile a step of a preset for a topology you do not own, from a CPU host.

    python -m k3jax.plan --preset kimi_k3 --topology v5p:16x16x1 \\
        --mesh data=2,fsdp=8,expert=16 --step train --batch 256 --seq 8192

prints the per-device memory the compiler allocates, its FLOPs, the predicted step time at the
chip's peak, the bytes each mesh axis moves, and whether the program fits in HBM. ``--layers N``
keeps the real widths with N layers (the first N of the preset's pattern) for quick looks;
``--json PATH`` appends the plan as one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import jax.numpy as jnp


def parse_mesh(text: str, num_devices: int, topology: str) -> tuple[tuple[str, int], ...]:
    """``"data=2,expert=4"`` (one size may be -1: the rest) → axes; ValueError naming the axis."""
    from sharding import AXES

    axes: dict[str, int] = {}
    for item in filter(None, text.split(",")):
        name, _, size = item.partition("=")
        if name not in AXES:
            raise ValueError(f"--mesh axis {name!r} is not a mesh axis; axes are {', '.join(AXES)}")
        try:
            axes[name] = int(size)
        except ValueError:
            raise ValueError(f"--mesh {name}={size!r}: the size must be an integer (or -1: the rest)") from None
        if axes[name] == 0 or axes[name] < -1:
            raise ValueError(f"--mesh {name}={axes[name]}: sizes must be positive, or -1 for the rest")
    rest = [n for n, s in axes.items() if s == -1]
    if len(rest) > 1:
        raise ValueError(f"--mesh: only one axis may be -1, got {', '.join(rest)}")
    fixed = math.prod(s for s in axes.values() if s != -1)
    shown = " × ".join(f"{n}={s}" for n, s in axes.items() if s != -1) or "1"
    if rest:
        if num_devices % fixed:
            raise ValueError(f"--mesh {rest[0]}=-1: {shown} = {fixed} does not divide the {num_devices} "
                             f"devices of {topology}")
        axes[rest[0]] = num_devices // fixed
    elif fixed != num_devices:
        biggest = max(axes, key=axes.get) if axes else "data"
        raise ValueError(f"--mesh {shown} = {fixed} devices, but {topology} has {num_devices}: the axis sizes "
                         f"must multiply to {num_devices} (e.g. {biggest}=-1 takes the rest)")
    return tuple(axes.items())


def build_config(args):
    from k3jax.config import first_layers, preset

    cfg = preset(args.preset)
    changes = {}
    if args.layers:
        if not 1 <= args.layers <= cfg.num_layers:
            raise ValueError(f"--layers={args.layers} must lie in [1, {cfg.num_layers}] for {args.preset}")
        cfg = first_layers(cfg, args.layers)
    if args.param_dtype:
        changes["param_dtype"] = jnp.dtype(args.param_dtype)
    cfg = dataclasses.replace(cfg, **changes)
    impl = None if args.kernels == "auto" else args.kernels
    kernels = {"kda": dataclasses.replace(cfg.kda, implementation=impl)} if cfg.kda else {}
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, implementation=impl), **kernels)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3jax.plan", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="kimi_k3")
    ap.add_argument("--topology", required=True, help="v5p:16x16x1, v5e:16x16, v6e:16x16, tpu7x:4x4x4, h200:32x8, …")
    ap.add_argument("--mesh", default="data=-1", help="data=…,fsdp=…,expert=…,sequence=…,tensor=… (one may be -1)")
    ap.add_argument("--step", choices=("train", "prefill", "decode", "forward"), default="train",
                    help="forward: the training model's forward over whole rows (context parallel with a "
                         "sequence axis) and the last token's logits: a long prompt's prefill without its cache")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default: one per device)")
    ap.add_argument("--seq", type=int, default=8192, help="tokens per sequence (decode: the cache length)")
    ap.add_argument("--micro", type=int, default=1, help="train: micro-batches per step")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill: tokens per chunk")
    ap.add_argument("--remat", choices=("none", "layer", "moe"), default="layer")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers (real widths)")
    ap.add_argument("--param-dtype", default=None, help="e.g. bfloat16 for serving (default: the preset's fp32)")
    ap.add_argument("--experts", choices=("param", "mxfp4"), default="param",
                    help="prefill / decode: the routed experts in --param-dtype (param) or as MXFP4, the "
                         "release's 4.25 bits a weight, decoded per layer in the program (mxfp4)")
    ap.add_argument("--kernels", choices=("auto", "pallas", "xla"), default="auto",
                    help="KDA scan and grouped matmul: the target's Pallas kernels where they support the "
                         "shapes (auto), always (pallas), or the XLA paths")
    ap.add_argument("--json", default=None, help="append the plan as one JSON line to this file")
    ap.add_argument("--hlo", default=None, help="write the compiled program's HLO text to this file")
    ap.add_argument("--memory-only", action="store_true",
                    help="stop after the compiler's buffer assignment: per-device memory (and its largest "
                         "temporaries) and communication in minutes, without code generation or FLOPs")
    ap.add_argument("--verbose", action="store_true", help="after an out-of-memory message, the compiler's own "
                                                           "(its largest allocations)")
    args = ap.parse_args(argv)
    from k3jax.plan.topology import not_cached

    try:
        with not_cached():  # with a jax cache on, a topology's programs would be written but never load
            plan = run(args)
    except ValueError as err:
        print(f"k3jax.plan: {err}", file=sys.stderr)
        if args.verbose and err.__cause__ is not None:
            print(str(err.__cause__), file=sys.stderr)
        return 2
    from k3jax.plan.report import format_plan

    print(format_plan(plan))
    if args.json:
        row = dataclasses.asdict(plan) | {"peak_memory": plan.peak_memory, "fits": plan.fits,
                                          "compute_seconds": plan.compute_seconds, "comm_seconds": plan.comm_seconds,
                                          "hbm_seconds": plan.hbm_seconds,
                                          "command": "python -m k3jax.plan " + " ".join(argv or sys.argv[1:])}
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")
    code = 0 if plan.fits else 1
    if args.memory_only:  # the compile thread is still generating code: leave it
        sys.stdout.flush()
        os._exit(code)
    return code


def run(args):
    from k3jax.plan.programs import Shape, lower
    from k3jax.plan.report import buffers_plan, compile_plan, model_flops
    from k3jax.plan.topology import get_topology
    from pallas_kernels.target import compile_for

    topo = get_topology(args.topology)
    if topo.needs_buffer_readout and not args.memory_only:
        print(f"{args.topology}: several hosts, so memory comes from the buffer assignment (--memory-only; "
              "jax's memory_analysis() counts a multi-host GPU program's arguments unsharded)", flush=True)
        args.memory_only = True
    axes = parse_mesh(args.mesh, len(topo.devices), args.topology)
    cfg = build_config(args)
    shape = Shape(batch=args.batch or len(topo.devices), seq=args.seq, micro=args.micro, chunk=args.chunk,
                  remat=args.remat)
    t0 = time.perf_counter()
    lowered, mesh = lower(args.step, cfg, axes, topo.devices, shape, experts=args.experts)
    print(f"traced and lowered in {time.perf_counter() - t0:.0f} s; compiling for {args.topology} …", flush=True)
    with compile_for(topo.devices[0]):  # counting parameters traces the model's init
        flops = model_flops(cfg, args.step, shape.batch, shape.seq)
    if args.memory_only:
        return buffers_plan(lowered, args.step, args.topology, mesh, topo.chip, flops)
    return compile_plan(lowered, args.step, args.topology, mesh, topo.chip, flops, hlo_path=args.hlo)


if __name__ == "__main__":
    sys.exit(main())
