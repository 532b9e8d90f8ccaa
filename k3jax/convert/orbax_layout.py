"""Which leaves a k3jax orbax checkpoint stores, in each of its two layouts, and where they live on a mesh.

- ``per-layer``: one leaf per HF entry, every layer its own ``layers_{i}`` subtree (the unrolled
  model's tree).
- ``scanned``: the scanned stack's tree (``k3jax.layout``): the layers of each scanned run stored as
  ``stack_{start}/offset_{j}/…`` leaves of shape ``[repeats, *per-layer shape]`` (layer
  ``start + j + unit·r`` at row ``r``), the unrolled layers and the rest as in ``per-layer``. (The
  one-run layout of earlier k3jax, ``stack/offset_{j}``, is refused by name.) A scanned model restores these
  stacked arrays directly. The stacked ``layers`` axis is never sharded (``sharding.rules``), so a
  shard of a stacked leaf is the same block of each of its layers: a process still reads only its
  own blocks of each HF tensor.

A ``StoredLeaf`` is one stored array and the HF entries it is made of (one, or the stacked layers in
row order); ``stored_table`` lists them in checkpoint order.

A multimodal K3 (``k3jax.vision.MultimodalConfig``) stores the tree of ``MultimodalTransformer``:
the text model's leaves (in either layout) under ``language_model``, as the HF keys nest them, and
the tower and projector (``vision_tower/…``, ``mm_projector/…``, ``k3jax.vision.hf_keys``) beside it.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from typing import Union

from k3jax.config import ModelConfig
from k3jax.convert.hf_keys import Entry, KeyEntry, entries
from k3jax.layout import (LEGACY_STACK, is_scanned, legacy_layout_error, offset_name, scan_plan, to_per_layer,
                          to_scanned, unrolled)

PER_LAYER, SCANNED = "per-layer", "scanned"
LAYOUTS = (PER_LAYER, SCANNED)
TEXT = "language_model"  # where a multimodal checkpoint keeps the text model
AnyConfig = Union[ModelConfig, "k3jax.vision.MultimodalConfig"]  # noqa: F821


def text_config(cfg: AnyConfig) -> ModelConfig:
    """The language model's config (``cfg`` itself for a text model)."""
    return cfg if isinstance(cfg, ModelConfig) else cfg.text


def is_multimodal(cfg: AnyConfig) -> bool:
    return not isinstance(cfg, ModelConfig)


@dataclasses.dataclass(frozen=True)
class StoredLeaf:
    path: tuple[str, ...]  # (collection, ...) in the stored tree
    parts: tuple[KeyEntry, ...]  # the HF entries it holds: one, or one per stacked layer (row order)
    stacked: bool

    @property
    def entry(self) -> KeyEntry:
        """The entry that names its kind (component, experts, fp32): the first layer's."""
        return self.parts[0]

    @property
    def is_vision(self) -> bool:
        """A tower or projector leaf (its entry a ``k3jax.vision.hf_keys.VisionEntry``)."""
        return not isinstance(self.entry, Entry)

    @property
    def shape(self) -> tuple[int, ...]:
        return ((len(self.parts),) if self.stacked else ()) + self.entry.shape


def check_layout(layout: str, cfg: AnyConfig) -> None:
    """``ValueError`` for an unknown layout, or ``scanned`` for a model whose layers do not scan."""
    cfg = text_config(cfg)
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} must be one of {LAYOUTS}")
    if layout == SCANNED and scan_plan(_scanning(cfg)) is None:
        raise ValueError(f"layout='scanned' needs a model with a repeating run of layers to stack; this "
                         f"{cfg.num_layers}-layer model has none (use layout='per-layer')")


def model_layout(cfg: AnyConfig) -> str:
    """The layout of ``cfg``'s own variables: scanned when ``cfg`` scans a run of layers."""
    return SCANNED if scan_plan(text_config(cfg)) is not None else PER_LAYER


