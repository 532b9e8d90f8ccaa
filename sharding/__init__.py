"""Meshes, logical-axis rules, sharded init, expert- and context-parallel ops (mesh axes live only here)."""

from sharding.context import ParallelConfig, current, use_mesh
from sharding.init import logical_axes, shard_params, sharded_init, shardings_for
from sharding.mesh import AXES, make_mesh, maybe_initialize_distributed
from sharding.spread import map_matrices
from sharding.rules import DATA, EXPERT, SEQUENCE, STRATEGIES, TENSOR, rules_for_mesh

__all__ = [
    "AXES", "DATA", "EXPERT", "SEQUENCE", "STRATEGIES", "TENSOR", "ParallelConfig", "current",
    "logical_axes", "make_mesh", "map_matrices", "maybe_initialize_distributed", "rules_for_mesh", "shard_params",
    "sharded_init", "shardings_for", "use_mesh",
]
