"""Data for k3jax: the copy task, local text (txt / jsonl / parquet), the standard-library corpus,
the K3 and byte tokenizers, and packing with segment ids. Entry point: `make_batches`."""

from k3jax.data.config import CopyConfig, TextConfig
from k3jax.data.copy import CopyBatches
from k3jax.data.packing import PackedBatches, row_targets
from k3jax.data.pipeline import make_batches
from k3jax.data.sources import Corpus, list_files, stdlib_corpus
from k3jax.data.tokenizer import ByteTokenizer, KimiTokenizer, load_tokenizer

__all__ = ["ByteTokenizer", "CopyBatches", "CopyConfig", "Corpus", "KimiTokenizer", "PackedBatches",
           "TextConfig", "list_files", "load_tokenizer", "make_batches", "row_targets", "stdlib_corpus"]
