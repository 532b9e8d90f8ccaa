"""Options of the ``k3jax.data`` sources, as frozen sections of ``TrainConfig.data``.

They live here rather than in ``k3jax.train.config`` so that this package never imports the
trainer; ``DataConfig`` holds one of each.
"""

from __future__ import annotations

import dataclasses

TEXT_FORMATS = ("txt", "jsonl", "parquet")
SPLITS = ("train", "validation")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclasses.dataclass(frozen=True)
class CopyConfig:
    """The copy task: ``BOS s_1 … s_L SEP s_1 … s_L``, L uniform in [min_length, max_length] per row,
    symbols uniform over ``num_symbols``; only the copy is a target."""

    min_length: int = 8
    max_length: int = 32
    num_symbols: int = 64

    def __post_init__(self):
        _require(self.min_length >= 1, f"min_length={self.min_length} must be >= 1")
        _require(self.max_length >= self.min_length,
                 f"max_length={self.max_length} must be >= min_length={self.min_length}")
        _require(self.num_symbols >= 2, f"num_symbols={self.num_symbols} must be >= 2")


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """Real text, packed into rows with segment ids.

    ``format``: "txt" (a file is one document), "jsonl" (a line is one document, its
    ``text_field``), "parquet" (a row is one document, column ``text_field``); None infers it from
    the file extension. ``tokenizer``: a directory with the K3 release's ``tiktoken.model`` and
    ``tokenizer_config.json``; None: the byte tokenizer (256 ids). ``validation_fraction`` of the
    documents, chosen by a hash of their name, form the validation split.
    """

    format: str | None = None
    text_field: str = "text"
    tokenizer: str | None = None
    validation_fraction: float = 0.05

    def __post_init__(self):
        _require(self.format is None or self.format in TEXT_FORMATS,
                 f"format={self.format!r} must be one of {TEXT_FORMATS} or None (from the file extension)")
        _require(bool(self.text_field), f"text_field={self.text_field!r} must be a non-empty name")
        _require(0 <= self.validation_fraction < 1,
                 f"validation_fraction={self.validation_fraction} must be in [0, 1)")
