"""Streaming conversion between Hugging Face folders and k3jax orbax checkpoints.

``hf_to_orbax``:
1. checks ``DST`` (refused when present, unless ``overwrite``) and the whole source — config
   family, every key, shape, dtype and byte range (``HFSource``) — before anything is written;
2. builds the stored leaves (``layout``: per layer, or the scanned stack's stacked leaves,
   ``k3jax.convert.orbax_layout``) a group at a time (``group_bytes``), each as a sharded
   ``jax.Array`` whose shards every process reads itself (``HFSource.leaf`` / ``stacked_leaf``), and
   appends each group to an orbax partial save (multi-host safe: orbax coordinates the processes,
   each writes its shards; a stacked leaf is stored one chunk per layer, so one layer reads back
   alone);
3. finalises the orbax checkpoint in ``DST.incomplete``, writes ``k3jax.json`` there last and
   renames the folder to ``DST`` — an interrupted conversion leaves no ``DST``.

``orbax_to_hf`` streams the other way, one layer's leaf in host memory at a time, through ``save_hf``
(MXFP4 re-encoding of K3's routed experts as the release stores them), into ``DST.incomplete``
then ``DST``. It runs in one process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from k3jax.config import ModelConfig
from k3jax.convert import orbax_ckpt as oc
from k3jax.convert.hf_config import family
from k3jax.convert.orbax_layout import (PER_LAYER, TEXT, check_layout, is_multimodal, mesh_shardings, stored_table,
                                        text_config)
from k3jax.convert.save import save_hf
from k3jax.convert.sharded_read import HFSource, leaf_nbytes
from k3jax.layout import is_stack_name

Progress = Callable[[int, int], None]  # called with (tensors, bytes) as they are finished
INCOMPLETE = ".incomplete"


def check_destination(dst: str | os.PathLike, overwrite: bool) -> Path:
    dst = Path(dst).absolute()
    if dst.exists() and not overwrite:
        raise ValueError(f"DST={os.fspath(dst)!r} already exists; pass --overwrite to replace it")
    if not dst.parent.is_dir():
        raise ValueError(f"DST={os.fspath(dst)!r}: its parent folder does not exist")
    return dst


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        ocp.multihost.sync_global_processes(f"k3jax_convert:{name}")


def _fresh_temp(dst: Path) -> Path:
    """``DST.incomplete``, emptied of what an interrupted run left (one process clears it)."""
    tmp = dst.with_name(dst.name + INCOMPLETE)
    if jax.process_index() == 0:
        for leftover in (tmp, tmp.with_name(tmp.name + ".partial_save")):
            if leftover.exists():
                shutil.rmtree(leftover)
        for pending in tmp.parent.glob(tmp.name + ".partial_save.pending_*"):
            shutil.rmtree(pending)
    _barrier(f"clear:{dst}")
    return tmp


def _publish(tmp: Path, dst: Path, meta: dict) -> None:
    """``k3jax.json`` last, then the rename: only a complete folder ever appears as ``DST``."""
    if jax.process_index() == 0:
        (tmp / oc.METADATA).write_text(json.dumps(meta, indent=2, sort_keys=True))
        _move_into_place(tmp, dst)
    _barrier(f"publish:{dst}")


def _move_into_place(tmp: Path, dst: Path) -> None:
    if dst.exists():  # only reached with overwrite=True (check_destination)
        shutil.rmtree(dst)
    os.replace(tmp, dst)


def _orbax_context():
    """Each shard written by its first replica: orbax's replica-parallel writes slice replicated
    shards with one compiled program per shape, seconds per leaf on CPU for no gain here."""
    from orbax.checkpoint.experimental import v1 as ocp1

    context = ocp1.Context()
    context.array.saving.use_replica_parallel = False
    context.array.saving.scoped_storage_options_creator = _one_chunk_per_layer
    return context


def _one_chunk_per_layer(key_path, value):
    """Storage of a stacked leaf: chunked along its layers axis, so one layer is read on its own."""
    from orbax.checkpoint.experimental import v1 as ocp1

    if any(is_stack_name(getattr(k, "key", None)) for k in key_path):
        return ocp1.options.ArrayOptions.Saving.StorageOptions(shard_axes=(0,))
    return None


def _partial_save(path: Path, flat: dict[tuple[str, ...], jax.Array]) -> None:
    from orbax.checkpoint.experimental.v1 import partial

    with _orbax_context():
        partial.save(path, oc.nest(flat))


def hf_to_orbax(src: str, dst: str, *, mesh: Mesh | None = None, dtype: Any = jnp.bfloat16,
                overwrite: bool = False, group_bytes: int = 512 << 20, progress: Progress | None = None,
                source: HFSource | None = None, layout: str = PER_LAYER) -> dict:
    """Convert the Hugging Face folder ``src`` to a k3jax orbax checkpoint at ``dst``; returns its
    ``k3jax.json``. ``mesh``: where the leaves live while written (None: the first local device;
    required with several processes). ``dtype``: the stored parameter dtype (the SPEC §10 fp32
    leaves stay float32 or wider). ``source`` lets a caller keep the ``HFSource`` (and its
    ``bytes_read``). ``layout``: ``"per-layer"`` or ``"scanned"`` (the scanned stack's stacked leaves;
    refused for a model whose layers do not scan)."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"dtype={jnp.dtype(dtype).name} must be bfloat16 or float32")
    if group_bytes <= 0:
        raise ValueError(f"group_bytes={group_bytes} must be > 0")
    dst_path = check_destination(dst, overwrite)
    src_data = source if source is not None else HFSource(src)
    cfg = _stored_config(src_data, dtype)
    check_layout(layout, cfg)
    table = stored_table(cfg, layout)
    shardings = _write_shardings(cfg, mesh, layout)
    tmp = _fresh_temp(dst_path)
    group: dict[tuple[str, ...], jax.Array] = {}
    size = tensors = total = 0
    for i, stored in enumerate(table):
        leaf_dtype = oc.leaf_dtype(stored.entry, dtype)
        where = shardings(stored.path)
        if stored.is_vision:
            group[stored.path] = src_data.vision_leaf(stored.entry, where, leaf_dtype)
        elif stored.stacked:
            group[stored.path] = src_data.stacked_leaf(stored.parts, where, leaf_dtype)
        else:
            group[stored.path] = src_data.leaf(stored.entry, where, leaf_dtype)
        size += sum(leaf_nbytes(e, leaf_dtype) for e in stored.parts)
        tensors += len(stored.parts)
        if size >= group_bytes or i == len(table) - 1:
            _partial_save(tmp, group)
            if progress is not None:
                progress(tensors, size)
            total, group, size, tensors = total + size, {}, 0, 0
    from orbax.checkpoint.experimental.v1 import partial

    with _orbax_context():
        partial.finalize(tmp)
    meta = _metadata(cfg, src_data, dtype, total, layout)
    _publish(tmp, dst_path, meta)
    return meta


