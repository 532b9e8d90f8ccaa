"""Packing invariants: the stream is every document, whole and in order; segments, labels and the
loss mask never cross a document; padding only at the end of a finite pass."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from k3jax.data.packing import PackedBatches, row_targets
from k3jax.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def _docs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return ["".join(chr(c) for c in rng.integers(ord("a"), ord("z") + 1, n)) for n in lengths]


def _all_rows(docs, batch_size, seq_len):
    it = PackedBatches(docs, TOK, batch_size, seq_len, shuffle=False, num_epochs=1)
    batches = list(it)
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def _check_rows(docs, rows, seq_len):
    stream = [np.concatenate([[TOK.bos_id], TOK.encode(d), [TOK.eos_id]]) for d in docs]
    doc_of = np.concatenate([np.full(len(s), i) for i, s in enumerate(stream)])
    stream = np.concatenate(stream)
    tokens, seg = rows["tokens"].reshape(-1), rows["segment_ids"].reshape(-1)
    n = len(stream)
    # 1. every token of every document, once, in order; then padding only, less than one batch row set
    np.testing.assert_array_equal(tokens[:n], stream)
    assert (seg[n:] == 0).all() and (tokens[n:] == TOK.pad_id).all()
    assert (seg[:n] > 0).all()
    # 2. segment ids: 1, 2, 3 … per row, changing exactly where the document changes
    for r in range(rows["tokens"].shape[0]):
        lo, hi = r * seq_len, min((r + 1) * seq_len, n)
        if lo >= n:
            continue
        s, d = seg[lo:hi], doc_of[lo:hi]
        assert s[0] == 1
        np.testing.assert_array_equal(np.diff(s) != 0, np.diff(d) != 0)
        assert set(np.diff(s)) <= {0, 1}
    # 3. labels: the next token of the same document wherever the mask is on, also across row cuts
    labels, mask = rows["labels"].reshape(-1), rows["loss_mask"].reshape(-1)
    same_doc = np.concatenate([doc_of[1:] == doc_of[:-1], [False]])
    np.testing.assert_array_equal(mask[:n], same_doc.astype(np.float32))
    np.testing.assert_array_equal(labels[:n - 1][same_doc[:-1]], stream[1:][same_doc[:-1]])
    assert (mask[n:] == 0).all()
    # 4. the mask is off exactly at each document's last token (its EOS) and on padding
    assert (tokens[:n][mask[:n] == 0] == TOK.eos_id).all()
    assert int((mask == 0).sum()) == len(docs) + (len(tokens) - n)


@pytest.mark.parametrize("lengths,batch_size,seq_len", [
    ([0, 1, 5, 40, 3, 0, 17], 2, 8),      # empty documents, one longer than several rows
    ([6], 1, 8),                           # one document that exactly fills a row
    ([100, 2, 2, 2], 3, 16),               # padding fills whole rows of the last batch
])
def test_packing_invariants(lengths, batch_size, seq_len):
    docs = _docs(lengths)
    rows = _all_rows(docs, batch_size, seq_len)
    assert rows["tokens"].dtype == rows["segment_ids"].dtype == rows["labels"].dtype == np.int32
    assert rows["loss_mask"].dtype == np.float32
    assert rows["tokens"].shape[1] == seq_len and rows["tokens"].shape[0] % batch_size == 0
    _check_rows(docs, rows, seq_len)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=12), st.integers(1, 3), st.integers(2, 20))
def test_packing_invariants_random(lengths, batch_size, seq_len):
    docs = _docs(lengths, seed=len(lengths))
    _check_rows(docs, _all_rows(docs, batch_size, seq_len), seq_len)


def test_row_targets():
    tokens = np.array([5, 6, 7, 8, 9, 0], np.int32)
    seg = np.array([1, 1, 2, 2, 2, 0], np.int32)
    labels, mask = row_targets(tokens, seg, None, pad_id=0)
    np.testing.assert_array_equal(mask, [1, 0, 1, 1, 0, 0])
    np.testing.assert_array_equal(labels, [6, 0, 8, 9, 0, 0])
    labels, mask = row_targets(tokens[:5], seg[:5], 42, pad_id=0)  # the last document continues
    assert labels[-1] == 42 and mask[-1] == 1


def test_epochs_reshuffle_and_cover():
    docs = _docs([3] * 20)
    it = PackedBatches(docs, TOK, 1, 5 * 4, seed=3)  # each row holds exactly 4 documents
    first = [b["tokens"][0] for b in (next(it) for _ in range(5))]
    second = [b["tokens"][0] for b in (next(it) for _ in range(5))]
    decode = lambda rows: sorted(TOK.decode(r, skip_special=True)[i:i + 3] for r in rows for i in (0, 3, 6, 9))
    assert decode(first) == decode(second) == sorted(docs)  # each epoch is every document once
    assert [TOK.decode(r) for r in first] != [TOK.decode(r) for r in second]  # in a new order
    assert it.get_state()["epoch"] == 2


def test_empty_corpus_rejected():
    with pytest.raises(ValueError, match="corpus is empty"):
        PackedBatches([], TOK, 1, 8)
