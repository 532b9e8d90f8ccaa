"""The dense path's one-kernel experts (``kernel_gpu_decode_dense_fused``) in the GPU interpreter: equal to the
two-kernel path bit for bit, free of shared-memory races, and its width checks."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.moe import kernel_gpu_base, kernel_gpu_decode_dense_fused as fused
from pallas_kernels.moe import kernel_gpu_decode_dense_tma as tma
from tests.pallas_kernels.moe.test_decode_kernel import _assert_within_ulps, _inputs, _rounded_reference


@pytest.mark.parametrize("T,E,L,F,activation", [
    (8, 3, 256, 256, "situ"),     # 2 interpreted SMs: one CTA takes two experts (a_e overwritten)
    (64, 2, 512, 512, "swiglu"),  # small()'s widths, every token row used
    (1, 4, 256, 128, "situ"),     # one token; one gate/up column tile
])
def test_interpreted_fused_equals_the_two_kernels(T, E, L, F, activation):
    """Same rounding points and k-slab order as ``gate_up`` then ``down``: the same bits; and per expert
    the definition that rounds g, u, the activation and the output to bf16."""
    x, _, _, ws = _inputs(7, T, 1, E, L, F)
    got = fused.expert_outputs(x, *ws, activation=activation, interpret=True)
    assert got.shape == (E, T, L) and got.dtype == jnp.bfloat16
    two = tma.gate_up(x, ws[0], ws[1], activation=activation, tiles=tma.TmaTiles(64, 64, 3), interpret=True)
    two = tma.down(two, ws[2], tiles=tma.TmaTiles(64, 64, 3), interpret=True)[:, :T]
    assert jnp.array_equal(got, two)
    for e in range(E):
        ref = _rounded_reference(x, jnp.full((T, 1), e, jnp.int32), jnp.ones((T, 1), jnp.float32), ws, activation)
        _assert_within_ulps(got[e], ref, max_fraction=0.05)


def test_no_shared_memory_race(monkeypatch):
    """The race detector finds no slot overwritten by TMA while a warpgroup reads it, across two phases
    and two experts a CTA (it fails without the ring's wait for a slot's release; the interpreter runs
    warpgroups in an order that does not expose the ``a_e`` barrier)."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    monkeypatch.setattr(kernel_gpu_base, "_DETECT_RACES", True)
    x, _, _, ws = _inputs(3, 8, 1, 3, 256, 256)
    jax.block_until_ready(fused.expert_outputs(x, *ws, activation="situ", interpret=True))
    assert not get_races().races_found


@pytest.mark.parametrize("T,L,F,match", [
    (65, 512, 512, "T=65 tokens must be in 1..64"), (0, 512, 512, "T=0"),
    (8, 384, 512, "L=384 must be a multiple of 256"), (8, 512, 192, "F=192 of 128"),
    (8, 512, 1024, "F=1024 needs .* bytes of shared memory"),
])
def test_widths_it_cannot_take_are_named(T, L, F, match):
    with pytest.raises(ValueError, match=match):
        fused.check_widths(T, L, F)
    assert not fused.takes(T, L, F)


def test_takes_small_but_not_k3():
    """small()'s experts (L = F = 512) fit; K3's (3584 x 3072) do not: a_e would need 384 KB."""
    assert fused.takes(64, 512, 512) and fused.takes(1, 512, 512)
    assert not fused.takes(64, 3584, 3072)


@pytest.mark.gpu
@pytest.mark.parametrize("T,activation", [(64, "situ"), (40, "swiglu")])
def test_compiled_fused_equals_the_two_kernels(T, activation):
    """Compiled for the GPU at small()'s experts (64 of 512 x 512): the same bits as the two kernels."""
    x, _, _, ws = _inputs(11, T, 1, 64, 512, 512)
    got = jax.jit(lambda *a: fused.expert_outputs(*a, activation=activation))(x, *ws)
    two = jax.jit(lambda *a: tma.expert_outputs(*a, activation=activation))(x, *ws)
    assert jnp.array_equal(got, two)
