"""Tokenizers: the K3 release's tiktoken BPE when its files are given, else raw bytes.

Byte tokenizer (fits ``tiny()``'s vocab of 256): id = byte value for all 256 bytes, and three
control bytes double as the special ids

    PAD = 0 (NUL)   BOS = 2 (STX, "start of text")   EOS = 3 (ETX, "end of text")

These bytes essentially never occur in text; when they do, they keep their id, so
``decode(encode(s)) == s`` holds for every string, and the model just sees a spurious marker.
Document boundaries never rely on them anyway: packing marks documents with ``segment_ids``.

K3 tokenizer: ``tiktoken.model`` (base64 token, rank per line) holds the mergeable ranks; the
``num_base`` ranks are followed by 256 + 2 special ids named by ``added_tokens_decoder`` in
``tokenizer_config.json`` (unnamed ones are reserved), as Moonshot's ``tokenization_kimi.py`` builds
it; BOS/EOS/PAD are the ids of the config's ``bos_token``/``eos_token``/``pad_token``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

BYTE_PAD, BYTE_BOS, BYTE_EOS = 0, 2, 3
NUM_RESERVED_SPECIAL = 256 + 2

# The pre-tokenizer split of the Kimi releases (Han runs, case-aware words with English
# contractions, 1-3 digit groups, punctuation runs, newlines, spaces); tokenizing K3 data with any
# other split would yield ids the checkpoint never saw.
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
# tiktoken's Rust core panics on very long inputs and is quadratic on very long runs of
# (non-)whitespace (openai/tiktoken#195), so text is fed to it in bounded pieces.
MAX_CHUNK_CHARS = 400_000
MAX_RUN_CHARS = 25_000


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; PAD/BOS/EOS = NUL/STX/ETX (see the module docstring)."""

    vocab_size = 256
    pad_id, bos_id, eos_id = BYTE_PAD, BYTE_BOS, BYTE_EOS

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def decode(self, ids, skip_special: bool = False) -> str:
        ids = np.asarray(ids, np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() > 255):
            raise ValueError(f"ids must lie in [0, 256) for the byte tokenizer; got [{ids.min()}, {ids.max()}]")
        if skip_special:
            ids = ids[~np.isin(ids, (self.pad_id, self.bos_id, self.eos_id))]
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class KimiTokenizer:
    """The K3 BPE (tiktoken) from a release's ``tiktoken.model`` + ``tokenizer_config.json``."""

    def __init__(self, directory: str | Path):
        directory = Path(directory)
        model_file, config_file = directory / "tiktoken.model", directory / "tokenizer_config.json"
        for f in (model_file, config_file):
            if not f.is_file():
                raise ValueError(f"tokenizer={str(directory)!r} must be a directory holding {f.name}")
        try:
            import tiktoken
            from tiktoken.load import load_tiktoken_bpe
        except ImportError as err:
            raise ValueError(f"tokenizer={str(directory)!r} needs the 'tiktoken' package "
                             "(pip install tiktoken), or tokenizer=None for bytes") from err
        config = json.loads(config_file.read_text())
        ranks = load_tiktoken_bpe(str(model_file))
        names = {int(i): entry["content"] for i, entry in config.get("added_tokens_decoder", {}).items()}
        num_base = len(ranks)
        self.special = {names.get(i, f"<|reserved_token_{i}|>"): i
                        for i in range(num_base, num_base + NUM_RESERVED_SPECIAL)}
        self.encoding = tiktoken.Encoding(name=model_file.name, pat_str=KIMI_PATTERN,
                                          mergeable_ranks=ranks, special_tokens=self.special)
        self.vocab_size = self.encoding.n_vocab
        self.bos_id = self._special_id(config, "bos_token", required=True)
        self.eos_id = self._special_id(config, "eos_token", required=True)
        self.pad_id = self._special_id(config, "pad_token", required=False)
        if self.pad_id is None:  # padding is masked out everywhere, any id will do
            self.pad_id = self.eos_id

    def _special_id(self, config: dict, key: str, required: bool) -> int | None:
        token = config.get(key)
        if isinstance(token, dict):  # serialised AddedToken
            token = token.get("content")
        if token is None and not required:
            return None
        if token not in self.special:
            raise ValueError(f"tokenizer_config.json: {key}={token!r} must name one of the special tokens "
                             f"(ids {min(self.special.values())}..{max(self.special.values())})")
        return self.special[token]

    def encode(self, text: str) -> np.ndarray:
        # Special-token strings inside documents are plain text, never control ids.
        ids = [t for piece in _bounded_pieces(text)
               for t in self.encoding.encode(piece, disallowed_special=())]
        return np.asarray(ids, np.int32)

    def decode(self, ids) -> str:
        return self.encoding.decode([int(i) for i in np.asarray(ids).reshape(-1)])


def _bounded_pieces(text: str) -> list[str]:
    """Split ``text`` into pieces of at most MAX_CHUNK_CHARS whose runs of whitespace or
    non-whitespace are at most MAX_RUN_CHARS (cuts fall only at run boundaries or inside long runs)."""
    if len(text) <= MAX_RUN_CHARS:
        return [text]
    pieces, current, size = [], [], 0
    for run in re.findall(r"\s+|\S+", text):
        for start in range(0, len(run), MAX_RUN_CHARS):
            part = run[start:start + MAX_RUN_CHARS]
            if start > 0 or size + len(part) > MAX_CHUNK_CHARS:
                if current:
                    pieces.append("".join(current))
                current, size = [], 0
            current.append(part)
            size += len(part)
    if current:
        pieces.append("".join(current))
    return pieces


def load_tokenizer(directory: str | None) -> Tokenizer:
    """``KimiTokenizer(directory)``, or the byte tokenizer when ``directory`` is None."""
    if directory is None:
        return ByteTokenizer()
    if not Path(directory).exists():
        raise ValueError(f"tokenizer={directory!r} does not exist")
    return KimiTokenizer(directory)
