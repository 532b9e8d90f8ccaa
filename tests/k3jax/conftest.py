"""Shared fixtures of the model tests: the tiny() model in float32 and its initialised variables.

Compiling the model dominates these tests' runtime, so the variables and the jitted forward are
built once per session and shared.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from k3jax import config
from k3jax.model import Transformer


@dataclasses.dataclass(frozen=True)
class TinyModel:
    cfg: config.ModelConfig  # tiny() with float32 compute
    variables: dict  # {"params", "balance"}, float32, unboxed
    forward: callable  # jit(tokens, segment_ids=None) -> ((logits, hidden), {"stats": …})


@pytest.fixture(scope="session")
def tiny_model() -> TinyModel:
    cfg = dataclasses.replace(config.tiny(), dtype=jnp.float32)
    model = Transformer(cfg)
    # The RBG generator compiles in half the time of threefry; the values only need to be random.
    key = jax.random.key(0, impl="unsafe_rbg")
    variables = nn.meta.unbox(jax.jit(model.init)(key, jnp.zeros((1, 8), jnp.int32)))

    @jax.jit
    def forward(variables, tokens, segment_ids):
        with jax.default_matmul_precision("highest"):
            return model.apply(variables, tokens, segment_ids=segment_ids, return_hidden=True, mutable=["stats"])

    def run(tokens, segment_ids=None):  # one compiled function: None is passed as one document per row
        segment_ids = jnp.zeros(tokens.shape, jnp.int32) if segment_ids is None else segment_ids
        return forward(variables, tokens, segment_ids)

    return TinyModel(cfg, variables, run)
