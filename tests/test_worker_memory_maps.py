"""``tests/process_memory.release_executables``, which ``tests/conftest.py`` runs after each module, unmaps the
programs that jitted functions living as long as their module (the library's own, like these two) still hold: a jax
or XLA that kept them would bring back stop 75's worker crashes at ``vm.max_map_count``."""

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
import pytest

from k3jax import config
from k3jax.model import Transformer
from tests.process_memory import mappings, release_executables


@functools.partial(jax.jit, static_argnames="cfg")
def _init(tokens, cfg):
    return Transformer(cfg).init(jax.random.key(0), tokens)


@functools.partial(jax.jit, static_argnames="cfg")
def _grad(variables, tokens, cfg):
    return jax.grad(lambda v: Transformer(cfg).apply(v, tokens).astype(jnp.float32).mean())(variables)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/maps")
def test_clearing_jax_caches_unmaps_the_programs():
    cfg = dataclasses.replace(config.tiny(), name="tiny")
    tokens = jnp.zeros((1, 8), jnp.int32)
    release_executables()
    before = mappings()
    jax.block_until_ready(_grad(_init(tokens, cfg), tokens, cfg))
    held = mappings() - before  # the results are gone; the two functions' caches still hold the programs
    release_executables()
    left = mappings() - before
    assert held > 100, f"the programs held {held} mappings: the probe no longer loads anything to release"
    assert left < held / 4, f"{left} of the {held} mappings the programs held stayed after clearing the caches"
