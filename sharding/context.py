"""The parallel context: which mesh and rules are active, read by the model at trace time.

``with sharding.use_mesh(mesh):`` sets three things for the code traced inside it: the JAX mesh
(``jax.set_mesh``, so ``nn.with_logical_constraint`` can resolve), flax's logical-axis rules, and a
:class:`ParallelConfig` that the model's MoE, KDA and MLA call sites look up through
:func:`current` to decide whether to run the expert- or context-parallel path. Without a context
(or with a 1-device mesh) the model runs its single-device code unchanged.

Trace inside the context: the context is read when ``jit`` traces, not when it runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.rules import Rules, mesh_axes_of, rules_for_mesh, spec

_CURRENT: contextvars.ContextVar["ParallelConfig | None"] = contextvars.ContextVar("k3jax_parallel", default=None)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """A mesh, its logical rules, and the mesh axes the EP / CP paths communicate over."""

    mesh: Mesh
    rules: Rules
    expert_axis: str = "expert"
    sequence_axis: str = "sequence"
    # EP: per-destination buffer = plan · (1 + reserve); QB keeps loads near the plan.
    ep_reserve: float = 0.25
    # "a2a" (all-to-all, overflow falls back to "gather") or "gather" (all-gather + reduce-scatter).
    ep_strategy: str = "a2a"

    def __post_init__(self):
        if self.ep_strategy not in ("a2a", "gather"):
            raise ValueError(f"ep_strategy={self.ep_strategy!r} must be 'a2a' or 'gather'")
        if self.ep_reserve < 0:
            raise ValueError(f"ep_reserve={self.ep_reserve} must be >= 0")

    def axis_size(self, name: str | None) -> int:
        return 1 if name is None else int(self.mesh.shape.get(name, 1))

    @property
    def expert_size(self) -> int:
        return self.axis_size(self.expert_axis)

    @property
    def sequence_size(self) -> int:
        return self.axis_size(self.sequence_axis)

    @property
    def expert_parallel(self) -> bool:
        return self.expert_size > 1

    @property
    def sequence_parallel(self) -> bool:
        return self.sequence_size > 1

    @property
    def batch_axes(self) -> tuple[str, ...]:
        return mesh_axes_of(self.rules, "batch")

    @property
    def length_axes(self) -> tuple[str, ...]:
        return mesh_axes_of(self.rules, "length")

    @property
    def token_axes(self) -> tuple[str, ...]:
        """Every mesh axis that carries distinct tokens (batch, then length): psum token statistics
        over these inside ``shard_map`` bodies whose in_specs come from the same rules."""
        return self.batch_axes + self.length_axes

    def spec(self, *logical: str | None) -> PartitionSpec:
        return spec(self.rules, *logical)

    def sharding(self, *logical: str | None) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(*logical))

    def in_specs(self, specs: tuple[PartitionSpec, ...], *arrays) -> tuple[PartitionSpec, ...]:
        """``shard_map`` in_specs for ``arrays``: each spec plus the size-1 mesh axes it leaves out.

        The transpose of ``shard_map`` (``check_vma=False``) psums an input's cotangent over every
        mesh axis its spec does not name. Over a size-1 axis that is an all-reduce of one device,
        which XLA keeps (on CPU it copies the whole cotangent: every KDA and MoE input, each
        layer); naming those axes on the first dimension changes no placement and drops it.
        """
        return tuple(self._name_unit_axes(spec, jnp.ndim(x)) for spec, x in zip(specs, arrays, strict=True))

    def _name_unit_axes(self, spec: PartitionSpec, ndim: int) -> PartitionSpec:
        entries = list(spec) + [None] * (ndim - len(spec))
        named = {a for e in entries if e is not None for a in ((e,) if isinstance(e, str) else e)}
        unit = tuple(a for a, n in self.mesh.shape.items() if n == 1 and a not in named)
        if not unit or not entries:
            return spec
        first = () if entries[0] is None else ((entries[0],) if isinstance(entries[0], str) else tuple(entries[0]))
        return PartitionSpec(first + unit, *entries[1:])


def current() -> ParallelConfig | None:
    """The active parallel context, or None (single device / no mesh)."""
    return _CURRENT.get()


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Rules | None = None, **options) -> Iterator[ParallelConfig]:
    """Activate ``mesh`` and ``rules`` (default: :func:`rules_for_mesh`) for code traced inside.

    ``options`` are further :class:`ParallelConfig` fields (``ep_reserve``, ``ep_strategy``).
    """
    cfg = ParallelConfig(mesh=mesh, rules=rules_for_mesh(mesh) if rules is None else rules, **options)
    token = _CURRENT.set(cfg)
    try:
        with jax.set_mesh(mesh), nn.logical_axis_rules(cfg.rules):
            yield cfg
    finally:
        _CURRENT.reset(token)
