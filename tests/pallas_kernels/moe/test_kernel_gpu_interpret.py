"""Mosaic GPU kernels run by the GPU interpreter on CPU (the same tests run compiled with -m gpu).

Interpretation is slow, so the shapes are tiny and each jitted function is traced once per
shape and reused across group-size cases (group sizes are traced values).
"""


import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import grouped_matmul, kernel_gpu, kernel_gpu_base, kernel_gpu_tgmm, schedule
from pallas_kernels.moe.reference import grouped_matmul_dense
from tests.pallas_kernels.moe.conftest import random_gmm_inputs
from tests.tolerances import BF16_FWD_RTOL, BF16_GRAD_RTOL, rel_rmse

E = 4
# empty groups, all rows in one group, a ragged tail of rows in no group, boundaries off-tile
GROUP_CASES = [[40, 0, 70, 0], [0, 150, 0, 0]]
SLOW_GROUP_CASES = [[13, 77, 0, 31], [0, 0, 0, 0], [50, 0, 50, 50]]
# small tiles keep the interpreter's work (tiles × pipeline steps) low
SMALL = kernel_gpu.GpuTiling(tile_m=64, tile_n=64, tile_k=64, stages=2)


def _use_tilings(monkeypatch, gmm, tgmm, dlhs=None):
    """The module defaults that ``grouped_matmul`` picks up: forward, input gradient, weight gradient."""
    monkeypatch.setattr(kernel_gpu, "GMM_TILING", gmm)
    if dlhs is not None:
        monkeypatch.setattr(kernel_gpu, "GMM_TILING_T", dlhs)
    monkeypatch.setattr(kernel_gpu_tgmm, "TGMM_TILING", tgmm)


@pytest.fixture
def small_gpu_tiles(monkeypatch):
    _use_tilings(monkeypatch, SMALL, SMALL)


def _loss_and_grads(impl_kwargs):
    def loss(lhs, rhs, gs, cot):
        out = grouped_matmul(lhs, rhs, gs, **impl_kwargs)
        return jnp.sum(out.astype(jnp.float32) * cot), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


class GpuKernelCase:
    impl = dict(implementation="pallas", interpret=True, kernel_backend="gpu")
    m, k, n = 150, 128, 128

    def test_forward_and_grads(self):
        self.check(GROUP_CASES)

    @pytest.mark.slow
    def test_forward_and_grads_more_groups(self):
        self.check(SLOW_GROUP_CASES)

    def check(self, cases):
        lhs, rhs = random_gmm_inputs(0, self.m, self.k, self.n, E, jnp.bfloat16)
        cot = jax.random.normal(jax.random.PRNGKey(1), (self.m, self.n))
        ours, ref = _loss_and_grads(self.impl), _loss_and_grads(dict(implementation="xla"))
        f32 = lambda x: x.astype(jnp.float32)
        for case in cases:
            gs = jnp.asarray(case, jnp.int32)
            (_, out), (dl, dr) = ours(lhs, rhs, gs, cot)
            (_, _), (el, er) = ref(f32(lhs), f32(rhs), gs, cot)
            want = grouped_matmul_dense(f32(lhs), f32(rhs), gs)
            total = int(gs.sum())
            assert np.all(np.asarray(out[total:], np.float32) == 0), case
            if total:
                assert rel_rmse(f32(out), want) < BF16_FWD_RTOL, case
                assert rel_rmse(f32(dl), el) < BF16_GRAD_RTOL, case
                assert rel_rmse(f32(dr), er) < BF16_GRAD_RTOL, case
            else:
                assert not np.any(np.asarray(dl, np.float32)) and not np.any(np.asarray(dr, np.float32))
            empty = np.asarray(case) == 0
            assert not np.any(np.asarray(dr, np.float32)[empty]), case


@pytest.mark.usefixtures("small_gpu_tiles")
class TestGpuInterpret(GpuKernelCase):
    pass


CLUSTERED = dict(gmm=dataclasses.replace(SMALL, cluster_n=True), tgmm=dataclasses.replace(SMALL, cluster_k=True))


