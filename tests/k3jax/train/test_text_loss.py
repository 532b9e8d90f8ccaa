"""Loss decreases on the built-in text corpus (the standard library, bytes) within a few dozen steps."""

import dataclasses

import numpy as np

from k3jax.train.config import DataConfig
from k3jax.train.loop import train
from tests.k3jax.train import toy

toy.use_compilation_cache()


def test_loss_decreases_on_stdlib_text(tmp_path):
    cfg = toy.micro_train_config(data=DataConfig(source="stdlib"), steps=40, batch_size=8, seq_len=64,
                                 log_every=1, log_dir=str(tmp_path), tensorboard=False)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=256),
                              optimizer=dataclasses.replace(cfg.optimizer, learning_rate=1e-2))
    train(cfg, progress=False)
    import json

    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 40
    first, last = np.mean(losses[:3]), np.mean(losses[-5:])
    assert first > 5.0  # ≈ log 256 at init
    assert last < first - 1.5, (first, last)
