"""Read the shards of a Hugging Face checkpoint's tree leaves, touching only the shards' bytes.

Every ``hf_keys`` layout's ``to_tree`` is a transpose, an axis split, a unit-axis reshape or a crop
of the HF tensor, so on a memory-mapped tensor it is a zero-copy view: indexing that view with a
shard's index and copying the result reads only that shard's bytes from the file. Routed-expert
stacks ``[E, in, out]`` read only the experts a shard covers and, for MXFP4, only the packed bytes
and scales of its rows and 32-column groups, dequantised per shard.

``HFSource.leaf`` builds one leaf as a ``jax.Array`` with ``jax.make_array_from_callback``: each
process calls back only for its addressable shards, so no host reads (or holds) more than its
share. ``HFSource.stacked_leaf`` does the same for a scanned stack's leaf ``[repeats, ...]`` made
of several layers' tensors: a shard is a block of rows (layers), each the same block of its
layer's tensor, so the reads stay the shard's own bytes. ``HFSource.bytes_read`` counts the bytes each read asks of the files (per process), which
the tests compare with the process's shard share.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence

import jax
import numpy as np
from jaxtyping import Array

from k3jax.config import ModelConfig
from k3jax.convert import mxfp4
from k3jax.convert.hf_config import from_hf_config
from k3jax.convert.hf_keys import LAYOUTS, Entry, KeyEntry
from k3jax.convert.hf_checks import mxfp4_keys, checked_table
from k3jax.convert.safetensors_io import SafetensorsReader

Index = tuple[slice, ...]


def _normalise(index: Index, shape: tuple[int, ...]) -> Index:
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    out = tuple(slice(*s.indices(n)) for s, n in zip(index, shape))
    if any(s.step != 1 for s in out):
        raise ValueError(f"shard index {index} must use unit steps (a contiguous block)")
    return out


def _mxfp4_block(packed: np.ndarray, scale: np.ndarray, rows: slice, cols: slice,
                 name: str) -> tuple[np.ndarray, int]:
    """The float32 block ``[rows, cols]`` of an MXFP4 matrix, decoding only the groups it covers."""
    g0, g1 = cols.start // mxfp4.GROUP, -(-cols.stop // mxfp4.GROUP)
    p = np.ascontiguousarray(packed[rows, g0 * mxfp4.GROUP // 2:g1 * mxfp4.GROUP // 2])
    s = np.ascontiguousarray(scale[rows, g0:g1])
    offset = g0 * mxfp4.GROUP
    return mxfp4.decode(p, s, name=name)[:, cols.start - offset:cols.stop - offset], p.nbytes + s.nbytes


class HFSource:
    """A checked Hugging Face folder: its config, its entries, and reads of leaf shards."""

    def __init__(self, path: str, cfg: ModelConfig | None = None):
        self.path = path
        if cfg is None:
            try:
                cfg = from_hf_config(path)
            except ValueError as err:
                raise ValueError(f"{os.path.join(path, 'config.json')}: {err}") from None
        self.cfg = cfg
        self.reader = SafetensorsReader(path)
        self.table = checked_table(self.cfg, self.reader)  # every header checked before any data is read
        self.bytes_read = 0

    @functools.cached_property
    def multimodal(self):
        """The ``MultimodalConfig`` when ``config.json`` has a ``vision_config`` and the folder holds tower
        or projector tensors (their keys, shapes and dtypes checked from the headers), else None: a
        ``vision_config`` without those tensors is a text-only release (as the tiny K3 oracle's). Only
        the conversion asks (the text loader skips the tower)."""
        from k3jax.vision.checkpoint import check_vision_keys, multimodal_config
        from k3jax.vision.hf_keys import VISION_PREFIXES, vision_entries

        if not any(k.startswith(VISION_PREFIXES) for k in self.reader.keys()):
            return None
        try:
            mm = multimodal_config(self.path, self.cfg)
            if mm is not None:
                check_vision_keys(vision_entries(mm.vision, self.cfg.hidden), self.reader)
        except ValueError as err:
            raise ValueError(f"{self.path}: {err}") from None
        return mm

    @property
    def mxfp4(self) -> bool:
        """Whether the routed experts are stored as MXFP4 (the K3 release format)."""
        return any(e.is_experts and e.expert_key(0) not in self.reader for e in self.table)

    @property
    def hf_dtype(self) -> np.dtype:
        """The dtype the checkpoint stores its (non-fp32) weights in: the embedding's."""
        return self.reader.infos[self.table[0].hf].dtype

    def _plain(self, key: str, view_of, index: Index) -> np.ndarray:
        block = view_of(self.reader.get(key))[index]
        self.bytes_read += block.nbytes
        return block

    def _expert(self, entry: KeyEntry, e: int, index: Index) -> np.ndarray:
        """Tree block ``[in, out][index]`` of expert ``e`` (HF ``[out, in]``, layout ``T``)."""
        key = entry.expert_key(e)
        if key in self.reader:
            return self._plain(key, lambda a: LAYOUTS[entry.layout].to_tree(a, entry.shape[1:]), index)
        packed_key, scale_key = mxfp4_keys(key)
        block, nbytes = _mxfp4_block(self.reader.get(packed_key), self.reader.get(scale_key),
                                     index[1], index[0], packed_key)
        self.bytes_read += nbytes
        return block.T

    def read(self, entry: KeyEntry, index: Index, dtype) -> np.ndarray:
        """The block ``index`` of ``entry``'s tree leaf, as ``dtype``, reading only its bytes."""
        index = _normalise(index, entry.shape)
        if not entry.is_experts:
            view_of = lambda a: LAYOUTS[entry.layout].to_tree(a, entry.shape)  # noqa: E731
            return self._plain(entry.hf, view_of, index).astype(dtype)
        experts = range(index[0].start, index[0].stop)
        out = np.empty((len(experts),) + tuple(s.stop - s.start for s in index[1:]), dtype)
        for j, e in enumerate(experts):
            out[j] = self._expert(entry, e, index[1:])
        return out

    def leaf(self, entry: KeyEntry, sharding: jax.sharding.Sharding, dtype) -> Array:
        """``entry``'s leaf as a ``jax.Array`` on ``sharding``; only addressable shards are read, each
        distinct block once (replicas on several local devices share one read)."""
        blocks: dict[tuple, np.ndarray] = {}

        def block(index: Index) -> np.ndarray:
            key = tuple((s.start, s.stop) for s in _normalise(index, entry.shape))
            if key not in blocks:
                blocks[key] = self.read(entry, index, dtype)
            return blocks[key]

        leaf = jax.make_array_from_callback(entry.shape, sharding, block)
        self.reader.release()  # a streaming conversion keeps no more of the files mapped than one leaf
        return leaf


    def stacked_leaf(self, parts: Sequence[Entry], sharding: jax.sharding.Sharding, dtype) -> Array:
        """The layers ``parts`` (alike entries, in row order) stacked as one ``[len(parts), ...]`` leaf
        on ``sharding``; each addressable block reads only its rows' blocks."""
        shape = (len(parts),) + parts[0].shape
        blocks: dict[tuple, np.ndarray] = {}

        def block(index: Index) -> np.ndarray:
            rows, *rest = _normalise(index, shape)
            key = tuple((s.start, s.stop) for s in (rows, *rest))
            if key not in blocks:
                blocks[key] = np.stack([self.read(parts[r], tuple(rest), dtype) for r in range(rows.start, rows.stop)])
            return blocks[key]

        leaf = jax.make_array_from_callback(shape, sharding, block)
        self.reader.release()
        return leaf


    def vision_leaf(self, entry, sharding: jax.sharding.Sharding, dtype) -> Array:
        """A vision tower / projector leaf (``k3jax.vision.hf_keys.VisionEntry``) on ``sharding``: read
        whole (at most tens of MB, and replicated by the model's rules), sliced per shard."""
        from k3jax.vision.checkpoint import read_tensor

        value = read_tensor(self.reader, entry, dtype)
        self.bytes_read += self.reader.infos[entry.hf].end - self.reader.infos[entry.hf].begin
        leaf = jax.make_array_from_callback(entry.shape, sharding, lambda index: value[index])
        self.reader.release()
        return leaf


def leaf_nbytes(entry: KeyEntry, dtype) -> int:
    return math.prod(entry.shape) * np.dtype(dtype).itemsize
