"""The k3jax orbax checkpoint folder: what ``python -m k3jax.convert hf-to-orbax`` writes.

Layout of ``DST`` (format version 1)::

    DST/k3jax.json     {"format": "k3jax-orbax", "version": 1, "layout": "per-layer",
                        "dtype": "bfloat16", "model": <k3jax.train.config.to_dict(ModelConfig)>,
                        "source": {"path", "family", "hf_dtype", "mxfp4"}, "tensors", "bytes"}
    DST/state/         an orbax PyTree checkpoint of {"params": ..., "balance": ...}
                       (docs/params.md; one ``layers_{i}`` subtree per layer)
    DST/_CHECKPOINT_METADATA, DST/orbax.checkpoint   orbax's own markers

``k3jax.json`` is written last and the folder is renamed into place after it, so a folder that
``is_orbax_checkpoint`` accepts is complete. ``restore_orbax(path, shardings=None | mesh | tree)``
returns ``(cfg, variables)`` like ``load_hf``: ``None`` restores onto the first local device, a
``Mesh`` places every leaf by its logical axes (``sharding.shardings_for``, the model's own
rules), a tree of shardings is used as given. Each process reads only its shards. The tree can
also be read with plain orbax: ``ocp.StandardCheckpointer().restore(DST / "state", target)``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from k3jax.config import ModelConfig
from k3jax.convert.hf_keys import Entry, entries
from k3jax.layout import to_scanned, unrolled

FORMAT, VERSION, LAYOUT = "k3jax-orbax", 1, "per-layer"
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
    if meta.get("layout") != LAYOUT:
        raise ValueError(f"{Path(path) / METADATA}: layout={meta.get('layout')!r}, this k3jax reads {LAYOUT!r}")
    return meta


def model_config(meta: dict) -> ModelConfig:
    from k3jax.train.config import from_dict

    return from_dict(ModelConfig, meta["model"])


def leaf_dtype(entry: Entry, dtype) -> np.dtype:
    """The stored dtype of a leaf: ``dtype``, or float32 (or wider) for SPEC §10's fp32 leaves."""
    return np.dtype(jnp.promote_types(dtype, jnp.float32) if entry.wide else dtype)


def leaf_path(entry: Entry) -> tuple[str, ...]:
    return (entry.collection,) + entry.path


def mesh_shardings(cfg: ModelConfig, mesh: Mesh) -> dict[tuple[str, ...], jax.sharding.NamedSharding]:
    """``{leaf path: NamedSharding}`` of the per-layer (stored) leaves on ``mesh`` from the model's
    logical axis names and rules."""
    from k3jax.params import _abstract_variables
    from sharding.init import logical_axes, shardings_for

    # Logical axes do not depend on dtypes: one traced init (cached) serves every dtype of a model.
    per_layer = dataclasses.replace(unrolled(cfg), dtype=jnp.float32, param_dtype=jnp.float32)
    boxed = _abstract_variables(per_layer)
    tree = shardings_for(nn.unbox(boxed), logical_axes(boxed), mesh)
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))[0]
    return {tuple(str(k.key) for k in path): s for path, s in flat}


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


def check_stored(path: str | os.PathLike, cfg: ModelConfig, dtype) -> dict[tuple[str, ...], Any]:
    """The stored leaves, checked against the entries of ``cfg`` (missing, unexpected, shape, dtype)."""
    stored = stored_leaves(Path(path))
    want = {leaf_path(e): e for e in entries(cfg)}
    missing, extra = sorted(set(want) - set(stored)), sorted(set(stored) - set(want))
    where = Path(path) / STATE
    if missing or extra:
        raise ValueError(f"{where}: leaves missing {['/'.join(p) for p in missing[:3]]} / unexpected "
                         f"{['/'.join(p) for p in extra[:3]]} for the model config in {METADATA}")
    for p, e in want.items():
        shape, dt = tuple(stored[p].shape), np.dtype(stored[p].dtype)
        if shape != e.shape or dt != leaf_dtype(e, dtype):
            raise ValueError(f"{where}: leaf {'/'.join(p)!r} is {dt} {shape}, expected {leaf_dtype(e, dtype)} "
                             f"{e.shape} by the model config")
    return stored


def _shardings_tree(cfg: ModelConfig, shardings) -> dict[tuple[str, ...], jax.sharding.Sharding]:
    paths = [leaf_path(e) for e in entries(cfg)]
    if shardings is None:
        if jax.process_count() > 1:
            raise ValueError("shardings=None restores onto one device; with several processes pass a mesh")
        one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return dict.fromkeys(paths, one)
    if isinstance(shardings, Mesh):
        return mesh_shardings(cfg, shardings)
    flat = jax.tree_util.tree_flatten_with_path(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))[0]
    given = {tuple(str(k.key) for k in p): s for p, s in flat}
    if set(given) != set(paths):
        raise ValueError("shardings must be None, a Mesh or a tree of shardings shaped like the variables "
                         f"({{'params', 'balance'}}); e.g. missing {sorted(set(paths) - set(given))[:2]}")
    return given


def restore_orbax(path: str | os.PathLike, *, shardings: Any = None) -> tuple[ModelConfig, dict]:
    """``(cfg, {"params", "balance"})`` from a k3jax orbax checkpoint folder, onto ``shardings``
    (None: the first local device; a ``Mesh``: by the model's logical axes; or a tree of shardings
    of the stored per-layer leaves). The stored layout is per-layer; the variables come back in
    ``cfg``'s layout (scanned where the config scans, ``k3jax.layout.to_scanned``)."""
    meta = read_metadata(path)
    cfg = model_config(meta)
    stored = check_stored(path, cfg, meta["dtype"])
    placed = _shardings_tree(cfg, shardings)
    target = nest({p: jax.ShapeDtypeStruct(tuple(m.shape), np.dtype(m.dtype), sharding=placed[p])
                    for p, m in stored.items()})
    variables = ocp.PyTreeCheckpointer().restore(
        Path(path).absolute() / STATE,
        args=ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))
    return cfg, to_scanned(variables, cfg)


def restore_leaf(path: str | os.PathLike, leaf: tuple[str, ...]) -> np.ndarray:
    """One stored leaf as a host array (reads that leaf only)."""
    item = nest({leaf: 0})
    args = ocp.args.PyTreeRestore(item=item, restore_args=nest({leaf: ocp.RestoreArgs(restore_type=np.ndarray)}),
                                  partial_restore=True)
    out = ocp.PyTreeCheckpointer().restore(Path(path).absolute() / STATE, args=args)
    for name in leaf:
        out = out[name]
    return out
