"""``kernel_gpu_tgmm.tgmm`` tilings and the chunked variant (``group_chunk > 0``), run by the Mosaic GPU
interpreter on CPU against the transposed product of ``jax.lax.ragged_dot`` (its gradient with
respect to ``rhs``), and lowered for CUDA on the CPU host at the benchmark's E=128 shape.

Each jitted tgmm is traced once per tiling; group sizes are traced values.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from pallas_kernels.moe import grouped_matmul, kernel_gpu, kernel_gpu_base, kernel_gpu_tgmm
from tests.pallas_kernels.moe.conftest import group_sizes_strategy
from tests.tolerances import BF16_GRAD_RTOL, rel_rmse

M, K, N = 150, 128, 128
# empty groups, all rows in one group, a tail of rows in no group, many small groups
CASES = [
    [40, 0, 70, 0, 0, 0, 0, 0],
    [0, 0, 150, 0, 0, 0, 0, 0],
    [13, 77, 0, 31, 0, 2, 0, 1],
    [3, 1, 0, 5, 2, 9, 1, 4],
    [0] * 8,
]
E = len(CASES[0])
# small tiles keep the interpreter's work low; chunks that divide E, do not, and cover all of it
TILINGS = {
    "per_group_m128": kernel_gpu.GpuTiling(tile_m=128, tile_n=64, tile_k=64, stages=2),
    "per_group_m32": kernel_gpu.GpuTiling(tile_m=32, tile_n=64, tile_k=64, stages=2),
    "per_group_blocks": kernel_gpu.GpuTiling(tile_m=32, tile_n=64, tile_k=64, stages=2, aligned=False),
    "group_run3": kernel_gpu.GpuTiling(tile_m=32, tile_n=64, tile_k=64, stages=2, group_run=3),  # 8 % 3: a part run
    "chunk1": kernel_gpu.GpuTiling(tile_m=64, tile_n=64, tile_k=64, stages=2, group_chunk=1),
    "chunk3": kernel_gpu.GpuTiling(tile_m=64, tile_n=64, tile_k=64, stages=3, group_chunk=3),
    "chunk8_m32": kernel_gpu.GpuTiling(tile_m=32, tile_n=64, tile_k=128, stages=2, group_chunk=8),
    "overlap_m32": kernel_gpu.GpuTiling(tile_m=32, tile_n=64, tile_k=64, stages=2, overlap_wgmma=True),
    "overlap_chunk3": kernel_gpu.GpuTiling(tile_m=32, tile_n=64, tile_k=64, stages=3, group_chunk=3, overlap_wgmma=True),
    "overlap_chunk1": kernel_gpu.GpuTiling(tile_m=64, tile_n=64, tile_k=64, stages=2, group_chunk=1, overlap_wgmma=True),
    "cluster_k": kernel_gpu.GpuTiling(tile_m=64, tile_n=64, tile_k=64, stages=2, cluster_k=True),
    "cluster_k_overlap": kernel_gpu.GpuTiling(tile_m=32, tile_n=64, tile_k=64, stages=3, overlap_wgmma=True, cluster_k=True),
    # one slot ring across a CTA's tiles: 2 slots, 3 slots with a partial run of groups, 128-row blocks
    "ring_m32": kernel_gpu.GpuTiling(tile_m=32, tile_n=64, tile_k=64, stages=2, ring=True),
    "ring_run3": kernel_gpu.GpuTiling(tile_m=32, tile_n=64, tile_k=64, stages=3, ring=True, group_run=3),
    "ring_m128": kernel_gpu.GpuTiling(tile_m=128, tile_n=64, tile_k=64, stages=2, ring=True),
    "ring_store64": kernel_gpu.GpuTiling(tile_m=32, tile_n=64, tile_k=128, stages=4, ring=True, store_rows=64),
}


def _inputs():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    lhs = jax.random.normal(k1, (M, K), jnp.float32).astype(jnp.bfloat16)
    dout = jax.random.normal(k2, (M, N), jnp.float32).astype(jnp.bfloat16)
    return lhs, dout


@jax.jit
def _reference(lhs, dout, gs):
    """``out[e] = lhs_eᵀ dout_e`` as the rhs-gradient of ``ragged_dot`` in float32."""
    lhs, dout = lhs.astype(jnp.float32), dout.astype(jnp.float32)
    rhs = jnp.zeros((gs.shape[0], lhs.shape[1], dout.shape[1]), jnp.float32)
    _, vjp = jax.vjp(lambda r: jax.lax.ragged_dot(lhs, r, gs), rhs)
    return vjp(dout)[0]


@functools.cache
def _tgmm(name):
    return jax.jit(functools.partial(kernel_gpu_tgmm.tgmm, num_groups=E, tiling=TILINGS[name], interpret=True))


def _check(name, sizes):
    lhs, dout = _inputs()
    gs = jnp.asarray(sizes, jnp.int32)
    got = np.asarray(_tgmm(name)(lhs, dout, gs), np.float32)
    want = np.asarray(_reference(lhs, dout, gs))
    if np.any(want):
        assert rel_rmse(got, want) < BF16_GRAD_RTOL, (name, sizes)
    empty = np.asarray(sizes) == 0
    assert not np.any(got[empty]), (name, sizes)  # zeros stored, not left uninitialised


@pytest.mark.parametrize("name", list(TILINGS))
def test_tgmm_tilings_match_ragged_dot(name):
    for sizes in CASES:
        _check(name, sizes)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=group_sizes_strategy(E, M))
def test_chunked_tgmm_hypothesis_group_sizes(sizes):
    _check("chunk3", sizes.tolist())


@pytest.mark.parametrize("name", ["overlap_m32", "overlap_chunk1", "ring_m32", "ring_run3"])
def test_overlapped_wgmma_has_no_smem_race(name, monkeypatch):
    """The interpreter's race detector flags the next pipeline's TMA overwriting the last slot
    when the memory warpgroup does not wait for the compute warpgroups' last wgmma. Its wgmma
    is synchronous, so only one-step pipelines (a group of one row block) show that race."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races

    monkeypatch.setattr(kernel_gpu_base, "_DETECT_RACES", True)
    lhs, dout = _inputs()
    tgmm = jax.jit(functools.partial(kernel_gpu_tgmm.tgmm, num_groups=E, tiling=TILINGS[name], interpret=True))
    for sizes in CASES:
        jax.block_until_ready(tgmm(lhs, dout, jnp.asarray(sizes, jnp.int32)))
        assert not get_races().races_found, (name, sizes)


