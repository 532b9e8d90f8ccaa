"""Pallas TPU grouped-matmul kernels in TPU interpret mode on CPU, with the GPU suite's cases."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from pallas_kernels.moe import grouped_matmul, kernel_tpu
from pallas_kernels.moe.reference import grouped_matmul_dense
from tests.pallas_kernels.moe.conftest import group_sizes_strategy, random_gmm_inputs
from tests.pallas_kernels.moe.test_kernel_gpu_interpret import GpuKernelCase
from tests.tolerances import BF16_FWD_RTOL, BF16_GRAD_RTOL, rel_rmse

SMALL = kernel_tpu.TpuTiling(tile_m=32, tile_k=128, tile_n=128)


@pytest.fixture
def small_tpu_tiles(monkeypatch):
    monkeypatch.setattr(kernel_tpu, "GMM_TILING", SMALL)
    monkeypatch.setattr(kernel_tpu, "TGMM_TILING", SMALL)


@pytest.mark.usefixtures("small_tpu_tiles")
class TestTpuInterpret(GpuKernelCase):
    impl = dict(implementation="pallas", interpret=True, kernel_backend="tpu")


_M, _K, _N, _E = 96, 128, 128, 5


@functools.lru_cache(maxsize=None)
def _jitted(backend):
    """Forward + both gradients through the public op, traced once per backend."""
    impl = dict(implementation="pallas", interpret=True, kernel_backend=backend)

    def run(lhs, rhs, gs, cot):
        out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, gs, **impl), lhs, rhs)
        return (out,) + vjp(cot)

    return jax.jit(run)


@pytest.mark.usefixtures("small_tpu_tiles")
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(gs=group_sizes_strategy(_E, _M))
def test_tpu_kernel_hypothesis_group_sizes(gs):
    lhs, rhs = random_gmm_inputs(2, _M, _K, _N, _E, jnp.bfloat16)
    cot = jax.random.normal(jax.random.PRNGKey(3), (_M, _N), jnp.bfloat16)
    out, dl, dr = _jitted("tpu")(lhs, rhs, gs, cot)
    f32 = lambda x: x.astype(jnp.float32)
    ref = jax.vjp(lambda a, b: grouped_matmul_dense(a, b, gs), f32(lhs), f32(rhs))
    want_dl, want_dr = ref[1](f32(cot))
    total = int(gs.sum())
    assert np.all(np.asarray(f32(out))[total:] == 0)
    assert not np.any(np.asarray(f32(dr))[np.asarray(gs) == 0])
    if total:
        assert rel_rmse(f32(out), ref[0]) < BF16_FWD_RTOL
        assert rel_rmse(f32(dl), want_dl) < BF16_GRAD_RTOL
        assert rel_rmse(f32(dr), want_dr) < BF16_GRAD_RTOL
