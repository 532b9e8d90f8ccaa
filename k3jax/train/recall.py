"""Multi-query associative recall (MQAR; Zoology, Arora et al., arXiv 2312.04927), the demo task.

A row is ``BOS k_1 v_1 … k_N v_N  q_1 a_1 … q_M a_M`` then padding: N distinct keys each bound to a
random value, then M of those keys again (in random order), each followed by its value. Only the
answers are targets (``loss_mask`` 1 at each query position), so chance is 1/num_values. Recalling
a value bound many tokens earlier is what a recurrent layer alone does badly and what KDA's delta
rule and MLA are for.

The iterator is deterministic in ``(seed, position)``: ``get_state``/``set_state`` make resume exact.
"""

from __future__ import annotations

import numpy as np

from k3jax.train.config import RecallConfig

BOS, PAD = 1, 0
FIRST_KEY = 2


def recall_length(cfg: RecallConfig) -> int:
    return 1 + 2 * cfg.num_pairs + 2 * cfg.num_queries


def recall_vocab(cfg: RecallConfig) -> int:
    """Tokens used: PAD, BOS, keys, values."""
    return FIRST_KEY + cfg.num_keys + cfg.num_values


def recall_example(rng: np.random.Generator, cfg: RecallConfig, seq_len: int) -> dict[str, np.ndarray]:
    """One row: tokens, labels (next token), loss_mask (1 at query positions), segment_ids."""
    keys = FIRST_KEY + rng.choice(cfg.num_keys, cfg.num_pairs, replace=False)
    values = FIRST_KEY + cfg.num_keys + rng.integers(0, cfg.num_values, cfg.num_pairs)
    asked = rng.choice(cfg.num_pairs, cfg.num_queries, replace=False)
    pairs = np.stack([keys, values], 1).reshape(-1)
    queries = np.stack([keys[asked], values[asked]], 1).reshape(-1)
    row = np.concatenate([[BOS], pairs, queries]).astype(np.int32)
    tokens = np.full(seq_len, PAD, np.int32)
    tokens[: len(row)] = row
    labels = np.concatenate([tokens[1:], [PAD]]).astype(np.int32)
    loss_mask = np.zeros(seq_len, np.float32)
    query_pos = 1 + 2 * cfg.num_pairs + 2 * np.arange(cfg.num_queries)
    loss_mask[query_pos] = 1.0
    segment_ids = np.zeros(seq_len, np.int32)
    segment_ids[: len(row)] = 1
    return {"tokens": tokens, "segment_ids": segment_ids, "labels": labels, "loss_mask": loss_mask}


class RecallBatches:
    """Endless MQAR batches ``[batch_size, seq_len]``; batch n depends only on ``(seed, n)``."""

    def __init__(self, cfg: RecallConfig, batch_size: int, seq_len: int, vocab_size: int, seed: int = 0):
        if recall_length(cfg) > seq_len:
            raise ValueError(f"seq_len={seq_len} must be >= {recall_length(cfg)} for {cfg}")
        if recall_vocab(cfg) > vocab_size:
            raise ValueError(f"recall needs vocab_size >= {recall_vocab(cfg)} (PAD, BOS, keys, values); "
                             f"the model has vocab_size={vocab_size}")
        self.cfg, self.batch_size, self.seq_len, self.seed = cfg, batch_size, seq_len, seed
        self.position = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, self.position])
        rows = [recall_example(rng, self.cfg, self.seq_len) for _ in range(self.batch_size)]
        self.position += 1
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

    def get_state(self) -> dict:
        return {"kind": "recall", "seed": self.seed, "position": self.position}

    def set_state(self, state: dict) -> None:
        if state.get("kind") != "recall" or state.get("seed") != self.seed:
            raise ValueError(f"data state {state} is not a recall iterator with seed={self.seed}")
        self.position = int(state["position"])


def recall_accuracy(logits: np.ndarray, batch: dict[str, np.ndarray]) -> float:
    """Fraction of queries whose argmax prediction is the bound value."""
    mask = batch["loss_mask"] > 0
    pred = np.asarray(logits).argmax(-1)
    return float((pred[mask] == batch["labels"][mask]).mean())