def in_layout(variables: dict, cfg: AnyConfig, layout: str) -> dict:
    """``variables`` of ``cfg`` (either layout) in ``layout``: stacked or split as needed."""
    check_layout(layout, cfg)
    if is_multimodal(cfg):
        text = in_layout({name: tree[TEXT] for name, tree in variables.items()}, cfg.text, layout)
        return {name: {**tree, TEXT: text[name]} for name, tree in variables.items()}
    if layout == SCANNED:
        return variables if is_scanned(variables["params"]) else to_scanned(variables, _scanning(cfg))
    return to_per_layer(variables, _scanning(cfg))


def _scanning(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, scan_layers=True)


def _layer_index(entry: KeyEntry) -> int | None:
    head = entry.path[0]
    return int(head.split("_")[1]) if head.startswith("layers_") and head[7:].isdigit() else None


def stored_table(cfg: AnyConfig, layout: str) -> list[StoredLeaf]:
    """Every stored leaf of ``cfg`` in ``layout`` (checked by `check_layout`), in checkpoint order."""
    if not is_multimodal(cfg):
        return _text_table(cfg, layout)
    from k3jax.vision.hf_keys import vision_entries

    text = [dataclasses.replace(leaf, path=(leaf.path[0], TEXT) + leaf.path[1:]) for leaf in _text_table(cfg.text, layout)]
    return text + [StoredLeaf(("params",) + e.path, (e,), False) for e in vision_entries(cfg.vision, cfg.text.hidden)]


def _text_table(cfg: ModelConfig, layout: str) -> list[StoredLeaf]:
    check_layout(layout, cfg)
    table = entries(cfg)
    if layout == PER_LAYER:
        return [StoredLeaf((e.collection,) + e.path, (e,), False) for e in table]
    runs = scan_plan(_scanning(cfg)).runs
    run_of = {l: run for run in runs for l in range(run.start, run.stop)}
    by_path = {(e.collection,) + e.path: e for e in table}
    out = []
    for e in table:
        layer = _layer_index(e)
        run = run_of.get(layer)
        if run is None:
            out.append(StoredLeaf((e.collection,) + e.path, (e,), False))
        elif layer < run.start + run.unit:  # the run's first unit names its stacked leaves
            j, rest = layer - run.start, e.path[1:]
            parts = tuple(by_path[(e.collection, f"layers_{l}") + rest] for l in run.layers(j))
            out.append(StoredLeaf((e.collection, run.name, offset_name(j)) + rest, parts, True))
    return out


def legacy_problem(paths, cfg: AnyConfig, where: str) -> str | None:
    """The problem, naming the expected runs, when stored leaf ``paths`` are in the one-run layout."""
    if any(LEGACY_STACK in path for path in paths):
        return legacy_layout_error(where, scan_plan(_scanning(text_config(cfg))))
    return None


def mesh_shardings(cfg: AnyConfig, mesh: Mesh, layout: str = PER_LAYER
                   ) -> dict[tuple[str, ...], jax.sharding.NamedSharding]:
    """``{stored leaf path: NamedSharding}`` of ``layout``'s leaves on ``mesh``, from the model's
    logical axis names and rules."""
    from k3jax.params import _abstract_variables

    check_layout(layout, cfg)
    text = text_config(cfg)
    model = unrolled(text) if layout == PER_LAYER else _scanning(text)
    # Logical axes do not depend on dtypes: one traced init (cached) serves every dtype of a model.
    out = _placed(_abstract_variables(dataclasses.replace(model, dtype=jnp.float32, param_dtype=jnp.float32)), mesh)
    if not is_multimodal(cfg):
        return out
    from k3jax.vision.params import abstract_vision

    out = {(p[0], TEXT) + p[1:]: s for p, s in out.items()}
    return out | _placed(abstract_vision(cfg.vision, cfg.text.hidden), mesh)


def _placed(boxed, mesh: Mesh) -> dict[tuple[str, ...], jax.sharding.NamedSharding]:
    from sharding.init import logical_axes, shardings_for

    tree = shardings_for(nn.unbox(boxed), logical_axes(boxed), mesh)
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))[0]
    return {tuple(str(k.key) for k in path): s for path, s in flat}
