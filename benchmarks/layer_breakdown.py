"""Where one compiled step's device time goes, by kernel and by kind of kernel (``bench_layer.py``).

Traces two calls with ``jax.profiler`` and sums the device events per kernel name
(``trace_summary.py``); the kinds are the repository's Pallas kernels by their names, the dense
matmuls (cuBLAS / XLA's GEMM fusions) and everything else XLA emits (the glue: elementwise,
reductions, copies, gathers). Device time per step below the step's wall time is launch gaps.
"""

from __future__ import annotations

import re

import jax

from trace_summary import load_events, summarise

# first match wins; patterns on the kernel name
KINDS = (
    ("moe grouped matmul (Pallas)", re.compile(r"^moe_")),
    ("kda kernels (Pallas)", re.compile(r"^kda_")),
    ("mla flash (Pallas)", re.compile(r"^mla_flash")),
    ("gated activations (Pallas)", re.compile(r"^gated_act")),
    ("dense matmul (cuBLAS / XLA gemm)", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|^dot|_dot", re.I)),
    ("XLA glue (fusions, copies, reductions)", re.compile(r".")),
)
STEPS = 2


def kernel_kind(name: str) -> str:
    return next(kind for kind, pattern in KINDS if pattern.search(name))


def breakdown(fn, args, directory: str, top: int = 25) -> dict:
    """Device ms per step of ``fn(*args)`` by kind and by kernel (the ``top`` largest), printed too."""
    jax.block_until_ready(fn(*args))
    with jax.profiler.trace(directory, create_perfetto_trace=True):
        for _ in range(STEPS):
            out = fn(*args)
        jax.block_until_ready(out)
    events, names = load_events(directory)
    process = "" if jax.default_backend() == "cpu" else "GPU"
    rows = [(n, ms / STEPS, c // STEPS) for n, ms, c in summarise(events, names, process)]
    kinds: dict[str, float] = {}
    for name, ms, _ in rows:
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + ms
    total = sum(ms for _, ms, _ in rows)
    print(f"device time per step: {total:.2f} ms over {len(rows)} kernels")
    for kind, ms in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"{ms:10.2f} ms {100 * ms / max(total, 1e-9):5.1f} %  {kind}")
    for name, ms, calls in rows[:top]:
        print(f"{ms:10.3f} ms {calls:5d}x  {name[:120]}")
    return {"device_ms_per_step": total, "by_kind": kinds,
            "by_kernel": [{"name": n[:200], "ms": ms, "calls": c} for n, ms, c in rows[:top]]}
