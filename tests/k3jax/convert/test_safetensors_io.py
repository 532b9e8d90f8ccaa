"""The streaming safetensors reader/writer agrees with the safetensors package itself."""

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from k3jax.convert.safetensors_io import INDEX_NAME, PendingTensor, SafetensorsReader, write_folder


def _tensors():
    rng = np.random.default_rng(0)
    return {
        "a.weight": rng.normal(size=(3, 5)).astype(ml_dtypes.bfloat16),
        "b.bias": rng.normal(size=(7,)).astype(np.float32),
        "c.packed": rng.integers(0, 255, size=(4, 2)).astype(np.uint8),
        "d.conv": rng.normal(size=(6, 1, 4)).astype(np.float64),
    }


def _pending(tensors):
    return [(k, PendingTensor(v.shape, v.dtype, lambda v=v: v)) for k, v in tensors.items()]


@pytest.mark.parametrize("max_shard_bytes", [1 << 30, 64])
def test_write_then_read(tmp_path, max_shard_bytes):
    tensors = _tensors()
    files = write_folder(str(tmp_path), _pending(tensors), max_shard_bytes=max_shard_bytes)
    assert (len(files) == 1) == (max_shard_bytes > 1000)
    reader = SafetensorsReader(str(tmp_path))
    assert reader.keys() == sorted(tensors)
    for key, value in tensors.items():
        got = reader.get(key)
        assert got.dtype == value.dtype and got.shape == value.shape
        assert np.array_equal(got.view(np.uint8), value.view(np.uint8))
    # The official library reads the same bytes from every shard.
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    for file in set(index["weight_map"].values()):
        # numpy cannot hold bf16 there and flax narrows f64 without x64: each key through the one that fits.
        for framework in ("numpy", "flax"):
            with safe_open(str(tmp_path / file), framework) as f:
                assert f.metadata() == {"format": "pt"}
                for key in f.keys():
                    if (tensors[key].dtype == ml_dtypes.bfloat16) == (framework == "flax"):
                        got = np.asarray(f.get_tensor(key))
                        assert np.array_equal(got.view(np.uint8), tensors[key].view(np.uint8)), key


def test_reader_rejects_inconsistent_index(tmp_path):
    write_folder(str(tmp_path), _pending(_tensors()))
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    index["weight_map"]["ghost.weight"] = "model.safetensors"
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="absent from the shards"):
        SafetensorsReader(str(tmp_path))


def test_reader_rejects_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="path="):
        SafetensorsReader(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        SafetensorsReader(str(tmp_path))


def test_writer_checks_declared_shape(tmp_path):
    bad = [("x", PendingTensor((2, 2), np.dtype(np.float32), lambda: np.zeros((2, 3), np.float32)))]
    with pytest.raises(ValueError, match="declared"):
        write_folder(str(tmp_path), bad)
