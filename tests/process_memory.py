"""What a test process keeps mapped, and the release ``tests/conftest.py`` runs after each module.

Each XLA:CPU executable a process loads keeps its code and data mapped (three memory mappings an object: a tiny
model's init and gradient hold ~3 100), and jax's caches, held by the library's module-level jitted functions, keep
every executable a process compiled. A `make test` worker reached Linux's vm.max_map_count (65 530 mappings) near the
end of the run and died in XLA (stop 75: the segfault docs/testing.md had called rare, in 5 of stop 75's 6 warm runs
before this). Released after each module, the largest worker peaked at 10 902.
"""

import gc

import jax


def release_executables() -> None:
    """Drop jax's caches and collect, so the executables no test still holds are unloaded and unmapped."""
    jax.clear_caches()
    gc.collect()


def mappings() -> int:
    """This process's memory mappings (Linux: the lines of ``/proc/self/maps``)."""
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)
