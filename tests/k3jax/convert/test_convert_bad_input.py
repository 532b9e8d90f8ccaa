"""Every bad input of hf-to-orbax is one clear error naming the file and the key, raised before
anything is written (no DST, no DST.incomplete), through the API and as one CLI line."""

import json
import shutil
import struct

import pytest

from k3jax.convert.__main__ import main
from k3jax.convert.convert import hf_to_orbax
from k3jax.convert.safetensors_io import INDEX_NAME, SINGLE_NAME

ORACLE = "/work/shared/oracle/tiny_a/hf_bf16"
KEY = "language_model.model.layers.0.mlp.up_proj.weight"  # BF16 [96, 64]


def _header(path):
    raw = (path / SINGLE_NAME).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(path, header, data):
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    (path / SINGLE_NAME).write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def _edit_header(path, fn):
    header, data = _header(path)
    fn(header)
    _write(path, header, data)


def _missing_shard(path):
    index = json.loads((path / INDEX_NAME).read_text())
    index["weight_map"][KEY] = "model-00002-of-00002.safetensors"
    (path / INDEX_NAME).write_text(json.dumps(index))


def _truncated(path):
    raw = (path / SINGLE_NAME).read_bytes()
    (path / SINGLE_NAME).write_bytes(raw[:-100])


def _offsets_past_end(path):
    def shift(h):
        begin, end = h[KEY]["data_offsets"]
        h[KEY]["data_offsets"] = [begin + 10**7, end + 10**7]
    _edit_header(path, shift)


def _wrong_shape(path):
    _edit_header(path, lambda h: h[KEY].update(shape=[64, 96]))


def _wrong_dtype(path):
    _edit_header(path, lambda h: h[KEY].update(dtype="I16"))


def _unknown_key(path):
    def add(h):
        h["language_model.model.layers.0.mlp.extra.weight"] = dict(h[KEY])
        index = json.loads((path / INDEX_NAME).read_text())
        index["weight_map"]["language_model.model.layers.0.mlp.extra.weight"] = SINGLE_NAME
        (path / INDEX_NAME).write_text(json.dumps(index))
    _edit_header(path, add)


def _missing_key(path):
    def drop(h):
        del h[KEY]
        index = json.loads((path / INDEX_NAME).read_text())
        del index["weight_map"][KEY]
        (path / INDEX_NAME).write_text(json.dumps(index))
    _edit_header(path, drop)


def _unsupported_family(path):
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(config))


CASES = {  # name: (corruption, (words the message must hold))
    "missing shard": (_missing_shard, ("model-00002-of-00002.safetensors", KEY, "missing")),
    "truncated file": (_truncated, (SINGLE_NAME, "past the end")),
    "offsets past end": (_offsets_past_end, (SINGLE_NAME, KEY, "past the end")),
    "wrong shape": (_wrong_shape, (SINGLE_NAME, KEY, "(64, 96)", "(96, 64)")),
    "wrong dtype": (_wrong_dtype, (SINGLE_NAME, KEY, "int16", "floating")),
    "unknown key": (_unknown_key, (SINGLE_NAME, "layers.0.mlp.extra.weight", "unexpected")),
    "missing key": (_missing_key, ("src:", KEY, "missing")),
    "unsupported family": (_unsupported_family, ("config.json", "model_type='llama'")),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_one_clear_error_before_any_write(tmp_path, capsys, name):
    corrupt, words = CASES[name]
    src = tmp_path / "src"
    shutil.copytree(ORACLE, src)
    for file in src.iterdir():
        file.chmod(0o644)
    corrupt(src)
    with pytest.raises(ValueError) as err:
        hf_to_orbax(str(src), str(tmp_path / "dst"))
    for word in words:
        assert word in str(err.value), (word, str(err.value))
    assert main(["hf-to-orbax", str(src), str(tmp_path / "dst"), "--no-progress"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0] == f"error: {err.value}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # nothing written


def test_bad_mesh_and_dtype_are_user_errors(tmp_path, capsys):
    assert main(["hf-to-orbax", ORACLE, str(tmp_path / "d"), "--mesh", "expert=x", "--no-progress"]) == 2
    assert "must be an integer" in capsys.readouterr().err
    assert main(["hf-to-orbax", ORACLE, str(tmp_path / "d"), "--mesh", "expert=3", "--no-progress"]) == 2
    assert "devices" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["hf-to-orbax", ORACLE, str(tmp_path / "d"), "--dtype", "float16"])
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_inspect_reports_key_problems_without_raising(tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(ORACLE, src)
    for file in src.iterdir():
        file.chmod(0o644)
    _wrong_shape(src)
    assert main(["inspect", str(src)]) == 1
    out = capsys.readouterr().out
    assert "problems: 1" in out and f"mis-shaped: {src / SINGLE_NAME}: tensor {KEY!r}" in out
