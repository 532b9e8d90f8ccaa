"""Streaming reads and writes of (sharded) safetensors folders.

The safetensors format is an 8-byte little-endian header length, a JSON header
``{key: {dtype, shape, data_offsets}}`` and the raw little-endian tensor bytes. Reading maps the
shard files into memory (``np.memmap``) and returns zero-copy views, one tensor at a time; writing
takes a thunk per tensor and materialises one tensor at a time. Both sides speak bfloat16 through
``ml_dtypes`` (the ``safetensors`` package's numpy backend cannot represent it); the tests check
files written here against ``safetensors.safe_open``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Callable, Iterable

import ml_dtypes
import numpy as np

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_code(dtype) -> str:
    """The safetensors dtype string of a numpy / ml_dtypes dtype."""
    dtype = np.dtype(dtype)
    if dtype not in _NAMES:
        raise ValueError(f"dtype={dtype} must be one of {sorted(str(d) for d in _NAMES)}")
    return _NAMES[dtype]


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


def _read_header(file: str) -> tuple[dict, dict[str, TensorInfo]]:
    """Header of one shard, every entry checked against the file's size before any data is read."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{file}: truncated ({size} bytes), not a safetensors file")
        (n,) = struct.unpack("<Q", prefix)
        if 8 + n > size:
            raise ValueError(f"{file}: header length {n} runs past the end of the file ({size} bytes); truncated?")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{file}: header is not valid JSON ({err})") from None
    metadata = header.pop("__metadata__", {}) or {}
    infos = {}
    for key, entry in header.items():
        if entry["dtype"] not in DTYPES:
            raise ValueError(f"{file}: tensor {key!r} has dtype {entry['dtype']!r}, "
                             f"expected one of {sorted(DTYPES)}")
        begin, end = (8 + n + o for o in entry["data_offsets"])
        info = TensorInfo(file, DTYPES[entry["dtype"]], tuple(entry["shape"]), begin, end)
        _check_extent(key, info, size)
        infos[key] = info
    return metadata, infos


def _check_extent(key: str, info: TensorInfo, size: int) -> None:
    nbytes = int(np.prod(info.shape, dtype=np.int64)) * info.dtype.itemsize
    if info.end - info.begin != nbytes:
        raise ValueError(f"{info.file}: tensor {key!r} spans {info.end - info.begin} bytes but its shape "
                         f"{info.shape} and dtype {info.dtype} need {nbytes}")
    if info.end > size:
        raise ValueError(f"{info.file}: tensor {key!r} ends at byte {info.end}, past the end of the file "
                         f"({size} bytes); truncated?")


class SafetensorsReader:
    """All tensors of a folder: ``model.safetensors.index.json`` shards, or every ``*.safetensors`` file."""

    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise ValueError(f"path={path!r} must be a folder holding a Hugging Face checkpoint")
        self.path = path
        index = os.path.join(path, INDEX_NAME)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            weight_map = None
            files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        if not files:
            raise ValueError(f"path={path!r} holds no *.safetensors files")
        self.infos: dict[str, TensorInfo] = {}
        for name in files:
            file = os.path.join(path, name)
            if not os.path.isfile(file):
                key = next(k for k, v in weight_map.items() if v == name)
                raise ValueError(f"{file} is missing: {INDEX_NAME} names it for tensor {key!r}")
            _, infos = _read_header(file)
            for key, info in infos.items():
                if key in self.infos:
                    raise ValueError(f"tensor {key!r} appears in two shards: {self.infos[key].file}, {info.file}")
                if weight_map is not None and weight_map.get(key) != name:
                    raise ValueError(f"tensor {key!r} is in {name} but the index says {weight_map.get(key)!r}")
                self.infos[key] = info
        if weight_map is not None and set(weight_map) != set(self.infos):
            missing = sorted(set(weight_map) - set(self.infos))[:3]
            raise ValueError(f"{INDEX_NAME} lists tensors absent from the shards, e.g. {missing}")
        self._maps: dict[str, np.memmap] = {}

    def keys(self) -> list[str]:
        return sorted(self.infos)

    def __contains__(self, key: str) -> bool:
        return key in self.infos

    def release(self) -> None:
        """Unmap the shard files: the pages read so far leave this process's resident set (the
        views handed out keep their own mapping alive until they are dropped)."""
        self._maps.clear()

    def get(self, key: str) -> np.ndarray:
        """A read-only, zero-copy view of one tensor."""
        info = self.infos[key]
        if info.file not in self._maps:
            self._maps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
        raw = self._maps[info.file][info.begin:info.end]
        return raw.view(info.dtype).reshape(info.shape)


@dataclasses.dataclass(frozen=True)
class PendingTensor:
    """A tensor to write: its shape and dtype now, its values when ``make()`` is called."""

    shape: tuple[int, ...]
    dtype: np.dtype
    make: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def _shards(items: list[tuple[str, PendingTensor]], max_bytes: int) -> list[list[tuple[str, PendingTensor]]]:
    shards, current, size = [], [], 0
    for item in items:
        if current and size + item[1].nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(item)
        size += item[1].nbytes
    shards.append(current)
    return shards


def _write_file(file: str, items: list[tuple[str, PendingTensor]], metadata: dict[str, str]) -> None:
    header: dict = {"__metadata__": metadata}
    offset = 0
    for key, t in items:
        header[key] = {"dtype": dtype_code(t.dtype), "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format aligns the data section to 8 bytes
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for key, t in items:
            value = np.ascontiguousarray(t.make())
            if value.shape != tuple(t.shape) or value.dtype != np.dtype(t.dtype):
                raise ValueError(f"tensor {key!r}: made {value.shape} {value.dtype}, declared {t.shape} {t.dtype}")
            f.write(value.astype(value.dtype.newbyteorder("<"), copy=False).tobytes())


def write_folder(path: str, tensors: Iterable[tuple[str, PendingTensor]], *,
                 max_shard_bytes: int = 5 << 30) -> list[str]:
    """Write ``tensors`` as safetensors shards plus ``model.safetensors.index.json``; returns the files."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be > 0")
    os.makedirs(path, exist_ok=True)
    items = sorted(tensors, key=lambda kv: kv[0])
    shards = _shards(items, max_shard_bytes)
    names = ([SINGLE_NAME] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map = {}
    for name, shard in zip(names, shards):
        _write_file(os.path.join(path, name), shard, {"format": "pt"})
        weight_map.update({key: name for key, _ in shard})
    index = {"metadata": {"total_size": sum(t.nbytes for _, t in items)}, "weight_map": weight_map}
    with open(os.path.join(path, INDEX_NAME), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    return names
