"""Exact resume: n batches straight == k batches, state through JSON into a fresh iterator, n-k more."""

import json

import numpy as np
import pytest

from k3jax.data import CopyConfig, make_batches
from k3jax.data.packing import PackedBatches
from k3jax.data.tokenizer import ByteTokenizer
from k3jax.train.config import DataConfig, TrainConfig


def _assert_resumes(make, n, k):
    straight = [next(it) for it in [make()] for _ in range(n)]
    first = make()
    for _ in range(k):
        next(first)
    state = json.loads(json.dumps(first.get_state()))
    assert len(json.dumps(state)) < 300
    resumed = make()
    resumed.set_state(state)
    for want in straight[k:]:
        got = next(resumed)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert straight[0]["tokens"].tolist() != straight[1]["tokens"].tolist()


@pytest.mark.parametrize("k", [0, 1, 4, 7])
def test_packed_resume_across_epochs(k):
    docs = [f"doc{i} " * (i % 5 + 1) for i in range(9)]  # ~3 rows per epoch: n=10 spans 3 epochs
    make = lambda: PackedBatches(docs, ByteTokenizer(), 2, 24, seed=5)
    _assert_resumes(make, n=10, k=k)


@pytest.mark.parametrize("source", ["stdlib", "copy"])
def test_make_batches_resume(source):
    cfg = TrainConfig(data=DataConfig(source=source, seed=11, copy=CopyConfig(max_length=20)),
                      batch_size=3, seq_len=48)
    _assert_resumes(lambda: make_batches(cfg), n=6, k=2)


def test_state_of_another_stream_rejected():
    docs = ["a", "b", "c"]
    it = PackedBatches(docs, ByteTokenizer(), 1, 8, seed=0)
    with pytest.raises(ValueError, match="does not match"):
        it.set_state({**it.get_state(), "seed": 1})
    with pytest.raises(ValueError, match="does not match"):
        PackedBatches(docs[:2], ByteTokenizer(), 1, 8).set_state(it.get_state())
    cfg = TrainConfig(data=DataConfig(source="copy"), batch_size=1, seq_len=80)
    with pytest.raises(ValueError, match="not a copy iterator"):
        make_batches(cfg).set_state(it.get_state())