@pytest.fixture
def clustered_gpu_tiles(monkeypatch):
    """2-CTA clusters: gmm and dlhs share the lhs block, tgmm the dout block, by multicast."""
    _use_tilings(monkeypatch, CLUSTERED["gmm"], CLUSTERED["tgmm"], dlhs=CLUSTERED["gmm"])


@pytest.mark.usefixtures("clustered_gpu_tiles")
class TestGpuInterpretClusters(GpuKernelCase):
    m, k, n = 150, 256, 256  # two N tiles for the forward, two output-row tiles for dlhs


@pytest.fixture
def chained_gpu_tiles(monkeypatch):
    """gmm and dlhs as one pipeline across each CTA's tiles; with 2 interpreted SMs one CTA gets a
    single tile in the all-in-one case (the unchained path) and the others chain 2-3 tiles."""
    chained = dataclasses.replace(SMALL, chain_tiles=True)
    _use_tilings(monkeypatch, chained, SMALL, dlhs=chained)


@pytest.mark.usefixtures("chained_gpu_tiles")
class TestGpuInterpretChained(GpuKernelCase):
    pass


RINGS = {
    # 2 K steps a tile on 3 slots: the ring wraps inside tiles; tgmm's ring with 2 slots
    "aligned": (dataclasses.replace(SMALL, stages=3, ring=True), dataclasses.replace(SMALL, ring=True)),
    # blocks at multiples of 128 rows (the last runs past M: TMA zero-fills it), half-height wgmmas
    "blocks_half": (kernel_gpu.GpuTiling(tile_m=128, tile_n=64, tile_k=64, stages=2, aligned=False, half_tiles=True,
                                         ring=True), dataclasses.replace(SMALL, aligned=False, stages=3, ring=True)),
}


@pytest.fixture(params=list(RINGS))
def ring_gpu_tiles(monkeypatch, request):
    """gmm, dlhs and tgmm as hand-written slot rings across each CTA's tiles."""
    gmm_cfg, tgmm_cfg = RINGS[request.param]
    _use_tilings(monkeypatch, gmm_cfg, tgmm_cfg, dlhs=gmm_cfg)


