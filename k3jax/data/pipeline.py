"""``make_batches``: the ``TrainConfig.data`` sources of this package behind one call.

Sources (``cfg.data.source``):

- ``"copy"``: the synthetic copy task (`k3jax.data.copy`), options ``cfg.data.copy``.
- ``"text"``: local files at ``cfg.data.path`` (a file or a directory), options ``cfg.data.text``.
- ``"stdlib"``: the running interpreter's standard-library ``*.py`` files (no download).

Text sources are tokenised (K3 BPE or bytes) and packed (`k3jax.data.packing`). The train split
is shuffled per epoch and endless; the validation split is one pass in file order, its last batch
padded. Everything that can be wrong with the data (path, format, field, tokenizer, an empty
split, a vocabulary larger than the model's) raises ``ValueError`` here, before any compute.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from k3jax.data.config import SPLITS
from k3jax.data.copy import CopyBatches
from k3jax.data.packing import PackedBatches
from k3jax.data.sources import Corpus, list_files, stdlib_corpus
from k3jax.data.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from k3jax.train.config import TrainConfig

SOURCES = ("copy", "text", "stdlib")


def make_batches(cfg: TrainConfig, *, split: str = "train") -> CopyBatches | PackedBatches:
    """The batch iterator of ``cfg.data`` (``[cfg.batch_size, cfg.seq_len]`` dicts, with
    ``get_state``/``set_state`` for exact resume)."""
    d = cfg.data
    if split not in SPLITS:
        raise ValueError(f"split={split!r} must be one of {SPLITS}")
    if d.source == "copy":
        return CopyBatches(d.copy, cfg.batch_size, cfg.seq_len, cfg.model.vocab_size, d.seed)
    if d.source not in SOURCES:
        raise ValueError(f"data.source={d.source!r} must be one of {SOURCES} (or 'recall'/'random', "
                         "built into k3jax.train)")
    text = d.text
    if d.source == "stdlib":
        corpus = stdlib_corpus(split, text.validation_fraction)
        where = "the standard library"
    else:
        if d.path is None:
            raise ValueError("data.path must name a file or directory for data.source='text'")
        files, root, fmt = list_files(d.path, text.format)
        corpus = Corpus(files, root, fmt, text_field=text.text_field, split=split,
                        validation_fraction=text.validation_fraction)
        where = f"data.path={d.path!r}"
    if len(corpus) == 0:
        raise ValueError(f"split={split!r} of {where} is empty ({corpus.num_total} documents in all, "
                         f"text.validation_fraction={text.validation_fraction}); add documents or change "
                         "the fraction")
    tokenizer = load_tokenizer(text.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"text.tokenizer={text.tokenizer!r} has {tokenizer.vocab_size} ids; the model has "
                         f"vocab_size={cfg.model.vocab_size} (the byte tokenizer needs 256)")
    train = split == "train"
    return PackedBatches(corpus, tokenizer, cfg.batch_size, cfg.seq_len, seed=d.seed,
                         shuffle=train, num_epochs=None if train else 1)
