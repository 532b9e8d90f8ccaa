"""Packing documents into fixed-length rows with segment ids, and resuming exactly.

1. Each document becomes ``[BOS] encode(text) [EOS]``.
2. Documents are visited in a per-epoch permutation (``default_rng([seed, epoch])``; file order
   without shuffling) and concatenated into one token stream, cut into rows of ``seq_len``: no
   token is dropped and a long document simply continues in the next row.
3. ``segment_ids`` number the documents of a row 1, 2, 3, … (0 = padding, only after the last
   document of a finite pass). The model resets KDA state and masks MLA at segment changes, so
   nothing flows between documents (the packing of T5/MaxText; SPEC's segment-aware kernels).
4. ``labels[i]`` is the next token of the same document, also across a row cut (the first token of
   the next row); ``loss_mask`` is 0 where there is none: at each document's last token (its EOS)
   and on padding.

The iterator's whole state is the stream cursor ``(epoch, index in the epoch's order, token offset
in that document)``: a few integers, JSON-serialisable; the document at the cursor is re-read and
re-tokenised on resume. Pure numpy, so the same code runs on a host with only the JAX stack.
"""

from __future__ import annotations

import numpy as np
from jaxtyping import Float, Int

from k3jax.data.tokenizer import Tokenizer


def row_targets(tokens: Int[np.ndarray, "T"], segment_ids: Int[np.ndarray, "T"],
                next_token: int | None, pad_id: int) -> tuple[Int[np.ndarray, "T"], Float[np.ndarray, "T"]]:
    """Labels and loss mask of one packed row. ``next_token``: the stream's next token when it
    continues the row's last document, else None."""
    same = (segment_ids[1:] == segment_ids[:-1]) & (segment_ids[1:] > 0)
    labels = np.full(tokens.shape, pad_id, np.int32)
    loss_mask = np.zeros(tokens.shape, np.float32)
    labels[:-1] = np.where(same, tokens[1:], pad_id)
    loss_mask[:-1] = same
    if next_token is not None:
        labels[-1], loss_mask[-1] = next_token, 1.0
    return labels, loss_mask


class PackedBatches:
    """Batches ``{tokens, segment_ids, labels [B, T] int32, loss_mask [B, T] float32}`` of packed
    documents. ``num_epochs=None``: endless (training); else StopIteration after that many passes,
    the last batch padded."""

    def __init__(self, corpus, tokenizer: Tokenizer, batch_size: int, seq_len: int, *, seed: int = 0,
                 shuffle: bool = True, num_epochs: int | None = None):
        if len(corpus) == 0:
            raise ValueError("the corpus is empty: no documents to pack")
        if seq_len < 2:
            raise ValueError(f"seq_len={seq_len} must be >= 2")
        self.corpus, self.tok, self.batch_size, self.seq_len = corpus, tokenizer, batch_size, seq_len
        self.seed, self.shuffle, self.num_epochs = seed, shuffle, num_epochs
        self.epoch = self.index = self.offset = self.position = 0
        self._order_cache: tuple[int, np.ndarray] | None = None
        self._doc_cache: tuple[int, int, np.ndarray] | None = None

    def _order(self) -> np.ndarray:
        if self._order_cache is None or self._order_cache[0] != self.epoch:
            n = len(self.corpus)
            order = (np.random.default_rng([self.seed, self.epoch]).permutation(n) if self.shuffle
                     else np.arange(n))
            self._order_cache = (self.epoch, order)
        return self._order_cache[1]

    def _document(self) -> np.ndarray:
        """Token ids (with BOS/EOS) of the document at the cursor."""
        key = (self.epoch, self.index)
        if self._doc_cache is None or self._doc_cache[:2] != key:
            ids = self.tok.encode(self.corpus[int(self._order()[self.index])])
            doc = np.concatenate([[self.tok.bos_id], ids, [self.tok.eos_id]]).astype(np.int32)
            self._doc_cache = (*key, doc)
        return self._doc_cache[2]

    def _exhausted(self) -> bool:
        return self.num_epochs is not None and self.epoch >= self.num_epochs

    def _row(self) -> dict[str, np.ndarray]:
        tokens = np.full(self.seq_len, self.tok.pad_id, np.int32)
        segment_ids = np.zeros(self.seq_len, np.int32)
        filled = segment = 0
        while filled < self.seq_len and not self._exhausted():
            doc = self._document()
            part = doc[self.offset: self.offset + self.seq_len - filled]
            segment += 1
            tokens[filled: filled + len(part)] = part
            segment_ids[filled: filled + len(part)] = segment
            filled += len(part)
            self.offset += len(part)
            if self.offset == len(doc):
                self.index, self.offset = self.index + 1, 0
                if self.index == len(self.corpus):
                    self.epoch, self.index = self.epoch + 1, 0
        # offset > 0: the cursor is still inside the row's last document, whose next token is there.
        next_token = int(self._document()[self.offset]) if self.offset > 0 else None
        labels, loss_mask = row_targets(tokens, segment_ids, next_token, self.tok.pad_id)
        return {"tokens": tokens, "segment_ids": segment_ids, "labels": labels, "loss_mask": loss_mask}

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._exhausted():
            raise StopIteration
        rows = [self._row() for _ in range(self.batch_size)]
        self.position += 1
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

    def get_state(self) -> dict:
        return {"kind": "packed", "seed": self.seed, "num_documents": len(self.corpus),
                "epoch": self.epoch, "index": self.index, "offset": self.offset, "position": self.position}

    def set_state(self, state: dict) -> None:
        expected = {"kind": "packed", "seed": self.seed, "num_documents": len(self.corpus)}
        if any(state.get(k) != v for k, v in expected.items()):
            raise ValueError(f"data state {state} does not match this corpus iterator {expected}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self.offset, self.position = int(state["offset"]), int(state["position"])
