"""What ``tests/conftest.py``'s ``_release_executables`` relies on: dropping jax's caches unmaps the executables.

Every XLA:CPU executable keeps its code and data mapped, and a jitted function that lives as long as its module (the
library's own, like these two) keeps every program it compiled. A ``make test`` worker that held every module's
programs reached Linux's ``vm.max_map_count`` and died inside XLA (stop 75). The conftest clears jax's caches after
each module; this checks, on a tiny model's programs, that the mappings they added go away with the caches (a jax or
XLA that kept them would bring the crash back).
"""

import dataclasses
import functools
import gc
import sys

import jax
import jax.numpy as jnp
import pytest

from k3jax import config
from k3jax.model import Transformer


@functools.partial(jax.jit, static_argnames="cfg")
def _init(tokens, cfg):
    return Transformer(cfg).init(jax.random.key(0), tokens)


@functools.partial(jax.jit, static_argnames="cfg")
def _grad(variables, tokens, cfg):
    return jax.grad(lambda v: Transformer(cfg).apply(v, tokens).astype(jnp.float32).mean())(variables)


def _mappings() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/maps")
def test_clearing_jax_caches_unmaps_the_programs():
    cfg = dataclasses.replace(config.tiny(), name="tiny")
    tokens = jnp.zeros((1, 8), jnp.int32)
    jax.clear_caches()
    gc.collect()
    before = _mappings()
    jax.block_until_ready(_grad(_init(tokens, cfg), tokens, cfg))
    gc.collect()
    held = _mappings() - before  # the results are gone; the two functions' caches still hold the programs
    jax.clear_caches()
    gc.collect()
    left = _mappings() - before
    assert held > 100, f"the programs held {held} mappings: the probe no longer loads anything to release"
    assert left < held / 4, f"{left} of the {held} mappings the programs held stayed after clearing the caches"
