"""Bad input fails with a clear ValueError before any compute: mesh, data path, checkpoint of another
model shape, config overrides, the CLI."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from k3jax.train.__main__ import load_config, main
from k3jax.train.checkpoint import Checkpointer, CheckpointMismatchError
from k3jax.train.config import CheckpointConfig, DataConfig, MeshConfig, TrainConfig, override
from k3jax.train.loop import make_data, train
from k3jax.train.step import BATCH_KEYS, Trainer
from tests.k3jax.train import toy


def _no_compile(monkeypatch):
    """Any attempt to build the jitted step or initialise parameters fails the test."""
    monkeypatch.setattr(Trainer, "init_state", lambda *a, **k: pytest.fail("init_state ran"))
    monkeypatch.setattr(Trainer, "step", lambda *a, **k: pytest.fail("a step ran"))


def test_config_that_does_not_fit_the_mesh(monkeypatch):
    _no_compile(monkeypatch)
    cfg = toy.micro_train_config(mesh=MeshConfig(axes=(("data", 3),)))
    with pytest.raises(ValueError, match=r"spans 3 devices but 1 are available"):
        train(cfg, progress=False)
    with pytest.raises(ValueError, match="axes must be among"):
        train(toy.micro_train_config(mesh=MeshConfig(axes=(("pipeline", 1),))), progress=False)


def test_missing_data_path(monkeypatch, tmp_path):
    _no_compile(monkeypatch)
    cfg = toy.micro_train_config(data=DataConfig(source="text", path=str(tmp_path / "nope.txt")))
    with pytest.raises(ValueError, match=r"data.path=.*nope.txt' does not exist"):
        train(cfg, progress=False)


def test_resume_from_checkpoint_of_another_model(monkeypatch, tmp_path):
    ck = CheckpointConfig(dir=str(tmp_path / "ck"))
    small = toy.micro_train_config(checkpoint=ck)
    abstract = Trainer(small).abstract_state()
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract)
    saver = Checkpointer(ck, small)
    saver.save(10, zeros, {"kind": "recall", "seed": 0, "position": 10})
    saver.close()
    _no_compile(monkeypatch)
    wider = toy.micro_train_config(checkpoint=ck, model=dataclasses.replace(small.model, hidden=96))
    with pytest.raises(CheckpointMismatchError, match=r"model config differences: \['hidden=64 \(checkpoint\) vs 96'\]"):
        train(wider, progress=False)


def test_bad_overrides_and_fields():
    cfg = TrainConfig()
    assert override(cfg, ["optimizer.learning_rate=1", "steps=7"]).optimizer.learning_rate == 1.0
    with pytest.raises(ValueError, match="has no field 'learnin_rate'"):
        override(cfg, ["optimizer.learnin_rate=1e-3"])
    with pytest.raises(ValueError, match="key=value"):
        override(cfg, ["steps"])
    with pytest.raises(ValueError, match="divisible by micro_batches"):
        TrainConfig(batch_size=6, micro_batches=4)
    with pytest.raises(ValueError, match="remat"):
        TrainConfig(remat="all")


def test_cli_reports_bad_config_file(tmp_path, capsys):
    assert main(["--config", str(tmp_path / "missing.py")]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.py"
    bad.write_text("def get_config():\n    return 3\n")
    assert main(["--config", str(bad)]) == 2
    assert "expected TrainConfig" in capsys.readouterr().err


def test_demo_config_loads():
    cfg = load_config("experiments/demo_recall.py", ["steps=5"])
    assert cfg.steps == 5 and cfg.model.name == "tiny" and cfg.data.source == "recall"


def test_small_h200_config_is_the_benchmarked_step():
    """The H200 experiment is bench_train's measured setting: 8 micro-batches of 8 × 4096 tokens, no remat."""
    cfg = load_config("experiments/small_h200.py", ["steps=3"])
    assert (cfg.model.name, cfg.micro_batch_size, cfg.micro_batches, cfg.seq_len, cfg.remat) == ("small", 8, 8, 4096, "none")
    assert cfg.tokens_per_step == 262144 and cfg.steps == 3 and cfg.loss_logits_dtype is None


@pytest.mark.unchecked  # a None state: the ids are checked first
def test_out_of_range_ids_are_rejected_before_compiling(monkeypatch):
    """Under jit an id >= vocab_size would be NaN logits; the step rejects it on the host first."""
    cfg = toy.micro_train_config()
    trainer = Trainer(cfg)
    monkeypatch.setattr(trainer, "_jit_step", lambda *a: pytest.fail("compiled despite bad ids"))
    batch = next(make_data(cfg))
    for key, value in (("tokens", cfg.model.vocab_size), ("labels", -1)):
        bad = dict(batch, **{key: batch[key].copy()})
        bad[key][0, 3] = value
        with pytest.raises(ValueError, match=rf"batch\['{key}'\].*vocab_size={cfg.model.vocab_size}"):
            trainer.step(None, bad)
        with pytest.raises(ValueError, match=rf"batch\['{key}'\]"):
            trainer.step(None, {k: jnp.asarray(v) for k, v in bad.items()})  # device arrays too


@pytest.mark.parametrize("bad_id", [256, 300, -1])
def test_the_models_id_check_survives_jit_under_checkify(bad_id):
    from jax.experimental import checkify

    from k3jax.config import tiny
    from k3jax.model import device_id_checks, validate_inputs

    cfg = tiny()
    checked = checkify.checkify(jax.jit(lambda t: (validate_inputs(cfg, t, None), t.sum())[1]))
    with device_id_checks():  # traced on the first call, inside
        err, _ = checked(jnp.asarray([[1, bad_id]], jnp.int32))
    assert "vocab_size=256" in str(err.get())
    err, _ = checked(jnp.asarray([[1, 255]], jnp.int32))
    assert err.get() is None


def test_jitted_model_decode_and_train_programs_have_no_effects():
    """By default a traced model call stages no check: an effect would send every call of the program
    through jax's Python dispatch (a decode loop of ``small()``: milliseconds a call, RESULTS.md stop 74)."""
    import flax.linen as nn

    from k3jax.config import tiny
    from k3jax.infer.cache import init_cache
    from k3jax.infer.decode import decode_step
    from k3jax.model import Transformer, device_id_checks

    cfg = tiny()
    tokens = jnp.ones((1, 4), jnp.int32)
    variables = nn.meta.unbox(jax.eval_shape(Transformer(cfg).init, jax.random.key(0), tokens))
    forward = jax.make_jaxpr(lambda v, t: Transformer(cfg).apply(v, t))
    assert not forward(variables, tokens).effects
    step = jax.make_jaxpr(lambda v, t, c: decode_step(v, cfg, t, c, greedy=True))
    assert not step(variables, tokens[:, :1], init_cache(cfg, 1, 8)).effects
    with device_id_checks():  # the opt-in stages the range check, an effect (a new function: traces are cached)
        assert jax.make_jaxpr(lambda v, t: Transformer(cfg).apply(v, t))(variables, tokens).effects
    compiled = jax.jit(lambda v, t: Transformer(cfg).apply(v, t).sum()).lower(variables, tokens).compile()
    assert not compiled._executable.unsafe_call.has_unordered_effects  # what jax's C++ dispatch needs
    trainer = Trainer(toy.micro_train_config())
    state = jax.eval_shape(trainer.init_state, jax.random.key(0))
    batch = {k: jnp.ones((trainer.cfg.batch_size, trainer.cfg.seq_len), jnp.int32) for k in BATCH_KEYS}
    assert not jax.make_jaxpr(trainer.train_step)(state, batch, trainer.horizon).effects
