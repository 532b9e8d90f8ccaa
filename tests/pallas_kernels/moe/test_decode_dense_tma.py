"""The dense path's Mosaic GPU expert kernels (``kernel_gpu_decode_dense_tma``) against the Pallas-Triton
kernels and the rounded definition, in the GPU interpreter; their width checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import kernel_gpu_decode_dense, kernel_gpu_decode_dense_tma as tma
from tests.pallas_kernels.moe.test_decode_kernel import _assert_within_ulps, _inputs, _rounded_reference


@pytest.mark.parametrize("T,E,L,F,activation,tiles", [
    (8, 4, 256, 256, "situ", tma.TmaTiles()),            # one column tile a weight, 2 slots; 2 tiles a CTA
    (64, 2, 128, 256, "swiglu", tma.TmaTiles(64, 64, 3)),  # every token row used; 2 K steps of 3 slots
    (1, 3, 128, 384, "situ", tma.TmaTiles(64, 64, 2)),    # one token; 3 column tiles of gate/up, 1 of down
    (1, 3, 128, 384, "swiglu", tma.TmaTiles(64, 64, 3)),  # the ring's 3 slots across tiles of 2 K steps
])
def test_interpreted_expert_outputs(T, E, L, F, activation, tiles):
    """Every expert's output on every token equals the Triton kernels' and, per expert, the definition
    that rounds g, u, the activation and the output to bf16 (fp32 sums in another order may flip one)."""
    x, _, _, ws = _inputs(7, T, 1, E, L, F)
    got = tma.expert_outputs(x, *ws, activation=activation, tiles=tiles, interpret=True)
    assert got.shape == (E, T, L) and got.dtype == jnp.bfloat16
    triton = kernel_gpu_decode_dense.expert_outputs(x, *ws, activation=activation, interpret=True,
                                                    tiles=kernel_gpu_decode_dense.default_tiles(L, F))
    _assert_within_ulps(got, triton, max_fraction=0.05)
    for e in range(E):
        ids = jnp.full((T, 1), e, jnp.int32)
        ref = _rounded_reference(x, ids, jnp.ones((T, 1), jnp.float32), ws, activation)
        _assert_within_ulps(got[e], ref, max_fraction=0.05)


@pytest.mark.parametrize("T,K,N,match", [
    (65, 128, 256, "1..64 tokens"), (0, 128, 256, "1..64 tokens"),
    (8, 96, 256, "K=96 must be a multiple of tiles.tile_k=64"), (8, 128, 192, "N=192 .* 2·tiles.tile_n=256"),
])
def test_widths_it_cannot_take_are_named(T, K, N, match):
    with pytest.raises(ValueError, match=match):
        tma.check_widths(T, K, N, tma.TmaTiles(), "gate_up")


def test_the_dense_path_takes_them_where_they_fit(monkeypatch):
    """``kernel_gpu_decode_dense.expert_outputs`` without tiles runs these kernels at up to 64 tokens and
    widths of whole column tiles (small()'s 512, K3's 3584 x 3072), the Triton kernels otherwise."""
    assert tma.takes(64, 512, 512) and tma.takes(1, 3584, 3072)
    assert not tma.takes(65, 512, 512) and not tma.takes(16, 64, 128) and not tma.takes(16, 512, 192)
    calls = []
    run = tma.expert_outputs
    monkeypatch.setattr(tma, "expert_outputs", lambda *a, **kw: calls.append(a[0].shape) or run(*a, **kw))
    x, _, _, ws = _inputs(1, 16, 1, 2, 128, 128)
    kernel_gpu_decode_dense.expert_outputs(x, *ws, activation="situ", interpret=True)
    assert calls == [(16, 128)]
    kernel_gpu_decode_dense.expert_outputs(x, *ws, activation="situ", tiles=kernel_gpu_decode_dense.WIDE,
                                           interpret=True)
    assert calls == [(16, 128)]  # a Triton tiling asked for: the Triton kernels
    from pallas_kernels.target import Target, compile_for

    with compile_for(Target("gpu", "NVIDIA A100-SXM4-80GB", cuda=True)):  # no TMA / wgmma: the Triton kernels
        jax.make_jaxpr(lambda *a: kernel_gpu_decode_dense.expert_outputs(*a, activation="situ"))(x, *ws)
    with compile_for(Target("gpu", "NVIDIA H200", num_cores=132, cuda=True)):
        jax.make_jaxpr(lambda *a: kernel_gpu_decode_dense.expert_outputs(*a, activation="situ"))(x, *ws)
    assert calls == [(16, 128)] * 2


def test_the_routed_dense_path_takes_them_too(monkeypatch):
    """The decode step's entry (routing in the combine) reaches them as well when no tiling is asked for."""
    from k3jax.layers.routing import RENORM_EPS
    from pallas_kernels.moe.rank_routing import Routing

    calls = []
    run = tma.expert_outputs
    monkeypatch.setattr(tma, "expert_outputs", lambda *a, **kw: calls.append(a[0].shape) or run(*a, **kw))
    x, _, _, ws = _inputs(2, 16, 1, 16, 128, 128)  # the routing needs 16 experts or more
    scores = jnp.asarray(np.random.default_rng(0).uniform(size=(16, 16)), jnp.float32)
    got = kernel_gpu_decode_dense.routed_dense_experts_pallas(
        x, scores, jnp.zeros(16, jnp.float32), *ws, routing=Routing(2, True, 1.0, RENORM_EPS), activation="situ",
        interpret=True)
    assert calls == [(16, 128)] and got.shape == x.shape