def test_tgmm_tiling_threads_through_grouped_matmul():
    """``grouped_matmul(tgmm_tiling=...)``: the weight gradient comes from the chunked kernel."""
    lhs, dout = _inputs()
    rhs = jax.random.normal(jax.random.PRNGKey(2), (E, K, N), jnp.float32).astype(jnp.bfloat16)
    gs = jnp.asarray(CASES[2], jnp.int32)
    small = kernel_gpu.GpuTiling(tile_m=64, tile_n=64, tile_k=64, stages=2)

    def drhs(**kw):
        f = lambda r: grouped_matmul(lhs, r, gs, **kw)
        return jax.jit(lambda r: jax.vjp(f, r)[1](dout)[0])(rhs).astype(jnp.float32)

    # the forward kernel's default tiles are too large for this K, N: use small ones
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernel_gpu, "GMM_TILING", small)
        mp.setattr(kernel_gpu_tgmm, "TGMM_TILING", small)
        ours = drhs(implementation="pallas", interpret=True, kernel_backend="gpu", tgmm_tiling=TILINGS["chunk3"])
    assert rel_rmse(ours, _reference(lhs, dout, gs)) < BF16_GRAD_RTOL


def test_bad_tgmm_tiling_is_refused():
    lhs, dout = _inputs()
    gs = jnp.zeros((E,), jnp.int32)
    bad = kernel_gpu.GpuTiling(tile_m=64, tile_n=64, tile_k=64, stages=2, group_chunk=-1)
    with pytest.raises(ValueError, match="group_chunk"):
        kernel_gpu_tgmm.tgmm(lhs, dout, gs, num_groups=E, tiling=bad, interpret=True)
    bad = kernel_gpu.GpuTiling(tile_m=64, tile_n=64, tile_k=64, stages=1, overlap_wgmma=True)
    with pytest.raises(ValueError, match="stages"):
        kernel_gpu_tgmm.tgmm(lhs, dout, gs, num_groups=E, tiling=bad, interpret=True)
    bad = kernel_gpu.GpuTiling(tile_m=64, tile_n=64, tile_k=64, stages=2, group_chunk=2, group_run=2)
    with pytest.raises(ValueError, match="group_run"):
        kernel_gpu_tgmm.tgmm(lhs, dout, gs, num_groups=E, tiling=bad, interpret=True)
    for bad in (kernel_gpu.GpuTiling(tile_m=64, tile_n=64, tile_k=64, stages=1, ring=True),
                kernel_gpu.GpuTiling(tile_m=64, tile_n=64, tile_k=64, stages=2, ring=True, group_chunk=2),
                kernel_gpu.GpuTiling(tile_m=64, tile_n=64, tile_k=128, stages=2, store_rows=64)):
        with pytest.raises(ValueError, match="ring needs|store_rows needs"):
            kernel_gpu_tgmm.tgmm(lhs, dout, gs, num_groups=E, tiling=bad, interpret=True)
    bad = kernel_gpu.GpuTiling(tile_m=64, tile_n=64, tile_k=64, stages=2, group_chunk=2, reset_acc=True)
    with pytest.raises(ValueError, match="reset_acc"):
        kernel_gpu_tgmm.tgmm(lhs, dout, gs, num_groups=E, tiling=bad, interpret=True)


