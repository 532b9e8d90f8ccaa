"""The k3jax orbax checkpoint folder: what ``python -m k3jax.convert hf-to-orbax`` writes.

Layout of ``DST`` (format version 1)::

    DST/k3jax.json     {"format": "k3jax-orbax", "version": 1, "layout": "per-layer" | "scanned",
                        "dtype": "bfloat16", "model": <k3jax.train.config.to_dict(ModelConfig)>,
                        "source": {"path", "family", "hf_dtype", "mxfp4"}, "tensors", "bytes",
                        "vision": {"vision", "media_token_id", "frames_per_chunk"} (multimodal only)}
    DST/state/         an orbax PyTree checkpoint of {"params": ..., "balance": ...} in that layout
                       (``k3jax.convert.orbax_layout``: one ``layers_{i}`` subtree per layer, or the
                       scanned runs' ``stack_{start}/offset_{j}`` leaves; docs/params.md)
    DST/_CHECKPOINT_METADATA, DST/orbax.checkpoint   orbax's own markers

``k3jax.json`` is written last and the folder is renamed into place after it, so a folder that
``is_orbax_checkpoint`` accepts is complete. ``restore_orbax(path, shardings=None | mesh | tree,
layout=None)`` returns ``(cfg, variables)`` like ``load_hf``, in ``layout`` (default: the model
config's own): ``None`` restores onto the first local device, a ``Mesh`` places every leaf by its
logical axes (``sharding.shardings_for``, the model's own rules), a tree of shardings (shaped like
the stored leaves) is used as given. Each process reads only its shards; when the stored layout is
the one asked for, the arrays are restored as they are (a scanned model reads stacked arrays), else
they are stacked or split after reading (``k3jax.layout``). The tree can also be read with plain
orbax: ``ocp.StandardCheckpointer().restore(DST / "state", target)``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from k3jax.config import ModelConfig
from k3jax.convert.hf_keys import KeyEntry
from k3jax.convert.orbax_layout import (LAYOUTS, PER_LAYER, AnyConfig, StoredLeaf, check_layout, in_layout,
                                        legacy_problem, mesh_shardings, model_layout, stored_table)

FORMAT, VERSION = "k3jax-orbax", 1
METADATA, STATE = "k3jax.json", "state"


def is_orbax_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a complete k3jax orbax checkpoint folder (``hf-to-orbax`` output)."""
    file = Path(path) / METADATA
    if not file.is_file() or not (Path(path) / STATE).is_dir():
        return False
    try:
        return json.loads(file.read_text()).get("format") == FORMAT
    except (OSError, json.JSONDecodeError):
        return False


def read_metadata(path: str | os.PathLike) -> dict:
    """``k3jax.json`` of a checkpoint folder, its format, version and layout checked."""
    if not is_orbax_checkpoint(path):
        raise ValueError(f"path={os.fspath(path)!r} must be a k3jax orbax checkpoint folder "
                         f"({METADATA} with format {FORMAT!r} beside {STATE}/); an interrupted conversion?")
    meta = json.loads((Path(path) / METADATA).read_text())
    if meta.get("version") != VERSION:
        raise ValueError(f"{Path(path) / METADATA}: version={meta.get('version')!r}, this k3jax reads {VERSION}")
    if meta.get("layout") not in LAYOUTS:
        raise ValueError(f"{Path(path) / METADATA}: layout={meta.get('layout')!r}, this k3jax reads one of {LAYOUTS}")
    return meta


def model_config(meta: dict) -> ModelConfig:
    """The (text) model's config."""
    from k3jax.train.config import from_dict

    return from_dict(ModelConfig, meta["model"])


def checkpoint_config(meta: dict) -> AnyConfig:
    """The config of the whole checkpoint: a ``MultimodalConfig`` when it holds a vision tower."""
    if "vision" not in meta:
        return model_config(meta)
    from k3jax.train.config import from_dict
    from k3jax.vision.config import MultimodalConfig

    return from_dict(MultimodalConfig, {"text": meta["model"], **meta["vision"]})


def leaf_dtype(entry: KeyEntry, dtype) -> np.dtype:
    """The stored dtype of a leaf: ``dtype``, or float32 (or wider) for SPEC §10's fp32 leaves."""
    return np.dtype(jnp.promote_types(dtype, jnp.float32) if entry.wide else dtype)


