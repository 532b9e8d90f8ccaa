"""``kernel_gpu.gmm_glu``: the gate/up grouped matmul with the activation in its epilogue (ping-pong
rings), against its plain-JAX reference (``reference.gmm_glu_ragged``), interpreted on CPU and compiled
with ``-m gpu``; and ``moe_ffn(gate_up="fused")``, which runs it, against the XLA path in values and
all gradients."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import kernel_gpu, kernel_gpu_base, kernel_gpu_tgmm, moe_ffn
from pallas_kernels.moe.reference import deinterleave, gmm_glu_ragged, interleave
from tests.pallas_kernels.moe.conftest import random_moe_inputs
from tests.tolerances import BF16_FWD_RTOL, BF16_GRAD_RTOL, rel_rmse

E = 4
SMALL = kernel_gpu.GpuTiling(tile_m=64, tile_n=64, tile_k=64, stages=2)
SMALL_GLU = dataclasses.replace(SMALL, ring=True, ping_pong=True)
# empty groups, all rows in one group, a ragged tail of rows in no group (stored as zeros)
GROUP_CASES = [[40, 0, 70, 0], [0, 150, 0, 0]]
ACTIVATIONS = [("situ", 4.0, 25.0), ("swiglu", 4.0, 25.0)]


@pytest.fixture
def small_gpu_tiles(monkeypatch):
    for name in ("GMM_TILING", "GMM_TILING_T"):
        monkeypatch.setattr(kernel_gpu, name, SMALL)
    monkeypatch.setattr(kernel_gpu, "GLU_TILING", SMALL_GLU)
    monkeypatch.setattr(kernel_gpu, "GMM_SUM_TILING", dataclasses.replace(SMALL, ring=True))
    monkeypatch.setattr(kernel_gpu_tgmm, "TGMM_TILING", SMALL)


def test_interleave_round_trip():
    w1 = jnp.arange(2 * 3 * 8, dtype=jnp.float32).reshape(2, 3, 8)
    w3 = -w1
    w = interleave(w1, w3, 4)
    np.testing.assert_array_equal(w[0, 0], [0, 1, 2, 3, 0, -1, -2, -3, 4, 5, 6, 7, -4, -5, -6, -7])
    for a, b in zip(deinterleave(w, 4), (w1, w3)):
        np.testing.assert_array_equal(a, b)


class GluKernelCase:
    interpret = True
    tiling = SMALL_GLU
    m, k, f = 150, 128, 128  # two N tiles of 128: one CTA's tiles alternate between the warpgroups
    cases = GROUP_CASES

    @pytest.mark.parametrize("glu", ACTIVATIONS, ids=lambda g: g[0])
    def test_matches_reference(self, glu):
        x, _, _, w1, w3, _ = random_moe_inputs(0, self.m, self.k, self.f, E, 2, jnp.bfloat16)
        x = x * 3  # products of a few units: tanh and the sigmoid away from their linear parts
        block = (self.tiling or kernel_gpu.GLU_TILING).cta_n() // 2
        run = jax.jit(functools.partial(kernel_gpu.gmm_glu, glu=glu, tiling=self.tiling, interpret=self.interpret))
        for case in self.cases:
            gs = jnp.asarray(case, jnp.int32)
            a, d = run(x, interleave(w1, w3, block), gs)
            want_a, want_d = gmm_glu_ragged(x, w1, w3, gs, glu, block)
            total = int(gs.sum())
            assert a.shape == (self.m, self.f) and d.shape == (self.m, 2 * self.f)
            assert not np.any(np.asarray(a[total:], np.float32)) and not np.any(np.asarray(d[total:], np.float32))
            f32 = lambda v: np.asarray(v[:total], np.float32)
            assert np.any(f32(a)), case
            assert rel_rmse(f32(a), f32(want_a)) < BF16_FWD_RTOL, case
            assert rel_rmse(f32(d), f32(want_d)) < BF16_FWD_RTOL, case


class TestGluInterpret(GluKernelCase):
    pass


def test_refuses_tilings_without_ping_pong():
    x, _, _, w1, w3, _ = random_moe_inputs(0, 64, 128, 64, E, 2, jnp.bfloat16)
    with pytest.raises(ValueError, match="gmm_glu needs a ping-pong tiling"):
        kernel_gpu.gmm_glu(x, interleave(w1, w3, 32), jnp.asarray([16] * 4, jnp.int32), glu=ACTIVATIONS[0],
                           tiling=dataclasses.replace(SMALL, ring=True), interpret=True)


def test_fused_needs_the_gpu_kernel():
    x, ids, w, w1, w3, w2 = random_moe_inputs(0, 16, 32, 32, E, 2, jnp.float32)
    with pytest.raises(ValueError, match="gate_up='fused' runs the Hopper GPU kernel"):
        moe_ffn(x, ids, w, w1, w3, w2, implementation="xla", gate_up="fused")


def test_lowers_for_cuda_at_small_width(monkeypatch):
    """The default tiling lowers for CUDA at ``small()``'s routed-expert shape (M = 32 768 tokens × 8)."""
    monkeypatch.setattr(kernel_gpu_base, "_num_sms", lambda interpret: 132)
    S = jax.ShapeDtypeStruct
    args = (S((262144, 512), jnp.bfloat16), S((64, 512, 1024), jnp.bfloat16), S((64,), jnp.int32))
    low = kernel_gpu.gmm_glu.trace(*args, glu=ACTIVATIONS[0]).lower(lowering_platforms=("cuda",))
    assert low.as_text().count("custom_call @mosaic_gpu") == 1


