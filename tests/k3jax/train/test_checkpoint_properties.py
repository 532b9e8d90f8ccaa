"""Save → restore → identical next step, for generated training histories (chex + hypothesis).

The state is the toy parameter tree (every kind of leaf K3 has) with clipped AdamW moments after a
generated number of steps on generated gradients; the next step from the restored state must
equal, bit for bit, the next step from the state that was saved. AdamW, not K3's Muon: what is
checked is the checkpointer, and Muon's update compiles ~40x slower on CPU. K3's optimizer state
is restored end to end in ``test_resume.py`` (a killed training run resumed, bitwise).
"""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3jax.train.checkpoint import Checkpointer
from k3jax.train.config import CheckpointConfig
from tests.k3jax.train import toy


@functools.cache
def _setup():
    # Deterministic values of the toy tree's shapes: random draws would compile one program per shape.
    shapes = jax.eval_shape(lambda: nn.unbox(toy.boxed_params(0)))
    params = jax.jit(lambda: jax.tree.map(
        lambda s: 0.1 * jnp.sin(jnp.arange(s.size, dtype=s.dtype).reshape(s.shape) * 0.37), shapes))()
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))

    @jax.jit
    def step(state, seed):
        grads = jax.tree.map(lambda p: jnp.cos(p * 7.0 + seed), state["params"])  # any function of the seed
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt, "step": state["step"] + 1}

    return jax.jit(lambda p: {"params": p, "opt": tx.init(p), "step": jnp.int32(0)})(params), step


def check_restored_step_identical(tmp_path, restore, steps, seed):
    state, step = _setup()
    for i in range(steps):
        state = step(state, seed + i)
    restored = restore(tmp_path, state)
    chex.assert_trees_all_equal_shapes_and_dtypes(restored, state)
    chex.assert_trees_all_equal(step(restored, seed + steps), step(state, seed + steps))


def _round_trip(tmp_path, state):
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path), keep_last=1, keep_best=0))
    ck.save(int(state["step"]), state, {"position": 0})
    ck.wait()
    restored, _, _ = ck.restore(jax.eval_shape(lambda: state))
    ck.close()
    return restored


@settings(max_examples=3, deadline=None)
@given(steps=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_save_restore_gives_an_identical_next_step(tmp_path_factory, steps, seed):
    check_restored_step_identical(tmp_path_factory.mktemp("ck"), _round_trip, steps, seed)


def test_identical_step_property_catches_a_restore_that_drops_the_moments(tmp_path):
    fresh_moments = lambda path, state: {**_round_trip(path, state), "opt": _setup()[0]["opt"]}
    with pytest.raises(AssertionError):
        check_restored_step_identical(tmp_path, fresh_moments, 2, 0)
