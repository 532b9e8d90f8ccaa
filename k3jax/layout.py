"""Which decoder layers run as scanned stacks, and variables converted between the two layouts.

A deep stack traced layer by layer gives XLA one copy of every layer (K3: 93 layers, 11.7 M
characters of HLO for the forward alone). ``scan_plan`` covers the layers with non-overlapping
*runs*: a ``ScanRun`` is ``repeats ≥ 2`` consecutive units of ``unit`` layers alike at each offset
(the same mixer kind and dense/MoE choice), and the model scans over its units
(``k3jax.layers.stack``), tracing the unit once. Layers outside every run stay unrolled. The plan
minimises the layers traced (each run's unit plus each unrolled layer), by a dynamic program over
the layer kinds: K3 traces 7 of 93 (layer 0; layers 1–88 as 22 units ``(KDA, KDA, MLA, KDA)``;
89–90 as 2 KDA units; 91–92 as 2 MLA units); Kimi K2 scans its 60 MoE layers as one run.

Among plans tracing the fewest layers it takes the fewest runs, then compares the runs in layer
order: the earlier start, then the longer run, then the smaller unit (``_plan_key``).

Parameter tree (docs/params.md): an unrolled layer i stays ``layers_{i}``; the run starting at
layer s is ``stack_{s}``, whose offset j holds layers ``s + j + unit·r`` (r = 0..repeats-1)
stacked on a leading ``layers`` axis as ``stack_{s}/offset_{j}``. ``to_scanned`` /
``to_per_layer`` convert any collection tree of that shape (params, balance biases, optimizer
moments laid out like params) between the two layouts. Trees of the earlier one-run layout (a single
``stack/offset_{j}`` entry) are refused with the names this layout expects.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig

STACK_PREFIX = "stack_"
LEGACY_STACK = "stack"  # the one-run layout's single entry (k3jax before several runs)


@dataclasses.dataclass(frozen=True)
class ScanRun:
    """Layers ``start .. stop-1`` run as ``repeats`` scanned units of ``unit`` layers."""

    start: int
    unit: int
    repeats: int

    @property
    def stop(self) -> int:
        return self.start + self.unit * self.repeats

    @property
    def name(self) -> str:
        """The run's entry in the variable tree."""
        return stack_name(self.start)

    def layers(self, offset: int) -> range:
        """The layers offset ``offset`` of the unit stands for, in scan order."""
        return range(self.start + offset, self.stop, self.unit)


@dataclasses.dataclass(frozen=True)
class ScanPlan:
    """The scanned runs of a ``num_layers``-layer stack (in layer order) and the layers left unrolled."""

    runs: tuple[ScanRun, ...]
    num_layers: int

    @property
    def unrolled(self) -> tuple[int, ...]:
        inside = {l for run in self.runs for l in range(run.start, run.stop)}
        return tuple(l for l in range(self.num_layers) if l not in inside)

    @property
    def traced(self) -> int:
        """Layers XLA sees: each unrolled layer and each run's unit once."""
        return len(self.unrolled) + sum(run.unit for run in self.runs)

    @property
    def entries(self) -> tuple[int | ScanRun, ...]:
        """The stack in layer order: an unrolled layer's index, or a run in its place."""
        return tuple(sorted([*self.unrolled, *self.runs], key=lambda e: e if isinstance(e, int) else e.start))

    def describe(self) -> str:
        """One line for reports: each run, where it lives in the tree, and the layers traced."""
        runs = "; ".join(f"layers {run.start}-{run.stop - 1} stacked as {run.repeats} units of {run.unit}, "
                         f"{run.name}/offset_0..{run.unit - 1}" for run in self.runs)
        return f"{runs}; {self.traced} of {self.num_layers} layers traced"


def stack_name(start: int) -> str:
    return f"{STACK_PREFIX}{start}"


def is_stack_name(key: Any) -> bool:
    """Whether a tree key names a scanned run (``stack_{start}``)."""
    return isinstance(key, str) and key.startswith(STACK_PREFIX) and key[len(STACK_PREFIX):].isdigit()


def offset_name(offset: int) -> str:
    return f"offset_{offset}"


def is_scanned(tree: dict) -> bool:
    """Whether a collection tree holds scanned runs."""
    return any(map(is_stack_name, tree))


def _key(unrolled: int, runs: tuple[ScanRun, ...]) -> tuple:
    """What a plan (or the plan of a suffix of the layers) minimises: traced layers, then runs, then its
    runs in layer order by (start, −length, unit): earlier, then longer, then smaller units. Both parts
    are additive / prefix-wise, so the best plan's suffixes are best plans (the dynamic program)."""
    traced = unrolled + sum(run.unit for run in runs)
    return traced, len(runs), tuple((run.start, run.start - run.stop, run.unit) for run in runs)


