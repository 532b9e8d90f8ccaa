"""Byte tokenizer round trip and special ids; the K3 tiktoken tokenizer on a small synthetic BPE."""

import base64
import json
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from k3jax.data.tokenizer import MAX_RUN_CHARS, ByteTokenizer, _bounded_pieces, load_tokenizer


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.min(initial=0) >= 0 and ids.max(initial=0) < tok.vocab_size
    assert tok.decode(ids) == text
    assert len(ids) == len(text.encode("utf-8"))


def test_byte_special_ids():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (256, 0, 2, 3)
    ids = np.concatenate([[tok.bos_id], tok.encode("héllo"), [tok.eos_id, tok.pad_id]])
    assert tok.decode(ids, skip_special=True) == "héllo"
    assert tok.decode(ids) == "\x02héllo\x03\x00"
    with pytest.raises(ValueError, match="ids must lie in"):
        tok.decode([256])


def test_bounded_pieces_cover_text():
    text = "a" * (3 * MAX_RUN_CHARS + 5) + "  x\n" * 50_000 + " " * (MAX_RUN_CHARS + 1)
    pieces = _bounded_pieces(text)
    assert "".join(pieces) == text
    assert len(pieces) > 3 and max(len(p) for p in pieces) <= 400_000


def _write_bpe(directory, merges):
    """A tiktoken.model of the 256 bytes plus ``merges`` (each a concatenation of earlier tokens)."""
    tokens = [bytes([b]) for b in range(256)] + [m.encode() for m in merges]
    lines = [f"{base64.b64encode(t).decode()} {rank}" for rank, t in enumerate(tokens)]
    (directory / "tiktoken.model").write_text("\n".join(lines) + "\n")
    n = len(tokens)
    config = {"added_tokens_decoder": {str(n): {"content": "[BOS]", "special": True},
                                       str(n + 1): {"content": "[EOS]", "special": True},
                                       str(n + 2): {"content": "<|im_end|>", "special": True}},
              "bos_token": "[BOS]", "eos_token": {"content": "[EOS]"}}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return n


def test_kimi_tokenizer(tmp_path):
    pytest.importorskip("tiktoken", reason="the K3 tokenizer needs the optional 'tiktoken' package")
    num_base = _write_bpe(tmp_path, ["th", "the", "he", " the"])
    tok = load_tokenizer(str(tmp_path))
    assert tok.vocab_size == num_base + 258
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (num_base, num_base + 1, num_base + 1)
    ids = tok.encode("the theory")
    assert tok.decode(ids) == "the theory"
    assert len(ids) < len("the theory")  # merges were applied
    for text in ["混合注意力 and the MoE's 123456 [BOS] <|im_end|>\r\n\n  end", "a" * (MAX_RUN_CHARS + 10)]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert ids.max() < num_base  # special-token text in a document stays plain text


def test_tokenizer_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="tokenizer='/nonexistent' does not exist"):
        load_tokenizer("/nonexistent")
    with pytest.raises(ValueError, match="tiktoken.model"):
        load_tokenizer(str(tmp_path))
    _write_bpe(tmp_path, [])
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "tiktoken.load", None)
    with pytest.raises(ValueError, match="needs the 'tiktoken' package"):
        load_tokenizer(str(tmp_path))
