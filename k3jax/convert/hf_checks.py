"""Checks of a Hugging Face folder against a config, from the safetensors headers alone.

Every problem a checkpoint can have — a missing or unexpected key, a shape or dtype the config does
not expect, an MXFP4 pair of the wrong shape — is found here, before any tensor data is read, and
reported as a ``ValueError`` naming the file and the key. Routed experts may be stored plain or as
MXFP4 (``weight_packed`` + ``weight_scale``, the K3 release) expert by expert.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from k3jax.config import ModelConfig
from k3jax.convert import mxfp4
from k3jax.convert.hf_config import family
from k3jax.convert.hf_keys import Entry, entries, ignored_prefixes
from k3jax.convert.safetensors_io import SafetensorsReader

PACKED, SCALE = "weight_packed", "weight_scale"


def mxfp4_keys(key: str) -> tuple[str, str]:
    base = key.removesuffix("weight")
    return base + PACKED, base + SCALE


def resolve(entry: Entry, reader: SafetensorsReader) -> Entry:
    """The entry under the spelling the checkpoint uses (its ``hf`` key or one of its aliases)."""
    for alias in entry.aliases:
        if alias in reader and entry.hf not in reader:
            return dataclasses.replace(entry, hf=alias, aliases=())
    return entry


def expected_keys(table: list[Entry], reader: SafetensorsReader) -> set[str]:
    keys = set()
    for entry in table:
        if not entry.is_experts:
            keys.add(entry.hf)
            continue
        for e in range(entry.shape[0]):
            key = entry.expert_key(e)
            packed, _ = mxfp4_keys(key)
            keys.update(mxfp4_keys(key) if packed in reader and key not in reader else (key,))
    return keys


def _check_keys(cfg: ModelConfig, table: list[Entry], reader: SafetensorsReader) -> None:
    expected = expected_keys(table, reader)
    present = {k for k in reader.keys() if not k.startswith(ignored_prefixes(cfg))}
    missing, unexpected = sorted(expected - present), sorted(present - expected)
    where = f"for a {family(cfg)!r} checkpoint of this config"
    if missing:
        raise ValueError(f"{reader.path}: tensor {missing[0]!r} is missing {where} ({len(missing)} missing, "
                         f"e.g. {missing[:3]})")
    if unexpected:
        raise ValueError(f"{reader.infos[unexpected[0]].file}: tensor {unexpected[0]!r} is unexpected {where} "
                         f"({len(unexpected)} unexpected, "
                         f"e.g. {unexpected[:3]}); a checkpoint of another family or config?")


def _is_float(dtype: np.dtype) -> bool:
    return np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16"


def check_tensor(reader: SafetensorsReader, key: str, shape: tuple[int, ...]) -> None:
    """One HF matrix's header (or its MXFP4 pair's) against the config, before any data is read."""
    if key not in reader:
        for part, want in zip(mxfp4_keys(key), ((shape[0], shape[1] // 2), (shape[0], shape[1] // mxfp4.GROUP))):
            info = reader.infos[part]
            if info.shape != want or info.dtype != np.uint8:
                raise ValueError(f"{info.file}: tensor {part!r} is {info.dtype} {info.shape}, expected uint8 {want} "
                                 f"(MXFP4 of {shape})")
        return
    info = reader.infos[key]
    if info.shape != shape:
        raise ValueError(f"{info.file}: tensor {key!r} has shape {info.shape}, expected {shape} by the config")
    if not _is_float(info.dtype):
        raise ValueError(f"{info.file}: tensor {key!r} has dtype {info.dtype}, expected a floating dtype")


def checked_table(cfg: ModelConfig, reader: SafetensorsReader) -> list[Entry]:
    """The entries of ``cfg`` under the checkpoint's spellings, with every key, shape and dtype checked
    against the safetensors headers: a bad checkpoint fails here, before any tensor is read."""
    table = [resolve(entry, reader) for entry in entries(cfg)]
    _check_keys(cfg, table, reader)
    for entry in table:
        if entry.is_experts:
            for e in range(entry.shape[0]):
                check_tensor(reader, entry.expert_key(e), entry.hf_shape)
        else:
            check_tensor(reader, entry.hf, entry.hf_shape)
    return table


def _read(reader: SafetensorsReader, key: str) -> np.ndarray:
    """One HF matrix as float32 or wider (MXFP4 pairs decoded); ``checked_table`` checked its header."""
    if key in reader:
        return reader.get(key)
    packed_key, scale_key = mxfp4_keys(key)
    return mxfp4.decode(reader.get(packed_key), reader.get(scale_key), name=packed_key)


def _leaf(entry: Entry, reader: SafetensorsReader, dtype) -> np.ndarray:
    layout = LAYOUTS[entry.layout]
    if not entry.is_experts:
        return layout.to_tree(_read(reader, entry.hf), entry.shape).astype(dtype)
    out = np.empty(entry.shape, dtype=dtype)  # [E, in, out]
    for e in range(entry.shape[0]):
        out[e] = layout.to_tree(_read(reader, entry.expert_key(e)), entry.shape[1:])
    return out