def _ffn_value_and_grads(**impl):
    def loss(x, w, w1, w3, w2, ids, cot):
        y = moe_ffn(x, ids, w, w1, w3, w2, **impl)
        return jnp.sum(y.astype(jnp.float32) * cot), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))


@pytest.mark.usefixtures("small_gpu_tiles")
@pytest.mark.parametrize("activation", ["situ", "swiglu"])
def test_moe_ffn_runs_the_fused_product_and_matches_xla(activation):
    """``moe_ffn(gate_up="fused")`` on the GPU kernel (``gmm_glu`` forward, the packed backward in its
    interleaved layout) against the XLA path's values and gradients, with F padded (96 → 128)."""
    x, ids, w, w1, w3, w2 = random_moe_inputs(0, 48, 128, 96, E, 2, jnp.bfloat16)
    x = x * 3
    cot = jax.random.normal(jax.random.PRNGKey(3), x.shape)
    impl = dict(implementation="pallas", interpret=True, kernel_backend="gpu", activation=activation, gate_up="fused")
    jaxpr = str(jax.make_jaxpr(functools.partial(moe_ffn, **impl))(x, ids, w, w1, w3, w2))
    assert "moe_gmm_glu" in jaxpr
    (_, y), grads = _ffn_value_and_grads(**impl)(x, w, w1, w3, w2, ids, cot)
    f32 = lambda v: v.astype(jnp.float32)
    (_, want), want_grads = _ffn_value_and_grads(implementation="xla", activation=activation)(
        *(f32(v) for v in (x, w, w1, w3, w2)), ids, cot)
    assert rel_rmse(f32(y), want) < BF16_FWD_RTOL
    for name, a, b in zip(("x", "weights", "w1", "w3", "w2"), grads, want_grads):
        assert a.shape == b.shape and np.any(np.asarray(b)), name
        assert rel_rmse(f32(a), b) < BF16_GRAD_RTOL, name


@pytest.mark.gpu
class TestGluCompiled(GluKernelCase):
    """Compiled on the GPU with the default tiling: 132 SMs, ``small()``'s widths (K = F = 512)."""
    interpret, tiling = False, None
    m, k, f = 4000, 512, 512
    cases = GROUP_CASES + [[1000, 7, 2900, 93]]
