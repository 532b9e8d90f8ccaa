"""``ParallelConfig.in_specs``: shard_map inputs name the size-1 mesh axes, so no one-device psums."""

import re

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sharding import make_mesh, use_mesh
from sharding.cp import causal_conv1d_cp, chunk_kda_cp


def _mesh():
    return make_mesh(data=1, devices=jax.devices()[:1])  # every axis of size 1


def test_in_specs_add_unit_axes_on_the_first_dimension():
    with use_mesh(_mesh()) as ctx:
        specs = ctx.in_specs((P("data", None), P(), P(None, ("expert", "fsdp"))), jnp.zeros((2, 3)),
                             jnp.zeros((4,)), jnp.zeros((2, 2)))
    assert specs[0] == P(("data", "fsdp", "expert", "sequence", "tensor"), None)
    assert specs[1] == P(("data", "fsdp", "expert", "sequence", "tensor"))
    assert specs[2] == P(("data", "sequence", "tensor"), ("expert", "fsdp"))


def _all_reduces(fn, *args):
    return re.findall(r"all-reduce(?:-start)?\(", jax.jit(fn).lower(*args).compile().as_text())


def test_cp_backward_has_no_one_device_all_reduce():
    B, T, H, K = 1, 16, 2, 8
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    q, k, v, g = (jax.random.normal(kk, (B, T, H, K)) for kk in ks[:4])
    g = -jax.nn.sigmoid(g)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H)))
    x, w = jax.random.normal(ks[0], (B, T, H * K)), jax.random.normal(ks[1], (H * K, 4))
    with use_mesh(_mesh()):
        kda = _all_reduces(jax.grad(lambda *a: jnp.sum(chunk_kda_cp(*a, chunk_size=8)), (0, 1, 2, 3, 4)),
                           q, k, v, g, beta)
        conv = _all_reduces(jax.grad(lambda x, w: jnp.sum(causal_conv1d_cp(x, w)), (0, 1)), x, w)
    assert kda == [] and conv == [], (kda, conv)
