"""Peak host memory of ``python -m k3jax.convert`` on a synthetic multi-GB K3-shaped checkpoint.

Claim checked: conversion streams, so its peak RSS stays within a small multiple of the largest
single tensor, whatever the checkpoint's size. The checkpoint is K3 in every structural respect
(KDA + gated MLA, AttnRes, LatentMoE with MXFP4 experts, the release's key names and dtypes) but
wide and shallow, written with ``save_hf`` from leaves generated one at a time (never held
together), and deleted afterwards. Each conversion runs in a fresh process that reports its own
``ru_maxrss``; a process that only imports the converter gives the baseline.

    PYTHONPATH=. python benchmarks/convert_memory.py --dir /tmp/k3jax_convert_memory [--group-mb 64] [--out result.json]

(``--small`` builds a ~40 MB checkpoint, to try the script quickly.) Prints checkpoint size, the
largest HF tensor, the largest tree leaf, and per direction the peak RSS, wall time and MB/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from k3jax import config as C
from k3jax.convert import save_hf
from k3jax.convert.hf_keys import entries
from k3jax.convert.safetensors_io import SafetensorsReader

# The child's own high-water mark: /proc/self/status VmHWM belongs to the process's memory map, while
# getrusage's ru_maxrss survives fork + exec and would report the parent's RSS at the fork.
_PEAK = ("import runpy, sys\n"
         "try:\n    runpy.run_module('k3jax.convert', run_name='__main__')\n"
         "except SystemExit as e:\n    assert not e.code, e.code\n"
         "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]\n"
         "print('PEAK_KB', hwm.split()[1])")


# What every conversion process holds before its first tensor: JAX's CPU client, orbax, the model code.
_BASELINE = ("import jax, orbax.checkpoint.experimental.v1, k3jax.convert.convert, k3jax.convert.inspect, k3jax.model\n"
             "jax.devices()\n"
             "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]\n"
             "print('PEAK_KB', hwm.split()[1])")


def wide_shallow(small: bool) -> C.ModelConfig:
    """K3's structure at 2 layers (KDA + dense MLP, then MLA + LatentMoE), wide where K3 is wide."""
    k = C.kimi_k3()
    D, V, E, L, F = (512, 8192, 16, 256, 256) if small else (4096, 65536, 64, 1024, 1024)
    return dataclasses.replace(
        k, name="k3_wide_shallow", vocab_size=V, hidden=D, num_layers=2, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
        kda=dataclasses.replace(k.kda, num_heads=D // 128),
        mla=dataclasses.replace(k.mla, num_heads=D // 128, q_lora_rank=D // 4),
        mlp=dataclasses.replace(k.mlp, dense_intermediate=D * 11 // 4),
        moe=dataclasses.replace(k.moe, num_experts=E, top_k=4, expert_intermediate=F, shared_intermediate=F,
                                latent_dim=L),
        attn_res=dataclasses.replace(k.attn_res, block_size=2))


class _Generated:
    """A leaf made when ``save_hf`` asks for it (``__array__``), so the writer holds one at a time."""

    def __init__(self, shape, seed: int):
        self.shape, self.dtype, self.seed = tuple(shape), np.dtype(np.float32), seed

    def __array__(self, dtype=None, copy=None):
        rng = np.random.default_rng(self.seed)
        value = (0.02 * rng.standard_normal(self.shape, dtype=np.float32)).astype(ml_dtypes.bfloat16)
        return value.astype(dtype or np.float32)


def write_checkpoint(cfg: C.ModelConfig, path: Path) -> None:
    tree: dict = {"params": {}, "balance": {}}
    for i, e in enumerate(entries(cfg)):
        node = tree[e.collection]
        for name in e.path[:-1]:
            node = node.setdefault(name, {})
        node[e.path[-1]] = _Generated(e.shape, i)
    save_hf(cfg, tree, str(path), dtype=ml_dtypes.bfloat16, mxfp4=True, max_shard_bytes=1 << 30)


def _run(args: list[str], code: str = _PEAK) -> tuple[int, float]:
    """Peak RSS (bytes) and wall seconds of ``python -m k3jax.convert *args`` in a fresh process."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    seconds = time.perf_counter() - start
    peak = [l for l in proc.stdout.splitlines() if l.startswith("PEAK_KB")]
    if proc.returncode or not peak:
        raise RuntimeError(f"convert {args} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return int(peak[-1].split()[1]) * 1024, seconds


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="scratch folder (created, deleted at the end)")
    ap.add_argument("--small", action="store_true", help="a ~40 MB checkpoint, to try the script")
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    ap.add_argument("--group-mb", type=float, default=None, help="hf-to-orbax --group-mb (default: its own)")
    args = ap.parse_args()
    root = Path(args.dir)
    if root.exists():
        raise SystemExit(f"error: --dir {root} exists; give a fresh folder")
    cfg = wide_shallow(args.small)
    try:
        write_checkpoint(cfg, root / "hf")
        infos = SafetensorsReader(str(root / "hf")).infos
        baseline, _ = _run([], _BASELINE)
        group = [] if args.group_mb is None else ["--group-mb", str(args.group_mb)]
        to_orbax, t1 = _run(["hf-to-orbax", str(root / "hf"), str(root / "orbax"), "--no-progress", *group])
        to_hf, t2 = _run(["orbax-to-hf", str(root / "orbax"), str(root / "back"), "--no-progress"])
        hf_bytes, orbax_bytes = _size(root / "hf"), _size(root / "orbax")
        result = {
            "checkpoint_bytes": hf_bytes, "orbax_bytes": orbax_bytes, "tensors": len(infos),
            "largest_hf_tensor_bytes": max(i.end - i.begin for i in infos.values()),
            "largest_leaf_bytes": max(int(np.prod(e.shape)) * (4 if e.wide else 2) for e in entries(cfg)),
            "baseline_rss_bytes": baseline,
            "hf_to_orbax": {"peak_rss_bytes": to_orbax, "seconds": t1, "MB_per_s": hf_bytes / t1 / 1e6},
            "orbax_to_hf": {"peak_rss_bytes": to_hf, "seconds": t2, "MB_per_s": orbax_bytes / t2 / 1e6},
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mib = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
    print(f"checkpoint {mib(result['checkpoint_bytes'])} ({result['tensors']} tensors, MXFP4 experts), "
          f"orbax {mib(result['orbax_bytes'])}; largest HF tensor {mib(result['largest_hf_tensor_bytes'])}, "
          f"largest tree leaf {mib(result['largest_leaf_bytes'])}; baseline RSS {mib(baseline)}")
    for name in ("hf_to_orbax", "orbax_to_hf"):
        r = result[name]
        above = r["peak_rss_bytes"] - baseline
        print(f"{name}: peak RSS {mib(r['peak_rss_bytes'])}, {mib(above)} above the baseline "
              f"({above / result['largest_leaf_bytes']:.1f}x the largest leaf), "
              f"{r['seconds']:.1f} s, {r['MB_per_s']:.0f} MB/s")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
