"""Which decoder layers run as one scanned stack, and variables converted between the two layouts.

A deep stack traced layer by layer gives XLA one copy of every layer (K3: 93 layers, 11.7 M
characters of HLO for the forward alone). ``scan_plan`` picks the longest run of identical layers
(the same mixer and FFN kind at each offset of a repeating unit of ``unit`` layers) and the model
scans over its ``repeats`` units (``k3jax.layers.stack``); the layers before and after the run stay
unrolled. The plan minimises the layers traced, ``num_layers − unit·repeats + unit``: K3 scans
layers 1–88 as 22 units ``(KDA, KDA, MLA, KDA)`` and traces 9 layers; Kimi K2 scans its 60 MoE
layers as one.

Parameter tree (docs/params.md): unrolled layer i stays ``layers_{i}``; offset j of the unit holds
layers ``start + j + unit·r`` (r = 0..repeats-1) stacked on a leading ``layers`` axis as
``stack/offset_{j}``. ``to_scanned`` / ``to_per_layer`` convert any collection tree of that shape
(params, balance biases, optimizer moments laid out like params) between the two layouts.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig

STACK = "stack"


@dataclasses.dataclass(frozen=True)
class ScanPlan:
    """Layers ``start .. stop-1`` run as ``repeats`` scanned units of ``unit`` layers."""

    start: int
    unit: int
    repeats: int

    @property
    def stop(self) -> int:
        return self.start + self.unit * self.repeats

    def layers(self, offset: int) -> range:
        """The layers offset ``offset`` of the unit stands for, in scan order."""
        return range(self.start + offset, self.stop, self.unit)

    def unrolled(self, num_layers: int) -> tuple[range, range]:
        """The layers before and after the scanned run."""
        return range(0, self.start), range(self.stop, num_layers)


def offset_name(offset: int) -> str:
    return f"offset_{offset}"


@functools.lru_cache(maxsize=64)
def scan_plan(cfg: ModelConfig) -> ScanPlan | None:
    """The scanned run of ``cfg`` (None: ``scan_layers`` is off or no unit repeats twice).

    Layers are alike when their mixer kind and dense/MoE choice agree; AttnRes block boundaries
    may fall anywhere (the scanned stream pushes a block when its layer index says so). Among the
    runs of at least two units, the fewest traced layers wins, then the longest run, then the
    smallest unit, then the earliest start.
    """
    if not cfg.scan_layers:
        return None
    kinds = tuple(zip(cfg.layer_kinds, cfg.moe_layers))
    L, best = cfg.num_layers, None
    for unit in range(1, L // 2 + 1):
        for start in range(0, L - 2 * unit + 1):
            pattern, repeats = kinds[start:start + unit], 1
            while kinds[start + repeats * unit:start + (repeats + 1) * unit] == pattern:
                repeats += 1
            if repeats < 2:
                continue
            key = (L - repeats * unit + unit, -repeats * unit, unit, start)
            if best is None or key < best[0]:
                best = (key, ScanPlan(start, unit, repeats))
    return None if best is None else best[1]


def _stack(trees: list) -> Any:
    """Leaves stacked where they live: host arrays with numpy (a checkpoint being loaded), others with jnp."""
    stack = lambda *xs: np.stack(xs) if all(isinstance(x, np.ndarray) for x in xs) else jnp.stack(xs)
    return jax.tree.map(stack, *trees)


def _unstack(tree: Any, repeats: int) -> list:
    return [jax.tree.map(lambda x, r=r: x[r], tree) for r in range(repeats)]


def _check_tree(tree: Any, name: str) -> None:
    if not isinstance(tree, dict):
        raise ValueError(f"variables[{name!r}] must be a dict of modules, got {type(tree).__name__}")


def _collection_to_scanned(tree: dict, plan: ScanPlan, name: str) -> dict:
    _check_tree(tree, name)
    if STACK in tree:
        raise ValueError(f"variables[{name!r}] already has a {STACK!r} entry: it is in the scanned layout")
    scanned = {f"layers_{l}" for j in range(plan.unit) for l in plan.layers(j)}
    present = scanned & tree.keys()
    if not present:  # a collection without per-layer entries in the run (e.g. no MoE there)
        return dict(tree)
    if present != scanned:
        missing = sorted(scanned - present, key=lambda k: int(k.split("_")[1]))
        raise ValueError(f"variables[{name!r}] lacks {missing[0]!r}, needed to stack layers "
                         f"{plan.start}..{plan.stop - 1} (per-layer layout expected)")
    out = {k: v for k, v in tree.items() if k not in scanned}
    out[STACK] = {offset_name(j): _stack([tree[f"layers_{l}"] for l in plan.layers(j)])
                  for j in range(plan.unit)}
    return out


def _collection_to_per_layer(tree: dict, plan: ScanPlan, name: str) -> dict:
    _check_tree(tree, name)
    if STACK not in tree:
        return dict(tree)
    stack = tree[STACK]
    out = {k: v for k, v in tree.items() if k != STACK}
    for j in range(plan.unit):
        if offset_name(j) not in stack:
            raise ValueError(f"variables[{name!r}][{STACK!r}] lacks {offset_name(j)!r} "
                             f"(the scanned unit has {plan.unit} offsets)")
        for l, layer in zip(plan.layers(j), _unstack(stack[offset_name(j)], plan.repeats)):
            out[f"layers_{l}"] = layer
    return out


def to_scanned(variables: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """Per-layer variables (``{collection: tree}``, e.g. from ``load_hf`` of an unrolled config)
    in the layout of ``cfg``'s scanned stack; unchanged when ``cfg`` scans nothing."""
    plan = scan_plan(cfg)
    if plan is None:
        return variables
    return {name: _collection_to_scanned(tree, plan, name) for name, tree in variables.items()}


def to_per_layer(variables: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """The inverse of ``to_scanned``: every layer as its own ``layers_{i}`` entry."""
    plan = scan_plan(cfg)
    if plan is None:
        return variables
    return {name: _collection_to_per_layer(tree, plan, name) for name, tree in variables.items()}


def unrolled(cfg: ModelConfig) -> ModelConfig:
    """The same model traced layer by layer (the per-layer parameter layout)."""
    return dataclasses.replace(cfg, scan_layers=False)
