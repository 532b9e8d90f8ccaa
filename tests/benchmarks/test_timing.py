"""``benchmarks.timing.timeit_interleaved``: round-robin bursts, sized after every call's warmup."""

import time

from benchmarks.timing import timeit_interleaved


class Gpu:
    """Calls take ``fast_s`` for the first ``fast_calls`` calls in all and ``slow_s`` after (an
    idle GPU's clocks, then the capped ones); counts each caller's calls."""

    def __init__(self, fast_calls=3, fast_s=0.0005, slow_s=0.004):
        self.total, self.fast_calls, self.fast_s, self.slow_s = 0, fast_calls, fast_s, slow_s
        self.calls = {}

    def call(self, name):
        def fn():
            time.sleep(self.fast_s if self.total < self.fast_calls else self.slow_s)
            self.total += 1
            self.calls[name] = self.calls.get(name, 0) + 1
            return self.total

        return fn


def test_bursts_are_sized_after_every_warmup():
    """Sized right after its own warmup, "x" would be timed while still fast (its 3rd call) and get
    a 40-call burst; sized after both warmups it gets ~5 calls (20 ms at 4 ms)."""
    gpu = Gpu()
    ms = timeit_interleaved({"x": (gpu.call("x"), ()), "y": (gpu.call("y"), ())}, reps=2, warmup=2, min_ms=20.0)
    assert set(ms) == {"x", "y"}
    for name in ("x", "y"):
        bursts = gpu.calls[name] - 2 - 1  # warmup, sizing
        assert bursts <= 2 * 6, (name, gpu.calls)
        assert 3.0 < ms[name] < 12.0, ms
