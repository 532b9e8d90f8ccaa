"""Checkpoints: round trip, keep-last + best, corrupt or partial newest → previous one with a warning,
a state of another shape → ValueError before reading arrays."""

import os
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from k3jax.train.checkpoint import Checkpointer, CheckpointMismatchError
from k3jax.train.config import CheckpointConfig, OptimizerConfig
from k3jax.train.optimizer import logical_axes, make_optimizer
from tests.k3jax.train import toy


def _state(seed=0):
    boxed = toy.boxed_params(seed)
    params = nn.unbox(boxed)
    tx = make_optimizer(OptimizerConfig(), optax.constant_schedule(0.01), params, logical_axes(boxed))
    grads = jax.tree.map(jnp.ones_like, params)
    _, opt = tx.update(grads, tx.init(params), params)  # non-trivial moments
    return {"params": params, "opt": opt, "step": jnp.int32(seed)}


def _equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _saved(tmp_path, losses, keep_last=2, keep_best=1):
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path / "ck"), keep_last=keep_last, keep_best=keep_best))
    states = {}
    for step, loss in losses.items():
        states[step] = _state(step)
        ck.save(step, states[step], {"position": step}, loss=loss)
    ck.wait()
    return ck, states


def test_round_trip_and_keep_last_plus_best(tmp_path):
    ck, states = _saved(tmp_path, {1: 5.0, 2: 0.5, 3: 4.0, 4: 3.0, 5: 2.0})
    assert ck.all_steps() == [2, 4, 5]  # the best (2) and the last two
    state, data, step = ck.restore(jax.eval_shape(lambda: states[5]))
    assert step == 5 and data == {"position": 5} and _equal(state, states[5])
    ck.close()


@pytest.mark.parametrize("how", ["flip_bytes", "truncate", "delete_meta"])
def test_corrupt_newest_falls_back_with_warning(tmp_path, how):
    ck, states = _saved(tmp_path, {1: 2.0, 2: 1.0}, keep_best=0)
    newest = tmp_path / "ck" / "2"
    if how == "delete_meta":
        for f in (newest / "meta").iterdir():
            f.unlink()
    else:
        data_files = [p for p in (newest / "state").rglob("*") if p.is_file() and "/d/" in str(p)]
        assert data_files
        for f in data_files:
            raw = bytearray(f.read_bytes())
            if how == "truncate":
                raw = raw[: len(raw) // 3]
            else:
                for i in range(len(raw) // 2, len(raw), 7):
                    raw[i] ^= 0xFF
            f.write_bytes(bytes(raw))
    with pytest.warns(RuntimeWarning, match="checkpoint step 2 .* partial or corrupt"):
        state, data, step = ck.restore(jax.eval_shape(lambda: states[1]))
    assert step == 1 and data == {"position": 1} and _equal(state, states[1])
    ck.close()


def test_unfinished_save_is_not_a_checkpoint(tmp_path):
    ck, states = _saved(tmp_path, {1: 2.0}, keep_best=0)
    tmp_dir = tmp_path / "ck" / "2.orbax-checkpoint-tmp-123"  # what a save cut short leaves behind
    (tmp_dir / "state").mkdir(parents=True)
    ck.close()
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path / "ck")))
    assert ck.all_steps() == [1]
    _, _, step = ck.restore(jax.eval_shape(lambda: states[1]))
    assert step == 1
    ck.close()


def test_other_shape_raises_before_reading(tmp_path):
    ck, states = _saved(tmp_path, {1: 2.0}, keep_best=0)
    target = jax.eval_shape(lambda: states[1])
    target["params"]["embed"]["embedding"] = jax.ShapeDtypeStruct((toy.V + 1, toy.D), jnp.float32)
    with pytest.raises(CheckpointMismatchError, match=r"embedding.*\[32, 16\]"):
        ck.restore(target)
    ck.close()


def test_missing_dir_is_a_clear_error():
    with pytest.raises(ValueError, match="checkpoint.dir"):
        Checkpointer(CheckpointConfig(dir=None))
