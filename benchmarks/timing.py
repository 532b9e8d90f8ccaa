"""Timing helpers of the GPU benchmarks: a median over bursts of back-to-back calls, and the same
round-robin over several calls (``timeit_interleaved``), so clock drift under the H200's power cap
falls on every call alike."""

import statistics
import time

import jax


def timeit(fn, *args, reps=20, warmup=2, min_ms=20.0):
    """Median time (ms) of one ``fn(*args)``: each of ``reps`` samples times a burst of
    back-to-back calls (sized to last about ``min_ms``) so host dispatch overlaps device work."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    burst = max(1, int(min_ms / max((time.perf_counter() - t0) * 1e3, 1e-3)))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(burst)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - t0) * 1e3 / burst)
    return statistics.median(times)


def timeit_interleaved(calls: dict, reps=20, warmup=2, min_ms=20.0) -> dict:
    """Median ms of each ``name -> (fn, args)``, timed as ``timeit`` but round-robin: every rep
    times one burst of each call in turn (the order rotating), so the GPU's power- and
    clock-state drift (clocks swing 1.1-2.0 GHz under the 700 W cap) hits every call alike.

    Burst sizes come from a single call of each, timed after every call's warmup: a call sized
    while the GPU was still idle and fast gets a longer burst, which then runs longer at the capped
    clocks and reads slower (RESULTS.md, MoE run 15: six identical kernels listed first read
    0.425-0.503 ms in the order they were sized)."""
    for _ in range(warmup):
        for fn, args in calls.values():
            jax.block_until_ready(fn(*args))
    bursts = {}
    for name, (fn, args) in calls.items():
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        bursts[name] = max(1, int(min_ms / max((time.perf_counter() - t0) * 1e3, 1e-3)))
    times = {name: [] for name in calls}
    names = list(calls)
    for r in range(reps):
        for name in names[r % len(names):] + names[: r % len(names)]:
            fn, args = calls[name]
            t0 = time.perf_counter()
            jax.block_until_ready([fn(*args) for _ in range(bursts[name])])
            times[name].append((time.perf_counter() - t0) * 1e3 / bursts[name])
    return {name: statistics.median(t) for name, t in times.items()}