def nest(flat: dict[tuple[str, ...], Any]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for name in path[:-1]:
            node = node.setdefault(name, {})
        node[path[-1]] = value
    return out


def stored_leaves(path: Path) -> dict[tuple[str, ...], Any]:
    """``{leaf path: orbax ArrayMetadata}`` of the stored tree (no array data read)."""
    tree = ocp.PyTreeCheckpointHandler().metadata(path / STATE).tree
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
    return {tuple(str(k.key) for k in p): leaf for p, leaf in flat}


def check_stored(path: str | os.PathLike, cfg: AnyConfig, dtype, layout: str = PER_LAYER
                 ) -> dict[tuple[str, ...], StoredLeaf]:
    """``{path: StoredLeaf}`` of ``cfg`` in ``layout``, checked against the stored leaves (missing,
    unexpected, shape, dtype)."""
    stored = stored_leaves(Path(path))
    where = Path(path) / STATE
    legacy = legacy_problem(stored, cfg, str(where))
    if legacy:
        raise ValueError(legacy)
    want = {leaf.path: leaf for leaf in stored_table(cfg, layout)}
    missing, extra = sorted(set(want) - set(stored)), sorted(set(stored) - set(want))
    if missing or extra:
        raise ValueError(f"{where}: leaves missing {['/'.join(p) for p in missing[:3]]} / unexpected "
                         f"{['/'.join(p) for p in extra[:3]]} for the model config and layout {layout!r} in {METADATA}")
    for p, leaf in want.items():
        shape, dt = tuple(stored[p].shape), np.dtype(stored[p].dtype)
        if shape != leaf.shape or dt != leaf_dtype(leaf.entry, dtype):
            raise ValueError(f"{where}: leaf {'/'.join(p)!r} is {dt} {shape}, expected "
                             f"{leaf_dtype(leaf.entry, dtype)} {leaf.shape} by the model config")
    return want


def _shardings_tree(cfg: AnyConfig, layout: str, shardings) -> dict[tuple[str, ...], jax.sharding.Sharding]:
    paths = [leaf.path for leaf in stored_table(cfg, layout)]
    if shardings is None:
        if jax.process_count() > 1:
            raise ValueError("shardings=None restores onto one device; with several processes pass a mesh")
        one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return dict.fromkeys(paths, one)
    if isinstance(shardings, Mesh):
        return mesh_shardings(cfg, shardings, layout)
    flat = jax.tree_util.tree_flatten_with_path(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))[0]
    given = {tuple(str(k.key) for k in p): s for p, s in flat}
    if set(given) != set(paths):
        raise ValueError(f"shardings must be None, a Mesh or a tree of shardings shaped like the stored {layout!r} "
                         f"variables ({{'params', 'balance'}}); e.g. missing {sorted(set(paths) - set(given))[:2]}")
    return given


def restore_orbax(path: str | os.PathLike, *, shardings: Any = None, layout: str | None = None
                  ) -> tuple[AnyConfig, dict]:
    """``(cfg, {"params", "balance"})`` from a k3jax orbax checkpoint folder, onto ``shardings``
    (None: the first local device; a ``Mesh``: by the model's logical axes; or a tree of shardings
    of the stored leaves). ``layout``: of the returned variables, ``"per-layer"`` or ``"scanned"``
    (default: ``cfg``'s own, scanned where the config scans); the stored layout is read as it is
    and converted when the two differ. A multimodal checkpoint gives its ``MultimodalConfig`` and the
    ``MultimodalTransformer`` tree (``k3jax.vision.text_variables`` takes the text model's part)."""
    meta = read_metadata(path)
    cfg = checkpoint_config(meta)
    stored_layout = meta["layout"]
    layout = model_layout(cfg) if layout is None else layout
    check_layout(layout, cfg)
    stored = check_stored(path, cfg, meta["dtype"], stored_layout)
    placed = _shardings_tree(cfg, stored_layout, shardings)
    target = nest({p: jax.ShapeDtypeStruct(leaf.shape, leaf_dtype(leaf.entry, meta["dtype"]), sharding=placed[p])
                   for p, leaf in stored.items()})
    variables = ocp.PyTreeCheckpointer().restore(
        Path(path).absolute() / STATE,
        args=ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))
    return cfg, in_layout(variables, cfg, layout)


def restore_leaf(path: str | os.PathLike, leaf: tuple[str, ...]) -> np.ndarray:
    """One stored leaf as a host array (reads that leaf only)."""
    item = nest({leaf: 0})
    args = ocp.args.PyTreeRestore(item=item, restore_args=nest({leaf: ocp.RestoreArgs(restore_type=np.ndarray)}),
                                  partial_restore=True)
    out = ocp.PyTreeCheckpointer().restore(Path(path).absolute() / STATE, args=args)
    for name in leaf:
        out = out[name]
    return out


def restore_row(path: str | os.PathLike, leaf: tuple[str, ...], row: int) -> np.ndarray:
    """Row ``row`` of a stacked stored leaf as a host array. ``hf-to-orbax`` stores a stacked leaf one
    chunk per row, so tensorstore (orbax's zarr3-over-OCDBT store, opened directly) reads that row's
    chunk only; a store laid out otherwise is read through orbax, whole."""
    import tensorstore as ts

    spec = {"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": (Path(path).absolute() / STATE).as_uri(),
                                            "path": ".".join(leaf)}}
    try:
        store = ts.open(spec, open=True, read=True).result()
    except ValueError:
        return restore_leaf(path, leaf)[row]
    return np.asarray(store[row].read().result())
