"""Checkpoints: round trip, keep-last + best; a corrupt newest step (each kind of file an orbax step
holds) is moved aside with one warning line and the previous one restored; a state of another
shape → ValueError before reading arrays."""

import json
import logging
from pathlib import Path

import chex
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


def _plain_state(seed=0):
    """A few leaves of the train state's kinds (orbax stores any tree alike), built without compiling."""
    rng = np.random.default_rng(seed)
    return {"params": {"w": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
                       "b": jnp.asarray(rng.normal(size=(4,)), jnp.bfloat16)},
            "step": jnp.int32(seed)}


def _saved(tmp_path, losses, keep_last=2, keep_best=1, make=_state):
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path / "ck"), keep_last=keep_last, keep_best=keep_best))
    states = {}
    for step, loss in losses.items():
        states[step] = make(step)
        ck.save(step, states[step], {"position": step}, loss=loss)
    ck.wait()
    return ck, states


def test_round_trip_and_keep_last_plus_best(tmp_path):
    ck, states = _saved(tmp_path, {1: 5.0, 2: 0.5, 3: 4.0, 4: 3.0, 5: 2.0})
    assert ck.all_steps() == [2, 4, 5]  # the best (2) and the last two
    state, data, step = ck.restore(jax.eval_shape(lambda: states[5]))
    assert step == 5 and data == {"position": 5}
    chex.assert_trees_all_equal(state, states[5])
    ck.close()


def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])


def _flip(f: Path) -> None:
    raw = bytearray(f.read_bytes())
    for i in range(len(raw) // 2, len(raw), 7):
        raw[i] ^= 0xFF
    f.write_bytes(bytes(raw))


def _array_files(step_dir: Path) -> list[Path]:
    return [p for p in (step_dir / "state" / "d").iterdir() if p.is_file()]


def _forge_fingerprint(step_dir: Path) -> None:
    """Arrays that read fine but are not what was saved: the fingerprint no longer matches."""
    meta_file = step_dir / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    key = sorted(meta["fingerprint"])[0]
    meta["fingerprint"][key] = (meta["fingerprint"][key] + 1) % 2**32
    meta_file.write_text(json.dumps(meta))


# Every kind of file an orbax step holds: array data, array metadata, the array index (a missing
# file), orbax's step record, our metadata, the data-iterator state; and arrays that differ from
# their fingerprint. Each pairs with the reason the step is moved aside under.
CORRUPTIONS = {
    "array-data-truncated": (lambda d: [_truncate(f) for f in _array_files(d)], "arrays"),
    "array-data-flipped": (lambda d: [_flip(f) for f in _array_files(d)], "arrays"),
    "array-metadata": (lambda d: _truncate(d / "state" / "_METADATA"), "arrays"),
    "array-index-missing": (lambda d: (d / "state" / "manifest.ocdbt").unlink(), "arrays"),
    "step-record": (lambda d: _truncate(d / "_CHECKPOINT_METADATA"), "step-metadata"),
    "step-record-missing": (lambda d: (d / "_CHECKPOINT_METADATA").unlink(), "step-metadata"),
    "metadata": (lambda d: _flip(d / "meta" / "metadata"), "metadata"),
    "metadata-missing": (lambda d: (d / "meta" / "metadata").unlink(), "metadata"),
    "data-state": (lambda d: _truncate(d / "data" / "metadata"), "data-state"),
    "fingerprint": (_forge_fingerprint, "fingerprint"),
}


def corrupt(step_dir: Path, kind: str) -> str:
    """Damage ``step_dir`` as ``kind`` says; returns the reason its restore should give."""
    damage, reason = CORRUPTIONS[kind]
    damage(step_dir)
    return reason


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_newest_is_moved_aside_and_the_previous_restored(tmp_path, kind, caplog):
    ck, states = _saved(tmp_path, {1: 2.0, 2: 1.0}, keep_best=0, make=_plain_state)
    ck.close()
    reason = corrupt(tmp_path / "ck" / "2", kind)
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path / "ck"), keep_best=0))
    with caplog.at_level(logging.WARNING, logger="k3jax"):
        state, data, step = ck.restore(jax.eval_shape(lambda: states[1]))
    assert step == 1 and data == {"position": 1}
    chex.assert_trees_all_equal(state, states[1])
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("k3jax")]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert f"checkpoint step 2 in {tmp_path / 'ck'} is corrupt ({reason}:" in lines[0]
    aside = tmp_path / "ck" / f"2.corrupt-{reason}"
    assert aside.is_dir() and (aside / "reason.txt").read_text().startswith(reason)
    assert ck.all_steps() == [1]
    # the next save of step 2 is not blocked by the corrupt one, and is what a restore then finds
    ck.save(2, states[2], {"position": 2})
    ck.close()
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path / "ck"), keep_best=0))
    state, data, step = ck.restore(jax.eval_shape(lambda: states[2]))
    assert step == 2
    chex.assert_trees_all_equal(state, states[2])
    ck.close()


def test_every_step_corrupt_restores_nothing(tmp_path):
    ck, states = _saved(tmp_path, {1: 2.0}, keep_best=0, make=_plain_state)
    ck.close()
    corrupt(tmp_path / "ck" / "1", "array-metadata")
    ck = Checkpointer(CheckpointConfig(dir=str(tmp_path / "ck"), keep_best=0))
    assert ck.restore(jax.eval_shape(lambda: states[1])) is None
    assert ck.all_steps() == [] and (tmp_path / "ck" / "1.corrupt-arrays").is_dir()
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
