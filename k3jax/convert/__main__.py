"""``python -m k3jax.convert {hf-to-orbax, orbax-to-hf, inspect}``: real weights in and out of k3jax.

    python -m k3jax.convert hf-to-orbax SRC DST [--mesh expert=8] [--dtype bfloat16|float32]
                                                [--layout per-layer|scanned] [--overwrite]
    python -m k3jax.convert orbax-to-hf SRC DST [--dtype bfloat16] [--mxfp4 | --no-mxfp4] [--overwrite]
    python -m k3jax.convert inspect PATH

``hf-to-orbax`` streams: each process reads only the byte ranges of its own shards of each leaf
(``--mesh`` as ``axis=size`` over data, fsdp, expert, sequence, tensor; one size may be -1) and
writes them with orbax. Under several processes (``jax.distributed``; started from the usual
environment, see ``sharding.mesh.maybe_initialize_distributed``) run the same command in every
process. ``--layout per-layer`` (default) stores one ``layers_{i}`` subtree per layer; ``--layout
scanned`` stores the scanned stack's stacked leaves, which a scanned model restores as they are
(``k3jax.convert.orbax_layout``). Every reader (restore, ``inspect``, ``orbax-to-hf``, ``train
--init-from``, ``generate --checkpoint``) takes both.
Every user error is one ``error: ...`` line on stderr and exit status 2 (``--debug``: traceback).
"""

from __future__ import annotations

import argparse
import sys

from k3jax.convert.convert import totals
from k3jax.convert.orbax_layout import LAYOUTS

DTYPES = ("bfloat16", "float32")


def _mesh_sizes(text: str) -> dict[str, int]:
    from sharding.mesh import AXES

    sizes = {}
    for part in filter(None, text.split(",")):
        name, sep, value = part.partition("=")
        if not sep or name.strip() not in AXES:
            raise ValueError(f"--mesh {text!r}: each part must be axis=size with axis one of {AXES}")
        try:
            sizes[name.strip()] = int(value)
        except ValueError:
            raise ValueError(f"--mesh {text!r}: size {value!r} of {name!r} must be an integer") from None
    return sizes


def _bar(args, desc: str, tensors: int, nbytes: int):
    """A tqdm bar over bytes (MB/s, ETA) with a tensor counter; None without --progress or off rank 0."""
    import jax
    from tqdm import tqdm

    if args.no_progress or jax.process_index() != 0:
        return None
    bar = tqdm(total=nbytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr)
    done = [0]

    def update(n: int, size: int) -> None:
        done[0] += n
        bar.set_postfix_str(f"{done[0]}/{tensors} tensors", refresh=False)
        bar.update(size)

    update.close = bar.close
    return update


def _hf_to_orbax(args) -> int:
    import jax.numpy as jnp

    from k3jax.convert.convert import check_destination, hf_to_orbax
    from k3jax.convert.sharded_read import HFSource
    from sharding.mesh import make_mesh, maybe_initialize_distributed

    sizes = _mesh_sizes(args.mesh) if args.mesh else None
    maybe_initialize_distributed()
    check_destination(args.dst, args.overwrite)  # before reading anything
    source = HFSource(args.src)
    mesh = make_mesh(**sizes) if sizes is not None else None
    bar = _bar(args, "hf-to-orbax", *totals(source.multimodal or source.cfg, args.dtype))
    meta = hf_to_orbax(args.src, args.dst, mesh=mesh, dtype=jnp.dtype(args.dtype), overwrite=args.overwrite,
                       group_bytes=int(args.group_mb * 2**20), progress=bar, source=source, layout=args.layout)
    if bar is not None:
        bar.close()
    print(f"wrote {args.dst}: {meta['tensors']} tensors, {meta['bytes'] / 2**20:.1f} MiB ({meta['dtype']}, "
          f"{meta['layout']} layout)")
    return 0


def _orbax_to_hf(args) -> int:
    from k3jax.convert import orbax_ckpt as oc
    from k3jax.convert.convert import orbax_to_hf

    meta = oc.read_metadata(args.src)
    bar = _bar(args, "orbax-to-hf", *totals(oc.checkpoint_config(meta), meta["dtype"]))
    orbax_to_hf(args.src, args.dst, dtype=args.dtype, mxfp4=args.mxfp4, overwrite=args.overwrite,
                max_shard_bytes=int(args.shard_mb * 2**20), progress=bar)
    if bar is not None:
        bar.close()
    print(f"wrote {args.dst}")
    return 0


def _inspect(args) -> int:
    from k3jax.convert.inspect import format_report, inspect

    report = inspect(args.path)
    print(format_report(report))
    return 1 if report.problems else 0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m k3jax.convert", description=__doc__.splitlines()[0])
    p.add_argument("--debug", action="store_true", help="show tracebacks instead of one error line")
    sub = p.add_subparsers(dest="command", required=True)
    h = sub.add_parser("hf-to-orbax", help="Hugging Face folder -> k3jax orbax checkpoint (streaming, sharded)")
    h.add_argument("src")
    h.add_argument("dst")
    h.add_argument("--mesh", default=None, help="e.g. data=2,expert=4 (default: one device; one process only)")
    h.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="stored parameter dtype (fp32 leaves stay fp32)")
    h.add_argument("--layout", choices=LAYOUTS, default="per-layer",
                   help="per-layer: layers_{i} subtrees; scanned: the scanned stack's stacked leaves")
    h.add_argument("--group-mb", type=float, default=512.0, help="MiB of leaves per orbax write (memory bound)")
    o = sub.add_parser("orbax-to-hf", help="k3jax orbax checkpoint -> Hugging Face folder (MXFP4 experts for K3)")
    o.add_argument("src")
    o.add_argument("dst")
    o.add_argument("--dtype", choices=DTYPES, default=None, help="HF dtype (default: the source checkpoint's)")
    o.add_argument("--mxfp4", action=argparse.BooleanOptionalAction, default=None,
                   help="K3 routed experts as MXFP4 (default: as the source checkpoint stored them)")
    o.add_argument("--shard-mb", type=float, default=5120.0, help="MiB per safetensors file")
    for command in (h, o):
        command.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
        command.add_argument("--no-progress", action="store_true", help="no progress bar")
    i = sub.add_parser("inspect", help="config, parameters, dtypes, bytes and key problems of either format")
    i.add_argument("path")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    run = {"hf-to-orbax": _hf_to_orbax, "orbax-to-hf": _orbax_to_hf, "inspect": _inspect}[args.command]
    try:
        return run(args)
    except ValueError as err:
        if args.debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
