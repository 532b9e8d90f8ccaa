"""Pallas TPU grouped-matmul kernels in TPU interpret mode on CPU, with the GPU suite's cases."""

import pytest

from pallas_kernels.moe import kernel_tpu
from tests.pallas_kernels.moe.test_kernel_gpu_interpret import GpuKernelCase

SMALL = kernel_tpu.TpuTiling(tile_m=32, tile_k=128, tile_n=128)


@pytest.fixture
def small_tpu_tiles(monkeypatch):
    monkeypatch.setattr(kernel_tpu, "GMM_TILING", SMALL)
    monkeypatch.setattr(kernel_tpu, "TGMM_TILING", SMALL)


@pytest.mark.usefixtures("small_tpu_tiles")
class TestTpuInterpret(GpuKernelCase):
    impl = dict(implementation="pallas", interpret=True, kernel_backend="tpu")
