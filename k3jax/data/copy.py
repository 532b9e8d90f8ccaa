"""The copy task, a built-in synthetic source beside MQAR recall.

A row is ``BOS s_1 … s_L SEP s_1 … s_L`` then padding: the model must reproduce a random sequence
it has just read, so every copied token needs an exact look-up L+1 positions back. Softmax
attention does this trivially; a fixed-size recurrent state only up to its capacity (Jelassi et
al., "Repeat After Me", arXiv 2402.01032), which makes it a quick probe of the KDA/MLA hybrid.

Only the copy is a target (``loss_mask`` 1 where the label is a copied symbol), so chance is
1/num_symbols. Batch n depends only on ``(seed, n)``: ``get_state``/``set_state`` make resume exact.
"""

from __future__ import annotations

import numpy as np

from k3jax.data.config import CopyConfig

PAD, BOS, SEP = 0, 1, 2
FIRST_SYMBOL = 3


def copy_length(cfg: CopyConfig) -> int:
    """Tokens of the longest row."""
    return 2 * cfg.max_length + 2


def copy_vocab(cfg: CopyConfig) -> int:
    """Ids used: PAD, BOS, SEP, symbols."""
    return FIRST_SYMBOL + cfg.num_symbols


def copy_example(rng: np.random.Generator, cfg: CopyConfig, seq_len: int) -> dict[str, np.ndarray]:
    """One row: tokens, segment_ids, labels (next token), loss_mask (1 where the label is copied)."""
    length = int(rng.integers(cfg.min_length, cfg.max_length + 1))
    symbols = FIRST_SYMBOL + rng.integers(0, cfg.num_symbols, length)
    row = np.concatenate([[BOS], symbols, [SEP], symbols])
    tokens = np.full(seq_len, PAD, np.int32)
    tokens[: len(row)] = row
    labels = np.concatenate([tokens[1:], [PAD]]).astype(np.int32)
    loss_mask = np.zeros(seq_len, np.float32)
    # SEP predicts s_1; the copy's s_i predicts s_{i+1}; the copy's last symbol predicts nothing.
    loss_mask[length + 1: 2 * length + 1] = 1.0
    segment_ids = np.zeros(seq_len, np.int32)
    segment_ids[: len(row)] = 1
    return {"tokens": tokens, "segment_ids": segment_ids, "labels": labels, "loss_mask": loss_mask}


class CopyBatches:
    """Endless copy-task batches ``[batch_size, seq_len]``; batch n depends only on ``(seed, n)``."""

    def __init__(self, cfg: CopyConfig, batch_size: int, seq_len: int, vocab_size: int, seed: int = 0):
        if copy_length(cfg) > seq_len:
            raise ValueError(f"seq_len={seq_len} must be >= {copy_length(cfg)} (2 * max_length + 2) for {cfg}")
        if copy_vocab(cfg) > vocab_size:
            raise ValueError(f"the copy task needs vocab_size >= {copy_vocab(cfg)} (PAD, BOS, SEP, "
                             f"num_symbols={cfg.num_symbols}); the model has vocab_size={vocab_size}")
        self.cfg, self.batch_size, self.seq_len, self.seed = cfg, batch_size, seq_len, seed
        self.position = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        # "copy" in the seed keeps this stream independent of recall's at the same (seed, position).
        rng = np.random.default_rng([self.seed, self.position, 0xC0])
        rows = [copy_example(rng, self.cfg, self.seq_len) for _ in range(self.batch_size)]
        self.position += 1
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

    def get_state(self) -> dict:
        return {"kind": "copy", "seed": self.seed, "position": self.position}

    def set_state(self, state: dict) -> None:
        if state.get("kind") != "copy" or state.get("seed") != self.seed:
            raise ValueError(f"data state {state} is not a copy iterator with seed={self.seed}")
        self.position = int(state["position"])