def _stored_config(src: HFSource, dtype):
    """The source's config (multimodal when it has a tower) with ``dtype`` as its parameter dtype."""
    text = dataclasses.replace(src.cfg, param_dtype=jnp.dtype(dtype))
    if src.multimodal is None:
        return text
    vision = dataclasses.replace(src.multimodal.vision, param_dtype=jnp.dtype(dtype))
    return dataclasses.replace(src.multimodal, text=text, vision=vision)


def _write_shardings(cfg, mesh: Mesh | None, layout: str) -> Callable[[tuple[str, ...]], jax.sharding.Sharding]:
    if mesh is None:
        if jax.process_count() > 1:
            raise ValueError("with several processes, --mesh must say how the leaves are split "
                             "(e.g. --mesh expert=-1)")
        one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return lambda path: one
    return mesh_shardings(cfg, mesh, layout).__getitem__


def _metadata(cfg, src: HFSource, dtype, total: int, layout: str) -> dict:
    from k3jax.train.config import to_dict

    text = text_config(cfg)
    meta = {"format": oc.FORMAT, "version": oc.VERSION, "layout": layout, "dtype": jnp.dtype(dtype).name,
            "model": to_dict(text), "tensors": totals(cfg, dtype)[0], "bytes": total,
            "source": {"path": os.path.abspath(src.path), "family": family(text),
                       "hf_dtype": np.dtype(src.hf_dtype).name, "mxfp4": src.mxfp4}}
    if is_multimodal(cfg):
        meta["vision"] = {k: v for k, v in to_dict(cfg).items() if k != "text"}
    return meta


