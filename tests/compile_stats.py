"""Opt-in pytest plugin: where a cold run's time goes. ``pytest -p tests.compile_stats -n 0 …`` prints,
after the run, the tests that took the most CPU (their own and their subprocesses': the 8-device
workers, the notebook's kernel) with their XLA compile time and count, and the persistent cache's
writes. Time a cold run with ``K3JAX_TEST_JAX_CACHE=$(mktemp -d)``. Under xdist (``-n 2``) the
numbers stay in the workers, so run it with ``-n 0``."""

import collections
import resource
import time

import pytest

TOP = 40
_totals: collections.Counter = collections.Counter()
_per_test: dict[str, tuple[float, float, int]] = {}


def _cpu_seconds() -> float:
    """User + system time of this process and of the subprocesses it waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _on_duration(event: str, seconds: float, **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":  # a cache hit is counted here too
        _totals["compile_s"] += seconds
        _totals["compiles"] += 1
        _totals["compiles_under_1s"] += seconds < 1.0


def pytest_sessionstart(session):
    from jax._src import compilation_cache, monitoring

    monitoring.register_event_duration_secs_listener(_on_duration)
    put = compilation_cache.put_executable_and_time

    def timed_put(*args, **kwargs):
        start = time.perf_counter()
        try:
            return put(*args, **kwargs)
        finally:
            _totals["cache_write_s"] += time.perf_counter() - start
            _totals["cache_writes"] += 1

    compilation_cache.put_executable_and_time = timed_put


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, compile_s, compiles = _cpu_seconds(), _totals["compile_s"], _totals["compiles"]
    try:
        return (yield)
    finally:
        _per_test[item.nodeid] = (_cpu_seconds() - cpu, _totals["compile_s"] - compile_s,
                                  _totals["compiles"] - compiles)


def pytest_terminal_summary(terminalreporter):
    write = terminalreporter.write_line
    write(f"compile stats: {', '.join(f'{k} {v:.1f}' for k, v in sorted(_totals.items()))}")
    write(f"{'cpu s':>8} {'compile s':>10} {'compiles':>9}  test (setup + call + teardown)")
    for nodeid, (cpu, compile_s, compiles) in sorted(_per_test.items(), key=lambda kv: -kv[1][0])[:TOP]:
        write(f"{cpu:8.1f} {compile_s:10.1f} {compiles:9d}  {nodeid}")
