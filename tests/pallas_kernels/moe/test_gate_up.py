"""``moe_ffn(gate_up="split")``: the gate and up products apart (no ``[W1 | W3]`` copy in the
forward, no split of the weight gradient) give the packed path's values bit for bit forward and in
the gradients that only the forward's products feed (the routing weights, ``w2``), on the GPU and
TPU kernels (interpreted on CPU) — the products' sums are the same sums. Since stop 40 the split
form recomputes the activation's derivatives in fp32 in the backward where the packed form stores
them in bf16, so the gradients of ``x``, ``w1`` and ``w3`` differ by that one rounding."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import kernel_gpu, kernel_gpu_tgmm, kernel_tpu, moe_ffn
from tests.pallas_kernels.moe.conftest import random_moe_inputs
from tests.tolerances import BF16_GRAD_RTOL, rel_rmse

SMALL_GPU = kernel_gpu.GpuTiling(tile_m=64, tile_n=64, tile_k=64, stages=2)
SMALL_TPU = kernel_tpu.TpuTiling(tile_m=32, tile_k=128, tile_n=128)


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(kernel_gpu, "GMM_TILING", SMALL_GPU)
    monkeypatch.setattr(kernel_gpu, "GMM_TILING_T", SMALL_GPU)
    monkeypatch.setattr(kernel_gpu, "GMM_SUM_TILING", dataclasses.replace(SMALL_GPU, ring=True))
    monkeypatch.setattr(kernel_gpu_tgmm, "TGMM_TILING", SMALL_GPU)
    monkeypatch.setattr(kernel_tpu, "GMM_TILING", SMALL_TPU)
    monkeypatch.setattr(kernel_tpu, "TGMM_TILING", SMALL_TPU)


def _value_and_grads(gate_up: str, backend: str):
    ffn = functools.partial(moe_ffn, implementation="pallas", interpret=True, kernel_backend=backend, gate_up=gate_up)

    def loss(x, w, w1, w3, w2, ids, cot):
        y = ffn(x, ids, w, w1, w3, w2)
        return jnp.sum(y.astype(jnp.float32) * cot), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_split_gate_up_equals_packed_bitwise(backend):
    x, ids, w, w1, w3, w2 = random_moe_inputs(0, 48, 128, 128, 4, 2, jnp.bfloat16)
    cot = jax.random.normal(jax.random.PRNGKey(3), x.shape)
    (_, y_packed), g_packed = _value_and_grads("packed", backend)(x, w, w1, w3, w2, ids, cot)
    (_, y_split), g_split = _value_and_grads("split", backend)(x, w, w1, w3, w2, ids, cot)
    assert np.any(np.asarray(y_packed, np.float32))
    np.testing.assert_array_equal(np.asarray(y_split, np.float32), np.asarray(y_packed, np.float32))
    for name, a, b in zip(("x", "weights", "w1", "w3", "w2"), g_split, g_packed):
        assert np.any(np.asarray(b, np.float32)), name
        if name in ("weights", "w2"):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)
        else:  # the stored bf16 derivatives' rounding apart
            assert rel_rmse(a, b) <= BF16_GRAD_RTOL, name


def test_gate_up_must_be_named():
    x, ids, w, w1, w3, w2 = random_moe_inputs(0, 8, 16, 16, 4, 2, jnp.float32)
    with pytest.raises(ValueError, match="gate_up"):
        moe_ffn(x, ids, w, w1, w3, w2, gate_up="fused")
