"""Logical-axis rules: one small table per parallelism strategy.

A rule ``(logical, mesh_axes)`` shards every array dimension named ``logical`` over ``mesh_axes``
when those mesh axes are still free in that array (flax's ``logical_to_mesh_axes``: first
matching rule wins, a mesh axis is used once per array). One table serves parameters and
activations: ``batch`` comes first, so in an activation ``(batch, length, embed)`` the ``fsdp``
axis is taken by ``batch`` and ``embed`` stays whole, while a parameter ``(embed, heads, ...)``
has no ``batch`` and so shards ``embed`` over ``fsdp`` (ZeRO-3 style, gathered per layer).

Logical names: the parameter names of docs/params.md plus these activation names
``batch``, ``length`` (tokens of a row), ``embed``, ``heads``, ``head_dim``, ``latent``,
``mlp``, ``expert_mlp``, ``experts``, ``vocab``, ``kv_lora``, and ``layers`` (the scanned stack's
parameter axis, replicated). Names not in a table stay unsharded.
"""

from __future__ import annotations

from jax.sharding import AbstractMesh, Mesh, PartitionSpec

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

# Parameters without a batch axis spread their widest "model" axis over fsdp. The scanned stack's
# leading "layers" axis stays whole: each scan step reads one layer's slice on every device.
_FSDP_PARAMS: Rules = (
    ("layers", None),
    ("embed", "fsdp"),
    ("latent", "fsdp"),
    ("q_lora", "fsdp"),
    ("kv_lora", "fsdp"),
)

# Outside the MoE the expert axis carries batch, so for the dense weights it is one more data
# axis: they shard over fsdp × expert (ZeRO-3 over every rank that holds a different batch shard).
# An expert stack has the expert axis on its experts already, so its widths fall through to the
# fsdp-only rule. Per device the dense state shrinks by the expert size (K3 on fsdp=64, expert=16:
# 0.22 GB of fp32 instead of 3.6 GB per copy), and a dense gradient is one reduce-scatter over both
# axes instead of a reduce-scatter over fsdp plus an all-reduce over expert.
_FSDP_EXPERT_PARAMS: Rules = tuple((name, ("fsdp", "expert")) for name, axes in _FSDP_PARAMS if axes == "fsdp")

# Pure data parallel (fsdp=1) or data + FSDP.
DATA: Rules = (("batch", ("data", "fsdp")),) + _FSDP_PARAMS

# Experts live whole on their expert-axis rank; outside the MoE the expert axis carries batch.
EXPERT: Rules = (
    ("batch", ("data", "fsdp", "expert")),
    ("experts", "expert"),
) + _FSDP_EXPERT_PARAMS + _FSDP_PARAMS

# Context parallel: the tokens of a row are split over the sequence axis. Its ranks hold different
# tokens, so for the weights they are data ranks too: ZeRO-3 over fsdp × sequence × expert (expert
# stacks: their widths over fsdp × sequence). Without it the weights and optimizer state shard only
# over the batch axes, and a long context, which wants few sequences and many sequence ranks, leaves
# too few of those: K3 at 1 M tokens on 4096 chips as expert=32, sequence=128 would hold 1/32 of
# its 33 TB of training state per chip instead of 1/4096.
# Sequence before expert: a long context's sequence axis (256) is the larger, and where the product
# does not divide a width (K3's embed = 7168 = 7·1024) the axis left over moves to another dim
# (`sharding.init.fitted_spec`): expert=16 finds one (head_dim = 128), sequence=256 would not and
# was dropped, which replicated K3's attention weights 256 times (24.3 GB of arguments per chip
# instead of ~8 on expert=16, sequence=256).
_FSDP_EXPERT_SEQUENCE_PARAMS: Rules = (
    tuple((name, ("fsdp", "sequence", "expert")) for name, axes in _FSDP_PARAMS if axes == "fsdp")
    + tuple((name, ("fsdp", "sequence")) for name, axes in _FSDP_PARAMS if axes == "fsdp"))
SEQUENCE: Rules = (
    ("batch", ("data", "fsdp", "expert")),
    ("length", "sequence"),
    ("experts", "expert"),
) + _FSDP_EXPERT_SEQUENCE_PARAMS + _FSDP_EXPERT_PARAMS + _FSDP_PARAMS

# Megatron-style tensor parallel over heads and MLP widths, on top of everything above. The dense
# weights stay off the expert axis: this is the serving table, where they should stay resident
# (decode would otherwise gather them over the expert axis for every token).
TENSOR: Rules = (
    ("batch", ("data", "fsdp", "expert")),
    ("length", "sequence"),
    ("experts", "expert"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("expert_mlp", "tensor"),
    ("vocab", "tensor"),
) + _FSDP_PARAMS

STRATEGIES: dict[str, Rules] = {"data": DATA, "expert": EXPERT, "sequence": SEQUENCE, "tensor": TENSOR}


def _used_axes(rules: Rules) -> set[str]:
    used = set()
    for _, axes in rules:
        if axes is not None:
            used.update((axes,) if isinstance(axes, str) else axes)
    return used


def rules_for_mesh(mesh: Mesh | AbstractMesh) -> Rules:
    """The smallest strategy table that uses every mesh axis of size > 1."""
    needed = {name for name, size in mesh.shape.items() if size > 1}
    for rules in (DATA, EXPERT, SEQUENCE, TENSOR):
        if needed <= _used_axes(rules):
            return rules
    raise ValueError(f"no rule table covers the mesh axes {sorted(needed)}; mesh {dict(mesh.shape)}")


def mesh_axes_of(rules: Rules, logical: str) -> tuple[str, ...]:
    """The mesh axes a logical name maps to (empty when unsharded)."""
    for name, axes in rules:
        if name == logical:
            if axes is None:
                return ()
            return (axes,) if isinstance(axes, str) else tuple(axes)
    return ()


def spec(rules: Rules, *logical: str | None) -> PartitionSpec:
    """``PartitionSpec`` of an array whose dimensions carry the given logical names."""
    import flax.linen as nn

    return nn.logical_to_mesh_axes(tuple(logical), rules)