def _runs_at(kinds: tuple, start: int):
    """Every run starting at layer ``start``: each unit size, each repeat count ≥ 2 its pattern allows."""
    for unit in range(1, (len(kinds) - start) // 2 + 1):
        pattern, repeats = kinds[start:start + unit], 1
        while kinds[start + repeats * unit:start + (repeats + 1) * unit] == pattern:
            repeats += 1
            yield ScanRun(start, unit, repeats)


def plan_runs(kinds: tuple) -> tuple[ScanRun, ...]:
    """The runs of the best plan (``_key``) of a stack whose layer ``l`` has kind ``kinds[l]`` (any
    hashable values: layers of equal kinds may share a unit's offset)."""
    kinds = tuple(kinds)
    best: list = [None] * len(kinds) + [(0, ())]  # best[i]: (unrolled, runs) of layers i..L-1
    for i in reversed(range(len(kinds))):
        loose, runs = best[i + 1]  # layer i unrolled
        options = [(loose + 1, runs)]
        options += [(best[run.stop][0], (run,) + best[run.stop][1]) for run in _runs_at(kinds, i)]
        best[i] = min(options, key=lambda option: _key(*option))
    return best[0][1]


@functools.lru_cache(maxsize=64)
def scan_plan(cfg: ModelConfig) -> ScanPlan | None:
    """The scanned runs of ``cfg`` (None: ``scan_layers`` is off or no unit repeats twice).

    Layers are alike when their mixer kind and dense/MoE choice agree; AttnRes block boundaries
    may fall anywhere (the scanned stream pushes a block when its layer index says so).
    """
    if not cfg.scan_layers:
        return None
    runs = plan_runs(tuple(zip(cfg.layer_kinds, cfg.moe_layers)))
    return ScanPlan(runs, cfg.num_layers) if runs else None


def legacy_layout_error(where: str, plan: ScanPlan) -> str:
    """The message for a tree or checkpoint in the one-run layout (a single ``stack`` entry)."""
    return (f"{where} holds {LEGACY_STACK!r}/offset_{{j}}: the one-run scanned layout of earlier k3jax. This k3jax "
            f"stores each scanned run as stack_{{start}}/offset_{{j}} (this model: "
            f"{', '.join(run.name for run in plan.runs)}); convert the Hugging Face checkpoint again, or "
            f"save it per-layer with the k3jax that wrote it")


def _stack(trees: list) -> Any:
    """Leaves stacked where they live: host arrays with numpy (a checkpoint being loaded), others with jnp."""
    stack = lambda *xs: np.stack(xs) if all(isinstance(x, np.ndarray) for x in xs) else jnp.stack(xs)
    return jax.tree.map(stack, *trees)


def _unstack(tree: Any, repeats: int) -> list:
    return [jax.tree.map(lambda x, r=r: x[r], tree) for r in range(repeats)]


def _check_tree(tree: Any, name: str, plan: ScanPlan) -> None:
    if not isinstance(tree, dict):
        raise ValueError(f"variables[{name!r}] must be a dict of modules, got {type(tree).__name__}")
    if LEGACY_STACK in tree:
        raise ValueError(legacy_layout_error(f"variables[{name!r}]", plan))


def _run_to_scanned(tree: dict, run: ScanRun, name: str) -> dict:
    scanned = {f"layers_{l}" for l in range(run.start, run.stop)}
    present = scanned & tree.keys()
    if not present:  # a collection without per-layer entries in the run (e.g. no MoE there)
        return tree
    if present != scanned:
        missing = sorted(scanned - present, key=lambda k: int(k.split("_")[1]))
        raise ValueError(f"variables[{name!r}] lacks {missing[0]!r}, needed to stack layers "
                         f"{run.start}..{run.stop - 1} (per-layer layout expected)")
    out = {k: v for k, v in tree.items() if k not in scanned}
    out[run.name] = {offset_name(j): _stack([tree[f"layers_{l}"] for l in run.layers(j)]) for j in range(run.unit)}
    return out


def _run_to_per_layer(tree: dict, run: ScanRun, name: str) -> dict:
    if run.name not in tree:
        return tree
    out = {k: v for k, v in tree.items() if k != run.name}
    for j in range(run.unit):
        if offset_name(j) not in tree[run.name]:
            raise ValueError(f"variables[{name!r}][{run.name!r}] lacks {offset_name(j)!r} "
                             f"(the run's unit has {run.unit} offsets)")
        for l, layer in zip(run.layers(j), _unstack(tree[run.name][offset_name(j)], run.repeats)):
            out[f"layers_{l}"] = layer
    return out


def _collection_to_scanned(tree: dict, plan: ScanPlan, name: str) -> dict:
    _check_tree(tree, name, plan)
    stacked = sorted(filter(is_stack_name, tree))
    if stacked:
        raise ValueError(f"variables[{name!r}] already has a {stacked[0]!r} entry: it is in the scanned layout")
    for run in plan.runs:
        tree = _run_to_scanned(tree, run, name)
    return dict(tree)


def _collection_to_per_layer(tree: dict, plan: ScanPlan, name: str) -> dict:
    _check_tree(tree, name, plan)
    foreign = sorted(set(filter(is_stack_name, tree)) - {run.name for run in plan.runs})
    if foreign:
        raise ValueError(f"variables[{name!r}] holds {foreign[0]!r}, not a scanned run of this model "
                         f"(its runs: {', '.join(run.name for run in plan.runs)})")
    for run in plan.runs:
        tree = _run_to_per_layer(tree, run, name)
    return dict(tree)


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
