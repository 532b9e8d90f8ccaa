"""Registers, spills and memory instructions of GPU kernels, with no GPU.

Compiles for a device-less H200 with XLA dumping the PTX of every kernel it emits — ``--op gather`` /
``dense``: the MoE decode kernels alone at ``small()``'s experts, given the ids (``gather_routed`` /
``dense_routed``: routing each token themselves, as the decode step runs them; ``--tokens``, ``--tiles
KEY=VALUE,…`` of their ``DecodeTiles`` / ``DenseTiles``; seconds), ``--op step``: the whole decode
step ``decode_kernels.py`` compiles (minutes: XLA then dumps every emitter) — then assembles each PTX
file with ``ptxas -v`` for ``sm_90a`` and prints, per kernel entry: registers a thread, spill stores /
loads and stack bytes (ptxas), and from the PTX the global loads, asynchronous copies (``cp.async``),
Hopper tensor-core instructions (``wgmma``), barriers and the global loads issued before the first
barrier (reads in flight together) — e.g. that a variant fits its registers
without spilling, or that the dense kernels pipeline their loads into ``wgmma``. Static counts, not
timings. Needs ``ptxas`` (CUDA toolkit) on PATH and the jax CUDA plugin:

    PYTHONPATH=$PWD:/path/to/cuda/plugin JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 \\
        python3 benchmarks/kernel_resources.py --op gather --tiles prefetch=False
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ENTRY = re.compile(r"^\.visible \.entry (\w+)\(", re.M)
PROPERTIES = re.compile(r"Function properties for (\w+)\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
                        r"(\d+) bytes spill loads")
REGISTERS = re.compile(r"Compiling entry function '(\w+)'.*?Used (\d+) registers", re.S)
COUNTED = {"ld.global": r"\bld\.global", "cp.async": r"\bcp\.async\b", "wgmma": r"\bwgmma\.mma_async",
           "bar.sync": r"\bbar\.sync"}
COLUMNS = (*COUNTED, "ld<bar")


def entries(ptx: str) -> dict[str, str]:
    """``{entry name: its PTX body}`` of one PTX file."""
    starts = [(m.group(1), m.start()) for m in ENTRY.finditer(ptx)]
    return {name: ptx[a:(starts[i + 1][1] if i + 1 < len(starts) else len(ptx))]
            for i, (name, a) in enumerate(starts)}


def assemble(path: Path, ptxas: str) -> dict[str, dict]:
    """``ptxas -v`` of one PTX file: ``{entry: {registers, stack, spill_stores, spill_loads}}``."""
    log = subprocess.run([ptxas, "--gpu-name", "sm_90a", "-v", str(path), "-o", os.devnull],
                         capture_output=True, text=True, check=True).stderr
    out = {name: {"registers": int(n)} for name, n in REGISTERS.findall(log)}
    for name, stack, stores, loads in PROPERTIES.findall(log):
        out.setdefault(name, {}).update(stack=int(stack), spill_stores=int(stores), spill_loads=int(loads))
    return out


def resources(dump: Path, ptxas: str) -> dict[str, dict]:
    """Every kernel entry of the PTX files under ``dump``: ptxas's numbers and the instruction counts."""
    table = {}
    for path in sorted(dump.glob("*.ptx")):
        assembled = assemble(path, ptxas)
        for name, body in entries(path.read_text()).items():
            row = dict(assembled.get(name, {}))
            row.update({k: len(re.findall(p, body)) for k, p in COUNTED.items()})
            # loads in flight together before the first barrier (a reduction's): the global reads
            # that do not wait for one another
            row["ld<bar"] = len(re.findall(COUNTED["ld.global"], body.split("bar.sync")[0]))
            table[name] = row
    return table