@pytest.mark.usefixtures("ring_gpu_tiles")
class TestGpuInterpretRing(GpuKernelCase):
    pass


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_ring_has_no_smem_race(transpose_rhs, monkeypatch):
    """The interpreter's race detector over the ring's slots: 2 K steps a tile on 3 slots, so loads
    for the next tile land while a tile's last slots are still read. A slot released before its
    wgmma finished stays invisible here (the interpreter's wgmma is synchronous): the compiled
    ``TestGpuCompiledRing`` checks that."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    monkeypatch.setattr(kernel_gpu_base, "_DETECT_RACES", True)
    lhs, rhs = random_gmm_inputs(0, 150, 128, 128, E, jnp.bfloat16)
    for case in GROUP_CASES:
        out = kernel_gpu.gmm(lhs, rhs, jnp.asarray(case, jnp.int32), transpose_rhs=transpose_rhs,
                             tiling=RINGS["aligned"][0], interpret=True)
        jax.block_until_ready(out)
        assert not get_races().races_found, case


def test_ring_refuses_chained_or_clustered_tiles():
    lhs, rhs = random_gmm_inputs(0, 64, 128, 256, E, jnp.bfloat16)
    gs = jnp.asarray([16, 16, 16, 16], jnp.int32)
    for bad in (dataclasses.replace(SMALL, ring=True, chain_tiles=True), dataclasses.replace(SMALL, ring=True, stages=1)):
        with pytest.raises(ValueError, match="ring needs"):
            kernel_gpu.gmm(lhs, rhs, gs, tiling=bad, interpret=True)


def test_default_forward_takes_the_ring_at_few_k_steps():
    """``GMM_TILING.ring_k_steps``: the forward runs the slot ring at K = 512 (8 steps of 64: small()'s
    routed experts) and the per-tile pipeline at K = 1024; the input gradient keeps its own tiling."""
    gs = jnp.asarray([16, 16, 16, 16], jnp.int32)
    names = {}
    for k in (512, 1024):
        lhs, rhs = random_gmm_inputs(0, 64, k, 256, E, jnp.bfloat16)
        for tr in (False, True):
            args = (jnp.zeros((64, 256), jnp.bfloat16), jnp.swapaxes(rhs, 1, 2)) if tr else (lhs, rhs)
            jaxpr = str(jax.make_jaxpr(lambda a, b: kernel_gpu.gmm(a, b, gs, transpose_rhs=tr, interpret=True))(*args))
            names[k, tr] = "_ring" in jaxpr
    assert names == {(512, False): True, (1024, False): False, (512, True): False, (1024, True): False}


def test_chained_tiles_need_whole_rounds_of_stages():
    lhs, rhs = random_gmm_inputs(0, 64, 192, 128, E, jnp.bfloat16)
    gs = jnp.asarray([16, 16, 16, 16], jnp.int32)
    with pytest.raises(ValueError, match="chain_tiles needs K/tile_k a multiple of stages"):
        kernel_gpu.gmm(lhs, rhs, gs, tiling=dataclasses.replace(SMALL, chain_tiles=True), interpret=True)


def test_clusters_need_an_even_tile_count():
    lhs, rhs = random_gmm_inputs(0, 64, 128, 128, E, jnp.bfloat16)
    gs = jnp.asarray([16, 16, 16, 16], jnp.int32)
    with pytest.raises(ValueError, match="cluster_n needs an even number of N tiles"):
        kernel_gpu.gmm(lhs, rhs, gs, tiling=CLUSTERED["gmm"], interpret=True)
    with pytest.raises(ValueError, match="cluster_k needs group_chunk=0"):
        kernel_gpu_tgmm.tgmm(lhs, lhs, gs, num_groups=E, interpret=True,
                             tiling=dataclasses.replace(CLUSTERED["tgmm"], tile_k=128))


@pytest.mark.parametrize("aligned", [False, True])
def test_tile_schedule_covers_every_row_once(aligned):
    gs = jnp.asarray([50, 0, 90, 61, 0], jnp.int32)
    m, tm = 232, 64
    if aligned:
        meta = np.asarray(schedule.aligned_tile_schedule(gs, m, tm))
    else:
        meta = np.asarray(schedule.tile_schedule(gs, m, tm, tail=True, empty_tiles=False))
    owner = np.full(m, -2)
    for grp, block, lo, count, _ in meta.T:
        if grp < 0:
            assert count == 0
            continue
        row0 = block if aligned else block * tm
        assert 0 <= row0 and row0 + (tm if aligned else 0) <= m and (not aligned or row0 % 8 == 0)
        rows = slice(row0 + lo, row0 + lo + count)
        assert np.all(owner[rows] == -2)
        owner[rows] = grp
    want = np.concatenate([np.full(s, i) for i, s in enumerate(np.asarray(gs))] + [np.full(m - 201, 5)])
    np.testing.assert_array_equal(owner, want)


def test_pallas_on_cpu_needs_interpret():
    lhs, rhs = random_gmm_inputs(0, 8, 8, 8, E, jnp.bfloat16)
    with pytest.raises(ValueError, match="interpret"):
        grouped_matmul(lhs, rhs, jnp.asarray([2, 2, 2, 2]), implementation="pallas")
    with pytest.raises(ValueError, match="bfloat16"):
        grouped_matmul(lhs.astype(jnp.float32), rhs.astype(jnp.float32), jnp.asarray([2, 2, 2, 2]),
                       implementation="pallas", interpret=True)


@pytest.mark.gpu
class CompiledCase(GpuKernelCase):
    """The kernels compiled for the GPU (``-m gpu``); 132 SMs, so most CTAs get one or two tiles."""
    impl = dict(implementation="pallas")
    m, k, n = 4000, 512, 768


class TestGpuCompiled(CompiledCase):
    m = 1000


@pytest.mark.usefixtures("clustered_gpu_tiles")
class TestGpuCompiledClusters(CompiledCase):
    m, n = 1000, 1024


@pytest.mark.usefixtures("chained_gpu_tiles")
class TestGpuCompiledChained(CompiledCase):
    """The unchained path runs too (a CTA with a single tile)."""


@pytest.mark.usefixtures("ring_gpu_tiles")
class TestGpuCompiledRing(CompiledCase):
    pass
