"""Corpora: the standard library (deterministic, split by hash), txt / jsonl / parquet readers on
temporary files, and the errors of ``make_batches`` for bad data arguments."""

import dataclasses
import json

import numpy as np
import pytest

from k3jax.data import CopyConfig, TextConfig, make_batches
from k3jax.data.sources import Corpus, list_files, stdlib_corpus
from k3jax.train.config import DataConfig, TrainConfig


def _cfg(source="text", path=None, batch_size=2, seq_len=32, **text):
    return TrainConfig(data=DataConfig(source=source, path=None if path is None else str(path),
                                       text=TextConfig(**text)), batch_size=batch_size, seq_len=seq_len)


def test_stdlib_deterministic_and_split():
    train, val = stdlib_corpus("train"), stdlib_corpus("validation")
    again = stdlib_corpus("train")
    assert len(train) > 500 and len(val) > 10
    assert train.num_total == len(train) + len(val)
    assert 0.02 < len(val) / train.num_total < 0.1  # validation_fraction=0.05
    np.testing.assert_array_equal(train.file_of, again.file_of)
    names = lambda c: {c.files[i].as_posix() for i in c.file_of}
    assert not names(train) & names(val)
    assert not any("site-packages" in n for n in names(train))
    assert train[0] == again[0] and sum(len(train[i]) for i in range(20)) > 0


def test_txt_directory(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("second ✓")
    (tmp_path / "a.txt").write_text("first\n\nparagraph")
    (tmp_path / "sub" / "c.txt").write_text("")
    (tmp_path / "ignored.csv").write_text("x,y")
    files, root, fmt = list_files(tmp_path, None)
    assert fmt == "txt" and [f.relative_to(root).as_posix() for f in files] == ["a.txt", "b.txt", "sub/c.txt"]
    corpus = Corpus(files, root, fmt, validation_fraction=0.0)
    assert [corpus[i] for i in range(len(corpus))] == ["first\n\nparagraph", "second ✓"]  # empty c.txt: none


@pytest.mark.parametrize("content, match", [
    (b"", "empty or whitespace only"),
    (b" \n\t\n", "empty or whitespace only"),
    (b"ok\xff\xfe text", r"not UTF-8 text \(undecodable byte 0xff at offset 2\)"),
])
def test_empty_whitespace_or_undecodable_txt_is_an_error_naming_the_file(tmp_path, content, match):
    (tmp_path / "data.txt").write_bytes(content)
    with pytest.raises(ValueError, match=match) as err:
        make_batches(_cfg(path=tmp_path / "data.txt"))
    assert str(tmp_path / "data.txt") in str(err.value)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.txt").write_bytes(content)
    (tmp_path / "dir" / "b.txt").write_bytes(b"")
    with pytest.raises(ValueError, match=match):
        make_batches(_cfg(path=tmp_path / "dir"))


def test_jsonl(tmp_path):
    rows = [{"body": "héllo", "id": 1}, {"body": "wörld\n"}, {"body": ""}]
    lines = [json.dumps(r, ensure_ascii=False) for r in rows]
    (tmp_path / "d.jsonl").write_text(lines[0] + "\n\n" + lines[1] + "\n   \n" + lines[2])  # blank lines, no final \n
    corpus = Corpus([tmp_path / "d.jsonl"], tmp_path, "jsonl", text_field="body", validation_fraction=0.0)
    assert [corpus[i] for i in range(len(corpus))] == ["héllo", "wörld\n", ""]
    with pytest.raises(ValueError, match="text_field='text'"):
        Corpus([tmp_path / "d.jsonl"], tmp_path, "jsonl")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": 3}) + "\n")
    with pytest.raises(ValueError, match="must be a string"):
        Corpus([tmp_path / "bad.jsonl"], tmp_path, "jsonl")


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="parquet needs the optional 'pyarrow' package")
    import pyarrow.parquet as pq

    texts = [f"document {i} " * (i + 1) for i in range(10)]
    pq.write_table(pa.table({"content": texts, "n": list(range(10))}), tmp_path / "p.parquet", row_group_size=3)
    corpus = Corpus([tmp_path / "p.parquet"], tmp_path, "parquet", text_field="content", validation_fraction=0.0)
    assert [corpus[i] for i in range(len(corpus))] == texts
    with pytest.raises(ValueError, match="text_field='text' must be one of its columns"):
        Corpus([tmp_path / "p.parquet"], tmp_path, "parquet")
    batch = next(make_batches(_cfg(path=tmp_path / "p.parquet", text_field="content")))
    assert batch["tokens"].shape == (2, 32)


def test_make_batches_text_contract(tmp_path):
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": f"doc {i} " * 7}) for i in range(40)))
    it = make_batches(_cfg(path=tmp_path, batch_size=3, seq_len=16))
    batch = next(it)
    assert set(batch) == {"tokens", "segment_ids", "labels", "loss_mask"}
    for key, dtype in [("tokens", np.int32), ("segment_ids", np.int32), ("labels", np.int32),
                       ("loss_mask", np.float32)]:
        assert batch[key].shape == (3, 16) and batch[key].dtype == dtype
    val = list(make_batches(_cfg(path=tmp_path, batch_size=3, seq_len=16, validation_fraction=0.5),
                            split="validation"))
    assert 0 < len(val) and (val[-1]["segment_ids"][-1] == 0).any()  # one finite pass, padded at the end
    assert json.loads(json.dumps(it.get_state())) == it.get_state()


def test_make_batches_errors(tmp_path):
    with pytest.raises(ValueError, match="data.path='/no/such/dir' does not exist"):
        make_batches(_cfg(path="/no/such/dir"))
    with pytest.raises(ValueError, match="data.path must name"):
        make_batches(_cfg())
    with pytest.raises(ValueError, match="data.source='csv'"):
        make_batches(_cfg(source="csv"))
    with pytest.raises(ValueError, match="format='csv'"):
        TextConfig(format="csv")
    with pytest.raises(ValueError, match="split='test'"):
        make_batches(_cfg(source="stdlib"), split="test")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no files"):
        make_batches(_cfg(path=tmp_path / "empty"))
    (tmp_path / "blank.jsonl").write_text("\n \n")
    with pytest.raises(ValueError, match="blank.jsonl is empty or whitespace only"):
        make_batches(_cfg(path=tmp_path / "blank.jsonl"))
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text("a")
    (tmp_path / "mixed" / "b.jsonl").write_text('{"text": "b"}')
    with pytest.raises(ValueError, match="cannot infer the format"):
        make_batches(_cfg(path=tmp_path / "mixed"))
    small = _cfg(source="stdlib")
    small = dataclasses.replace(small, model=dataclasses.replace(small.model, vocab_size=200))
    with pytest.raises(ValueError, match="vocab_size=200"):
        make_batches(small)
    with pytest.raises(ValueError, match="seq_len=16 must be >= 66"):
        make_batches(dataclasses.replace(_cfg(source="copy", seq_len=16),
                                         data=DataConfig(source="copy", copy=CopyConfig())))