class _StoredLeaf:
    """A layer's leaf of an orbax checkpoint read when ``save_hf`` first asks for it (via
    ``__array__``): a stored leaf, or row ``row`` of a stacked one."""

    def __init__(self, path: Path, leaf: tuple[str, ...], shape, dtype, progress: Progress | None,
                 row: int | None = None):
        self.path, self.leaf, self.progress, self.row = path, leaf, progress, row
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)

    def __array__(self, dtype=None, copy=None):
        if self.row is None:
            value = oc.restore_leaf(self.path, self.leaf)
        else:
            value = oc.restore_row(self.path, self.leaf, self.row)
        if self.progress is not None:
            self.progress(1, value.nbytes)
        return value if dtype is None else value.astype(dtype)


def orbax_to_hf(src: str, dst: str, *, dtype: Any = None, mxfp4: bool | None = None, overwrite: bool = False,
                max_shard_bytes: int = 5 << 30, progress: Progress | None = None) -> None:
    """Write the k3jax orbax checkpoint ``src`` as a Hugging Face folder ``dst``, one leaf at a time.

    ``dtype``: the HF dtype (default: the source checkpoint's, recorded in ``k3jax.json``; the
    release's F32 tensors stay F32). ``mxfp4``: store K3's routed experts as MXFP4 (default: as the
    source did; re-encoding rounds experts that are not MXFP4 values, as the release's are)."""
    if jax.process_count() > 1:
        raise ValueError("orbax-to-hf runs in one process (it writes one set of safetensors files)")
    meta = oc.read_metadata(src)
    cfg = oc.checkpoint_config(meta)
    stored = oc.check_stored(src, cfg, meta["dtype"], meta["layout"])
    dst_path = check_destination(dst, overwrite)
    source = meta.get("source", {})
    dtype = jnp.dtype(dtype if dtype is not None else source.get("hf_dtype", "bfloat16"))
    use_mxfp4 = bool(source.get("mxfp4", family(text_config(cfg)) == "kimi_k3")) if mxfp4 is None else mxfp4
    lazy = oc.nest(_per_layer_leaves(Path(src), stored.values(), meta["dtype"], progress))
    tmp = _fresh_temp(dst_path)
    # The parameter dtype is k3jax's, not the HF model's: keep it out of config.json's overrides.
    default = ModelConfig.__dataclass_fields__["param_dtype"].default
    text = dataclasses.replace(text_config(cfg), param_dtype=default)
    if is_multimodal(cfg):
        from k3jax.vision.checkpoint import save_hf as save_multimodal

        lazy.setdefault("balance", {}).setdefault(TEXT, {})
        save_multimodal(dataclasses.replace(cfg, text=text), lazy, os.fspath(tmp), dtype=dtype, mxfp4=use_mxfp4,
                        max_shard_bytes=max_shard_bytes)
    else:
        lazy.setdefault("balance", {})
        save_hf(text, lazy, os.fspath(tmp), dtype=dtype, mxfp4=use_mxfp4, max_shard_bytes=max_shard_bytes)
    _move_into_place(tmp, dst_path)


def _per_layer_leaves(src: Path, stored, dtype, progress: Progress | None) -> dict[tuple[str, ...], _StoredLeaf]:
    """``{per-layer leaf path: _StoredLeaf}``: a stacked leaf's rows become their layers' leaves."""
    out = {}
    for leaf in stored:
        if not leaf.stacked:
            out[leaf.path] = _StoredLeaf(src, leaf.path, leaf.shape, oc.leaf_dtype(leaf.entry, dtype), progress)
            continue
        where = leaf.path[:next(n for n, k in enumerate(leaf.path) if is_stack_name(k))]  # (collection[, TEXT])
        for row, part in enumerate(leaf.parts):
            out[where + part.path] = _StoredLeaf(src, leaf.path, part.shape, oc.leaf_dtype(part, dtype), progress, row)
    return out


def totals(cfg, dtype) -> tuple[int, int]:
    """``(tensors, bytes)`` of ``cfg`` (text or multimodal) stored in ``dtype``: the progress bar's totals
    (an expert stack counts as one tensor)."""
    parts = [e for leaf in stored_table(cfg, PER_LAYER) for e in leaf.parts]
    return len(parts), sum(leaf_nbytes(e, oc.leaf_dtype(e, dtype)) for e in parts)
