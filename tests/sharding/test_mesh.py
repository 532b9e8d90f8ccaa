"""Mesh sizes, rule tables and the parallel context (one process, no fake devices needed)."""

import flax.linen as nn
import jax
import pytest
from jax.sharding import AbstractMesh, AxisType, PartitionSpec

from sharding import AXES, DATA, EXPERT, SEQUENCE, TENSOR, current, make_mesh, rules_for_mesh, use_mesh
from sharding.mesh import resolve_axis_sizes


def _abstract(**sizes):
    shape = tuple(sizes.get(a, 1) for a in AXES)
    return AbstractMesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def test_rest_axis_fills_the_devices():
    assert resolve_axis_sizes(dict(data=-1, expert=2, sequence=2), 8) == dict(data=2, expert=2, sequence=2)


@pytest.mark.parametrize("sizes, devices, needle", [
    (dict(data=3, expert=2), 8, "multiply to 6 but there are 8 devices"),
    (dict(data=-1, expert=3), 8, "multiply to 3, which does not divide the 8 devices"),
    (dict(data=-1, expert=-1), 8, "at most one mesh axis may be -1"),
    (dict(data=0), 8, "must be positive"),
])
def test_bad_sizes_name_the_sizes(sizes, devices, needle):
    with pytest.raises(ValueError, match=needle):
        resolve_axis_sizes(sizes, devices)


def test_make_mesh_on_one_device():
    mesh = make_mesh(data=-1, devices=jax.devices()[:1])
    assert mesh.axis_names == AXES and mesh.devices.size == 1
    with pytest.raises(ValueError, match="expert"):
        make_mesh(data=1, expert=2, devices=jax.devices()[:1])


@pytest.mark.parametrize("sizes, rules", [
    (dict(data=8), DATA), (dict(data=2, fsdp=4), DATA), (dict(data=2, expert=4), EXPERT),
    (dict(data=2, expert=2, sequence=2), SEQUENCE), (dict(sequence=4, tensor=2), TENSOR),
])
def test_smallest_table_covering_the_mesh(sizes, rules):
    assert rules_for_mesh(_abstract(**sizes)) == rules


def test_params_and_activations_share_one_table():
    to_mesh = lambda *names: nn.logical_to_mesh_axes(names, TENSOR)
    # Activations: batch takes fsdp first, so the hidden axis stays whole.
    assert to_mesh("batch", "length", "embed") == PartitionSpec(("data", "fsdp", "expert"), "sequence", None)
    assert to_mesh("batch", "length", "heads", "head_dim") == PartitionSpec(
        ("data", "fsdp", "expert"), "sequence", "tensor", None)
    # Parameters (docs/params.md names): ZeRO-3 on embed, experts whole per expert rank.
    assert to_mesh("embed", "heads", "head_dim") == PartitionSpec("fsdp", "tensor", None)
    assert to_mesh("experts", "latent", "expert_mlp") == PartitionSpec("expert", "fsdp", "tensor")
    assert to_mesh("vocab", "embed") == PartitionSpec("tensor", "fsdp")


@pytest.mark.parametrize("rules,dense,stack", [(EXPERT, ("fsdp", "expert"), "fsdp"),
                                               (SEQUENCE, ("fsdp", "sequence", "expert"), ("fsdp", "sequence"))])
def test_training_tables_shard_dense_weights_over_every_batch_axis(rules, dense, stack):
    """The expert axis carries batch outside the MoE: the dense weights shard over it as well as
    fsdp (K3's dense state 16× smaller on fsdp=64, expert=16); expert stacks keep their experts on
    it and their width on fsdp; activations are unchanged. The sequence axis's ranks hold other
    tokens of the same rows: under context parallel they shard every weight too (a 1 M-token context
    wants sequence=128 and few sequences, which leave the batch axes too small for K3's state)."""
    to_mesh = lambda *names: nn.logical_to_mesh_axes(names, rules)
    assert to_mesh("embed", "heads", "head_dim") == PartitionSpec(dense, None, None)
    assert to_mesh("layers", "q_lora", "heads") == PartitionSpec(None, dense, None)
    assert to_mesh("vocab", "embed") == PartitionSpec(None, dense)
    assert to_mesh("layers", "experts", "latent", "expert_mlp") == PartitionSpec(None, "expert", stack, None)
    assert to_mesh("embed", "experts") == PartitionSpec(stack, "expert")  # the router
    assert to_mesh("batch", "embed")[1] is None


def test_context_is_scoped():
    mesh = make_mesh(devices=jax.devices()[:1])
    assert current() is None
    with use_mesh(mesh, ep_reserve=0.5) as ctx:
        assert current() is ctx and ctx.ep_reserve == 0.5 and not ctx.expert_parallel
        assert nn.get_logical_axis_rules() == ctx.rules
    assert current() is None
    with pytest.raises(ValueError, match="ep_strategy"):
        with use_mesh(mesh, ep_strategy="ring"):
            pass


def test_an_axis_that_does_not_divide_its_dim_moves_to_another():
    """K3 on fsdp=64, expert=32: ``embed`` = 7168 = 7·1024 takes fsdp but not fsdp × expert; expert
    goes to the weight's widest other dim it divides instead of leaving 32 copies, never to the
    scanned stack's ``layers``; with nowhere to go it is dropped (replicated)."""
    from sharding.init import fitted_spec

    mesh = _abstract(fsdp=64, expert=32)
    assert fitted_spec(("embed", "heads", "head_dim"), (7168, 96, 128), mesh, EXPERT) == PartitionSpec(
        "fsdp", None, "expert")
    assert fitted_spec(("layers", "embed", "mlp"), (32, 7168, 100), mesh, EXPERT) == PartitionSpec(None, "fsdp", None)
    assert fitted_spec(("embed", "heads"), (2048, 96), mesh, EXPERT) == PartitionSpec(("fsdp", "expert"), None)
    # K3 at a 1 M-token context (expert=16, sequence=256): embed = 7168 takes sequence, and expert,
    # which no longer divides it, moves to head_dim; kv_b's kv_lora = 512 likewise.
    long = _abstract(expert=16, sequence=256)
    assert fitted_spec(("embed", "heads", "head_dim"), (7168, 96, 128), long, SEQUENCE) == PartitionSpec(
        ("fsdp", "sequence"), None, "expert")
    assert fitted_spec(("kv_lora", "heads", "head_dim"), (512, 96, 256), long, SEQUENCE) == PartitionSpec(
        ("fsdp", "sequence"), None, "expert")