@pytest.mark.parametrize("cfg", kernel_gpu_tgmm.TGMM_CANDIDATES, ids=str)
def test_tgmm_candidates_lower_for_cuda(cfg, monkeypatch):
    """Every benchmarked tiling lowers for CUDA at (M,E,K,N) = (32768,128,2048,1024): layouts
    resolve and shared memory fits one CTA per SM."""
    monkeypatch.setattr(kernel_gpu_base, "_num_sms", lambda interpret: 132)
    S = jax.ShapeDtypeStruct
    args = (S((32768, 2048), jnp.bfloat16), S((32768, 1024), jnp.bfloat16), S((128,), jnp.int32))
    text = kernel_gpu_tgmm.tgmm.trace(*args, num_groups=128, tiling=cfg).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1
    kind = "chunked" if cfg.group_chunk else "ring" if cfg.ring else None
    assert f"moe_tgmm{'_' + kind if kind else ''}_mosaic_gpu" in text


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("cfg", [
    kernel_gpu.GpuTiling(tile_m=128, tile_n=128, tile_k=64, stages=3, half_tiles=True, cluster_n=True),
    kernel_gpu.GpuTiling(tile_m=128, tile_n=128, tile_k=64, stages=2, half_tiles=True, chain_tiles=True),
    kernel_gpu.GpuTiling(tile_m=128, tile_n=128, tile_k=64, stages=3, half_tiles=True, ring=True),
], ids=["cluster_n", "chain_tiles", "ring"])
def test_gmm_tilings_lower_for_cuda(cfg, transpose_rhs, monkeypatch):
    """The multicast, chained and ring forward / input-gradient tilings lower for CUDA at the E=128 shape."""
    monkeypatch.setattr(kernel_gpu_base, "_num_sms", lambda interpret: 132)
    S = jax.ShapeDtypeStruct
    args = (S((32768, 1024 if transpose_rhs else 2048), jnp.bfloat16), S((128, 2048, 1024), jnp.bfloat16),
            S((128,), jnp.int32))
    gmm = kernel_gpu.gmm.trace(*args, transpose_rhs=transpose_rhs, tiling=cfg)
    text = gmm.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", kernel_gpu_tgmm.TGMM_CANDIDATES, ids=str)
def test_tgmm_candidates_compiled(cfg):
    """Compiled on a Hopper GPU (incl. ``reset_acc``, which the interpreter cannot run)."""
    m, e, k, n = 2000, 8, 256, 256
    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    lhs = jax.random.normal(k1, (m, k), jnp.float32).astype(jnp.bfloat16)
    dout = jax.random.normal(k2, (m, n), jnp.float32).astype(jnp.bfloat16)
    for sizes in ([300, 0, 700, 0, 1, 250, 0, 500], [0, 0, 0, 0, 0, 0, m, 0], [5, 3, 0, 9, 1, 0, 2, 7]):
        gs = jnp.asarray(sizes, jnp.int32)
        got = np.asarray(kernel_gpu_tgmm.tgmm(lhs, dout, gs, num_groups=e, tiling=cfg), np.float32)
        assert rel_rmse(got, np.asarray(_reference(lhs, dout, gs))) < BF16_GRAD_RTOL, sizes
        assert not np.any(got[np.asarray(sizes) == 0]), sizes
