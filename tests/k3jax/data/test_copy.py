"""The copy task: row layout, targets only on the copy, chance level, determinism."""

import numpy as np

from k3jax.data.config import CopyConfig
from k3jax.data.copy import BOS, FIRST_SYMBOL, PAD, SEP, CopyBatches


def test_copy_rows():
    cfg = CopyConfig(min_length=3, max_length=9, num_symbols=5)
    batch = next(CopyBatches(cfg, 64, 24, vocab_size=8, seed=1))
    lengths = set()
    for tokens, seg, labels, mask in zip(*(batch[k] for k in ("tokens", "segment_ids", "labels", "loss_mask"))):
        length = int(np.flatnonzero(tokens == SEP)[0]) - 1
        lengths.add(length)
        symbols = tokens[1: length + 1]
        assert tokens[0] == BOS and (symbols >= FIRST_SYMBOL).all() and (symbols < FIRST_SYMBOL + 5).all()
        np.testing.assert_array_equal(tokens[length + 2: 2 * length + 2], symbols)
        assert (tokens[2 * length + 2:] == PAD).all() and (seg == (np.arange(24) < 2 * length + 2)).all()
        np.testing.assert_array_equal(labels[mask == 1], symbols)  # exactly the copy is predicted
        np.testing.assert_array_equal(labels[:-1], tokens[1:])
    assert lengths == set(range(3, 10))


def test_copy_deterministic():
    cfg = CopyConfig()
    a, b = CopyBatches(cfg, 2, 80, 256, seed=3), CopyBatches(cfg, 2, 80, 256, seed=3)
    np.testing.assert_array_equal(next(a)["tokens"], next(b)["tokens"])
    assert not np.array_equal(next(a)["tokens"], next(CopyBatches(cfg, 2, 80, 256, seed=4))["tokens"])
