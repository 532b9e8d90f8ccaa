"""One warm forward and one warm forward+backward of a KDA implementation, inside a profiler region.

For Nsight Compute: the calls are compiled (and autotuned) first, then run once each between
``cuProfilerStart`` and ``cuProfilerStop``, so ``ncu --profile-from-start off`` sees only the
kernels of the op itself, not compilation, input generation or warm-up. On the H200:

``ncu --profile-from-start off --clock-control none -k regex:kda --set full
python3 benchmarks/ncu_kda.py --impl ours --shape 4,8192,32,128``
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_kda  # noqa: E402  (benchmarks/ is the script's directory)


@contextlib.contextmanager
def profiler_region():
    """``cuProfilerStart`` / ``cuProfilerStop`` of the CUDA driver around the block, in device 0's
    primary context (the one XLA runs in), made current on this thread."""
    cuda = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    for name, status in (("cuInit", cuda.cuInit(0)), ("cuDevicePrimaryCtxRetain", cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)),
                         ("cuCtxSetCurrent", cuda.cuCtxSetCurrent(ctx)), ("cuProfilerStart", cuda.cuProfilerStart())):
        if status != 0:
            raise RuntimeError(f"{name} returned CUDA error {status}")
    try:
        yield
    finally:
        cuda.cuProfilerStop()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--impl", default="ours", help="a factory name of bench_kda (ours, ours-fused, jla, fla)")
    parser.add_argument("--shape", default="4,8192,32,128", help="B,T,H,D")
    parser.add_argument("--skip-bwd", action="store_true", help="profile the forward only")
    args = parser.parse_args()
    factories = {"ours": bench_kda.ours, "ours-fused": bench_kda.ours_fused, "jla": bench_kda.jla, "fla": bench_kda.fla}
    if args.impl not in factories:
        parser.error(f"--impl must be one of {sorted(factories)}, got {args.impl!r}")
    fwd, fwdbwd, conv, sync = factories[args.impl]()
    shape = tuple(int(x) for x in args.shape.split(","))
    if len(shape) != 4:
        parser.error(f"--shape must be B,T,H,D, got {args.shape!r}")
    inputs, do = bench_kda.make_inputs(0, *shape)
    grad = args.impl == "fla"
    inputs = tuple(conv(x, grad=grad) for x in inputs)
    do = conv(do)
    calls = [lambda: fwd(*inputs)] + ([] if args.skip_bwd else [lambda: fwdbwd(*inputs, do)])
    for call in calls:  # compile / autotune outside the region
        sync(call())
    with profiler_region():
        for call in calls:
            sync(call())
    print("profiled", args.impl, shape, "fwd" if args.skip_bwd else "fwd, fwd+bwd")


if __name__ == "__main__":
    main()
