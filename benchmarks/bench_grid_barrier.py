"""What a grid barrier costs against a kernel boundary: a chain of dependent matvecs, one kernel each or all
in one kernel whose programs wait at ``pallas_kernels.grid_sync.grid_barrier`` between them.

Layer ``l`` computes ``x_{l+1} = W_l x_l`` (``[D, D]`` bf16, ``--rows`` output rows a program, so
``D / rows`` programs, at most one an SM): the shape of a batch-1 decode projection (D = 1024: 2 MB a
layer, ``small()``'s ``o_proj``), each layer's input written by every program of the one before. Three
ways, each ``--layers`` layers inside a ``fori_loop`` of ``--loops`` trips compiled with the decode
step's XLA options (command buffers, as ``bench_infer.py`` runs the step):

- ``chain``: one Pallas-Triton kernel a layer (what the decode step does today);
- ``barrier``: one kernel, the layers as phases, a grid barrier between them;
- ``prefetch``: the same, each program reading its next layer's rows before it waits.

Prints µs a layer, the barrier's gain over the chain, and checks the three outputs agree bit for bit
(same products, same order). A GPU benchmark: ``--interpret`` runs one program (``--rows`` = D) in the
CPU interpreter.

    PYTHONPATH=$PWD python3 benchmarks/bench_grid_barrier.py --rows 8 16 32 --out $OUT/grid_barrier.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.timing import timeit_interleaved  # noqa: E402
from k3jax.infer.decode import DECODE_XLA_OPTIONS  # noqa: E402
from pallas_kernels.grid_sync import grid_barrier  # noqa: E402

F32 = jnp.float32


def _product(w, x) -> jax.Array:
    return jnp.sum(w.astype(F32) * x.astype(F32)[None, :], axis=1).astype(jnp.bfloat16)


def _layer_kernel(x_ref, w_ref, o_ref, *, layer: int, rows: int, d: int):
    j = pl.program_id(0)
    o_ref[pl.ds(j * rows, rows)] = _product(w_ref[pl.ds(layer * d + j * rows, rows), :], x_ref[...])


def _phases_kernel(x_ref, w_ref, sync_in, act_ref, sync_ref, *, layers: int, rows: int, d: int, prefetch: bool,
                   interpret: bool):
    del sync_in  # aliased to sync_ref
    j = pl.program_id(0)
    tile = lambda l: w_ref[pl.ds(l * d + j * rows, rows), :]
    x, w = x_ref[...], tile(0)
    for l in range(layers):
        w = w if prefetch or l == 0 else tile(l)
        act_ref[l % 2, pl.ds(j * rows, rows)] = _product(w, x)
        if l + 1 < layers:
            w = tile(l + 1) if prefetch else w
            grid_barrier(sync_ref, l, d // rows, interpret)
            x = act_ref[l % 2, :]


def chain(x, w, *, layers: int, rows: int, interpret: bool = False):
    d = x.shape[0]
    for l in range(layers):
        x = pl.pallas_call(functools.partial(_layer_kernel, layer=l, rows=rows, d=d), grid=(d // rows,),
                           out_shape=jax.ShapeDtypeStruct((d,), x.dtype), interpret=interpret,
                           compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1), name="chain_layer")(x, w)
    return x


def phases(x, w, *, layers: int, rows: int, prefetch: bool, interpret: bool = False):
    d = x.shape[0]
    act, _ = pl.pallas_call(
        functools.partial(_phases_kernel, layers=layers, rows=rows, d=d, prefetch=prefetch, interpret=interpret),
        grid=(d // rows,),
        out_shape=[jax.ShapeDtypeStruct((2, d), x.dtype), jax.ShapeDtypeStruct((layers,), jnp.int32)],
        input_output_aliases={2: 1}, interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1), name="phases",
    )(x, w, jnp.zeros((layers,), jnp.int32))
    return act[(layers - 1) % 2]


def looped(fn, loops: int):
    """``loops`` trips of ``fn`` (its output the next input), as one jitted program with the decode options."""
    return jax.jit(lambda x, w: jax.lax.fori_loop(0, loops, lambda _, v: fn(v, w), x),
                   compiler_options=DECODE_XLA_OPTIONS)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--loops", type=int, default=8)
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (args.d,), F32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (args.layers * args.d, args.d), F32) / args.d ** 0.5).astype(jnp.bfloat16)
    results = {"device": str(jax.devices()[0].device_kind), "d": args.d, "layers": args.layers, "loops": args.loops}
    for rows in ([args.d] if args.interpret else args.rows):
        kw = dict(layers=args.layers, rows=rows, interpret=args.interpret)
        fns = {"chain": looped(functools.partial(chain, **kw), args.loops),
               "barrier": looped(functools.partial(phases, prefetch=False, **kw), args.loops),
               "prefetch": looped(functools.partial(phases, prefetch=True, **kw), args.loops)}
        outs = {name: jax.block_until_ready(fn(x, w)) for name, fn in fns.items()}
        agree = all(bool(jnp.array_equal(outs["chain"], o)) for o in outs.values())
        row = {"programs": args.d // rows, "agree": agree}
        if not args.interpret:
            ms = timeit_interleaved({name: (fn, (x, w)) for name, fn in fns.items()})
            per_layer = {name: 1e3 * t / (args.loops * args.layers) for name, t in ms.items()}
            row |= {f"{name}_us_per_layer": round(v, 3) for name, v in per_layer.items()}
            row["gain_us_per_layer"] = round(per_layer["chain"] - min(per_layer["barrier"], per_layer["prefetch"]), 3)
        results[f"rows{rows}"] = row
        print(json.dumps({f"rows{rows}": row}), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