def compile_op(op: str, tokens: int | None, tiles: str) -> None:
    """Compile ``op`` (``gather`` / ``dense``: the MoE decode kernels at ``small()``'s experts, given the
    ids; ``gather_routed`` / ``dense_routed``: routing each token themselves, as the decode step calls
    them) for a device-less H200."""
    import functools

    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from k3jax.plan.topology import get_topology
    from pallas_kernels.moe.kernel_gpu_decode import DecodeTiles, gathered_experts_pallas, routed_experts_pallas
    from pallas_kernels.moe.kernel_gpu_decode_dense import DenseTiles, dense_experts_pallas, routed_dense_experts_pallas
    from pallas_kernels.moe.rank_routing import Routing
    from pallas_kernels.target import compile_for

    fn, tile_type = {"gather": (gathered_experts_pallas, DecodeTiles), "dense": (dense_experts_pallas, DenseTiles),
                     "gather_routed": (routed_experts_pallas, DecodeTiles),
                     "dense_routed": (routed_dense_experts_pallas, DenseTiles)}[op]
    values = dict(kv.split("=") for kv in tiles.split(",") if kv)
    fields = {f.name: f.type for f in dataclasses.fields(tile_type)}
    unknown = set(values) - set(fields)
    if unknown:
        raise SystemExit(f"kernel_resources: --tiles keys {sorted(unknown)} are not fields of {tile_type.__name__} "
                         f"({sorted(fields)})")
    parsed = {k: v == "True" if fields[k] in ("bool", bool) else int(v) for k, v in values.items()}
    from bench_moe_decode import E, F, K as k, L  # small()'s routed experts, as the benchmark times them

    T = tokens or (64 if op.startswith("dense") else 1)
    routed = op.endswith("_routed")
    device = get_topology("h200:1x1").devices[0]
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(device))
    bf = jnp.bfloat16
    route = (spec((T, E), jnp.float32), spec((E,), jnp.float32)) if routed else (
        spec((T, k), jnp.int32), spec((T, k), jnp.float32))
    args = (spec((T, L), bf), *route, spec((E, L, F), bf), spec((E, L, F), bf), spec((E, F, L), bf))
    kwargs = dict(activation="situ", **({"tiles": tile_type(**parsed)} if parsed else {}),  # else the default
                  **({"routing": Routing(k)} if routed else {}))
    with compile_for(device), jax.default_device(device):
        jax.jit(functools.partial(fn, **kwargs)).lower(*args).compile()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--op", choices=("gather", "gather_routed", "dense", "dense_routed", "step"), default="gather")
    p.add_argument("--tokens", type=int, default=None, help="gather / dense ops: default 1 / 64")
    p.add_argument("--tiles", default="", help="gather / dense ops: KEY=VALUE,… of DecodeTiles / DenseTiles")
    p.add_argument("--batch", type=int, default=1, help="step: the decode batch")
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--match", default="", help="only the kernels whose entry name matches this regex")
    p.add_argument("--ptxas", default=shutil.which("ptxas"), help="the ptxas to assemble with (default: on PATH)")
    args = p.parse_args(argv)
    if not args.ptxas:
        raise SystemExit("kernel_resources: no ptxas on PATH (the CUDA toolkit's); pass --ptxas PATH")
    with tempfile.TemporaryDirectory(prefix="k3jax_ptx_") as dump:
        # before jax reads XLA_FLAGS; XLA 0.11 writes the PTX files only with an emitter regex
        flags = f"--xla_dump_to={dump} --xla_gpu_dump_llvmir --xla_dump_emitter_re=.*"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
        sys.path.insert(0, str(Path(__file__).parent))
        if args.op == "step":
            from decode_kernels import compile_decode

            compile_decode(args.batch, args.prompt, args.steps)
        else:
            compile_op(args.op, args.tokens, args.tiles)
        table = resources(Path(dump), args.ptxas)
    names = [n for n in table if re.search(args.match, n)]
    print(f"{'kernel':44s} {'regs':>5s} {'stack':>6s} {'spill st/ld':>12s} "
          + " ".join(f"{k:>9s}" for k in COLUMNS))
    for n in sorted(names):
        r = table[n]
        spills = f"{r.get('spill_stores', '?')}/{r.get('spill_loads', '?')}"
        print(f"{n[:44]:44s} {r.get('registers', '?'):>5} {r.get('stack', '?'):>6} {spills:>12s} "
              + " ".join(f"{r[k]:>9d}" for k in COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
