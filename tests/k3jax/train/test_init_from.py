"""``--init-from``: a fresh run takes the model's parameters and balancing biases from an orbax run
folder, a checkpoints folder or a Hugging Face folder; the optimizer state and step stay fresh;
the run's own checkpoint, when there is one, wins; a model of another shape is a ValueError."""

import dataclasses

import jax
import numpy as np
import pytest

from k3jax.convert import save_hf
from k3jax.train.checkpoint import Checkpointer
from k3jax.train.config import CheckpointConfig, MeshConfig
from k3jax.train.loop import _init_from, _restore_or_init, make_data
from k3jax.train.parallel import make_train_mesh
from k3jax.train.step import Trainer
from tests.k3jax.train import toy


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A trained-looking state (other parameters, a used optimizer state) saved as a run folder and
    an HF folder, and the fresh state of the run that starts from it (one init compile for both)."""
    root = tmp_path_factory.mktemp("init_from")
    cfg = toy.micro_train_config()
    trainer = Trainer(cfg)
    fresh = trainer.init_state(jax.random.key(0))
    bump = lambda tree: jax.tree.map(lambda x: x + 1, tree)
    state = fresh.replace(params=jax.tree.map(lambda x: x * 0.5 + 0.25, fresh.params),
                          opt_state=bump(fresh.opt_state), balance=bump(fresh.balance), step=fresh.step + 5)
    ck = Checkpointer(CheckpointConfig(dir=str(root / "run" / "checkpoints"), async_save=False), cfg)
    ck.save(5, state, make_data(cfg).get_state())
    ck.close()
    save_hf(cfg.model, trainer.model_variables(state), str(root / "hf"))
    return cfg, trainer, state, root, fresh


@pytest.mark.parametrize("where", ["run", "run/checkpoints", "hf"])
def test_parameters_from_each_layout_optimizer_fresh(source, where):
    cfg, trainer, saved, root, fresh = source
    state = _init_from(trainer, fresh, str(root / where))
    assert _same(state.params["model"], saved.params["model"])
    assert _same(state.balance["model"], saved.balance["model"])
    assert not _same(fresh.params["model"], saved.params["model"])
    assert _same(state.opt_state, fresh.opt_state) and not _same(state.opt_state, saved.opt_state)
    assert int(state.step) == 0


def test_onto_a_mesh_with_the_runs_shardings(source):
    cfg, _, saved, root, _ = source
    cfg = dataclasses.replace(cfg, mesh=MeshConfig(axes=(("data", 1),)))
    trainer = Trainer(cfg, make_train_mesh(cfg))
    state = _init_from(trainer, trainer.abstract_state(), str(root / "run"))  # only the model part is read
    want = trainer.shardings["state"].params["model"]
    assert jax.tree.all(jax.tree.map(lambda x, s: x.sharding == s, state.params["model"], want))
    assert _same(state.params["model"], saved.params["model"])


def test_own_checkpoint_wins_and_other_shapes_are_refused(source, tmp_path):
    cfg, trainer, saved, root, _ = source
    own = dataclasses.replace(cfg, checkpoint=CheckpointConfig(dir=str(root / "run" / "checkpoints"),
                                                               init_from=str(root / "hf")))
    data = make_data(own)
    state = _restore_or_init(trainer, Checkpointer(own.checkpoint, own), data, own)
    assert _same(state, saved)  # resumed (step 5 with its optimizer state), not re-initialised
    wide = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hidden=96))
    wide_trainer = Trainer(wide)
    with pytest.raises(ValueError, match="different train state|another shape"):
        _init_from(wide_trainer, wide_trainer.abstract_state(), str(root / "run"))
    with pytest.raises(ValueError, match="another shape"):
        _init_from(wide_trainer, wide_trainer.abstract_state(), str(root / "hf"))
