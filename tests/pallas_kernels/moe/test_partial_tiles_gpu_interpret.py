"""Partial-tile options of the Hopper grouped matmuls: ``half_tiles`` (``gmm``: wgmma on the first
half of a work tile's rows when all its rows lie there) and ``trim_rows`` (``tgmm``: a partial row
block contracts over the wgmma K groups holding its rows only: 64 rows at the 128-byte swizzle,
16 with ``swizzle_bytes=32``).

Run by the Mosaic GPU interpreter on CPU against ``jax.lax.ragged_dot`` (forward and both
gradients), checked bit-identical to the same tiling without the option (the skipped rows are
never stored / are zero), lowered for CUDA at the benchmark's E=128 shape, and compiled with -m gpu.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from pallas_kernels.moe import kernel_gpu, kernel_gpu_base, kernel_gpu_tgmm, schedule
from tests.pallas_kernels.moe.conftest import group_sizes_strategy, random_gmm_inputs
from tests.tolerances import BF16_FWD_RTOL, BF16_GRAD_RTOL, rel_rmse

M, K, N, E = 150, 128, 128, 8
# empty groups, all rows in one group, a tail of rows in no group, many small groups,
# groups of a tile and a bit (the half-tile case)
CASES = [
    [40, 0, 70, 0, 0, 0, 0, 0],
    [0, 0, 150, 0, 0, 0, 0, 0],
    [13, 77, 0, 31, 0, 2, 0, 1],
    [3, 1, 0, 5, 2, 9, 1, 4],
    [0, 130, 0, 0, 0, 0, 20, 0],
    [0] * 8,
]
# tile_m = 128: the smallest tile with two 64-row wgmma groups; small N, K tiles for the interpreter
BASE = kernel_gpu.GpuTiling(tile_m=128, tile_n=64, tile_k=128, stages=2)
HALF = dataclasses.replace(BASE, half_tiles=True)
TRIM = dataclasses.replace(BASE, trim_rows=True)
TRIM_CHUNK = dataclasses.replace(BASE, stages=3, group_chunk=3, overlap_wgmma=True, trim_rows=True)
# 32-byte swizzle: 16-row K groups, so a 64-row block trims too
TRIM16 = kernel_gpu.GpuTiling(tile_m=64, tile_n=64, tile_k=128, stages=2, swizzle_bytes=32, trim_rows=True)
TRIM16_CHUNK = dataclasses.replace(TRIM16, tile_m=32, stages=3, group_chunk=3, overlap_wgmma=True)


def _grads(gmm_tiling, tgmm_tiling, interpret=True):
    """Jitted ``(out, dlhs, drhs)`` from the kernels as ``ops.grouped_matmul``'s VJP calls them; the
    tilings are passed explicitly (a patched module default would hit the kernels' jit cache)."""

    def run(lhs, rhs, gs, cot):
        gmm = functools.partial(kernel_gpu.gmm, tiling=gmm_tiling, interpret=interpret)
        drhs = kernel_gpu_tgmm.tgmm(lhs, cot, gs, num_groups=gs.shape[0], tiling=tgmm_tiling, interpret=interpret)
        return gmm(lhs, rhs, gs), gmm(cot, rhs, gs, transpose_rhs=True), drhs

    return jax.jit(run)


@functools.cache
def _ours(option):
    return _grads(HALF, TRIM) if option else _grads(BASE, BASE)


@jax.jit
def _reference(lhs, rhs, gs, cot):
    f32 = lambda x: x.astype(jnp.float32)
    out, vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, gs), f32(lhs), f32(rhs))
    return (out,) + vjp(f32(cot))


def _check(sizes, *, against_base=True):
    lhs, rhs = random_gmm_inputs(0, M, K, N, E, jnp.bfloat16)
    cot = jax.random.normal(jax.random.PRNGKey(1), (M, N), jnp.float32).astype(jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    got = [np.asarray(x, np.float32) for x in _ours(True)(lhs, rhs, gs, cot)]
    want = [np.asarray(x) for x in _reference(lhs, rhs, gs, cot)]
    for name, g, w, tol in zip(("out", "dlhs", "drhs"), got, want, (BF16_FWD_RTOL, BF16_GRAD_RTOL, BF16_GRAD_RTOL)):
        if np.any(w):
            assert rel_rmse(g, w) < tol, (name, sizes)
        else:
            assert not np.any(g), (name, sizes)
    total = int(np.sum(sizes))
    assert not np.any(got[0][total:]) and not np.any(got[1][total:]), sizes  # tail rows stay zero
    assert not np.any(got[2][np.asarray(sizes) == 0]), sizes  # empty groups' weight gradient
    if against_base:
        base = [np.asarray(x, np.float32) for x in _ours(False)(lhs, rhs, gs, cot)]
        for name, g, b in zip(("out", "dlhs", "drhs"), got, base):
            np.testing.assert_array_equal(g, b, err_msg=f"{name} {sizes}")


def test_half_tiles_and_trimmed_rows_match_ragged_dot():
    for i in (1, 2, 3, 4):  # CASES[0], [5]: the hypothesis cases and test_kernel_gpu_interpret
        _check(CASES[i], against_base=i in (2, 4))  # many half tiles and trimmed first and last blocks


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=group_sizes_strategy(E, M))
def test_half_tiles_and_trimmed_rows_hypothesis_group_sizes(sizes):
    _check(sizes.tolist(), against_base=False)


@pytest.mark.parametrize("name", ["TRIM_CHUNK", "TRIM16", "TRIM16_CHUNK"])
def test_trimmed_tgmm_matches_ragged_dot_and_untrimmed(name):
    """Chunked and per-group tgmm, 64- and 16-row K groups (the interpreter ignores swizzles:
    the 16-row slicing is checked here, the 32-byte swizzle compiled with -m gpu)."""
    cfg = globals()[name]
    lhs, dout = random_gmm_inputs(2, M, K, N, E, jnp.bfloat16)[0], jax.random.normal(jax.random.PRNGKey(3), (M, N))
    dout = dout.astype(jnp.bfloat16)
    tg = lambda cfg: jax.jit(functools.partial(kernel_gpu_tgmm.tgmm, num_groups=E, tiling=cfg, interpret=True))
    trimmed, full = tg(cfg), tg(dataclasses.replace(cfg, trim_rows=False))
    for sizes in (CASES[4] if name == "TRIM_CHUNK" else CASES[2],):
        gs = jnp.asarray(sizes, jnp.int32)
        got = np.asarray(trimmed(lhs, dout, gs), np.float32)
        assert rel_rmse(got, np.asarray(_reference(lhs, jnp.zeros((E, K, N), lhs.dtype), gs, dout)[2])) < BF16_GRAD_RTOL
        np.testing.assert_array_equal(got, np.asarray(full(lhs, dout, gs), np.float32), err_msg=str(sizes))


def test_issued_rows_count_the_half_tiles():
    """``schedule.issued_rows`` against a row-by-row count: a qualifying tile's rows lie in its first half."""
    gs = jnp.asarray([40, 0, 70, 130, 5, 64, 0, 1], jnp.int32)
    m, tm = 400, 128
    meta = np.asarray(schedule.aligned_tile_schedule(gs, m, tm))
    rows = np.asarray(schedule.issued_rows(jnp.asarray(meta), tm, True))
    for (grp, _, lo, count, _), r in zip(meta.T, rows):
        want = 0 if grp < 0 else (tm // 2 if lo + count <= tm // 2 else tm)
        assert r == want
    assert int(np.sum(rows)) < int(np.sum(np.asarray(schedule.issued_rows(jnp.asarray(meta), tm, False))))


def test_partial_tile_options_need_two_wgmma_groups():
    lhs, rhs = random_gmm_inputs(0, 64, 64, 128, 2, jnp.bfloat16)
    gs = jnp.asarray([30, 34], jnp.int32)
    small = kernel_gpu.GpuTiling(tile_m=64, tile_n=64, tile_k=64, stages=2)
    with pytest.raises(ValueError, match="tile_m"):
        kernel_gpu.gmm(lhs, rhs, gs, tiling=dataclasses.replace(small, half_tiles=True), interpret=True)
    with pytest.raises(ValueError, match="tile_m"):
        kernel_gpu_tgmm.tgmm(lhs, rhs[0], gs, num_groups=2, tiling=dataclasses.replace(small, trim_rows=True),
                             interpret=True)
    with pytest.raises(ValueError, match="swizzle_bytes"):
        kernel_gpu_tgmm.tgmm(lhs, rhs[0], gs, num_groups=2, tiling=dataclasses.replace(small, swizzle_bytes=16),
                             interpret=True)


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("cfg", [
    kernel_gpu.GpuTiling(tile_m=128, tile_n=128, tile_k=64, stages=3, half_tiles=True),
    kernel_gpu.GpuTiling(tile_m=128, tile_n=64, tile_k=64, stages=4, half_tiles=True),
], ids=str)
def test_half_tiles_lower_for_cuda(cfg, transpose_rhs, monkeypatch):
    """gmm (forward) and its transposed form (dlhs) with half tiles lower for CUDA at
    (M,E,K,N) = (32768,128,2048,1024): sliced accumulator and SMEM operand pass Mosaic GPU."""
    monkeypatch.setattr(kernel_gpu_base, "_num_sms", lambda interpret: 132)
    S = jax.ShapeDtypeStruct
    rhs = S((128, 1024, 2048) if transpose_rhs else (128, 2048, 1024), jnp.bfloat16)
    args = (S((32768, 2048), jnp.bfloat16), rhs, S((128,), jnp.int32))
    lowered = kernel_gpu.gmm.trace(*args, transpose_rhs=transpose_rhs, tiling=cfg).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("custom_call @mosaic_gpu") == 1


@pytest.mark.gpu
@pytest.mark.parametrize("gmm_cfg,tgmm_cfg", [
    (kernel_gpu.GpuTiling(tile_m=128, tile_n=128, tile_k=64, stages=3, half_tiles=True),
     dataclasses.replace(kernel_gpu_tgmm.TGMM_TILING, swizzle_bytes=32, trim_rows=True)),
    (kernel_gpu.GpuTiling(tile_m=128, tile_n=128, tile_k=64, stages=3, half_tiles=True),
     kernel_gpu.GpuTiling(tile_m=128, tile_n=128, tile_k=64, stages=2, overlap_wgmma=True, trim_rows=True)),
    (kernel_gpu.GpuTiling(tile_m=128, tile_n=64, tile_k=64, stages=4, half_tiles=True),
     kernel_gpu.GpuTiling(tile_m=128, tile_n=64, tile_k=128, stages=3, group_chunk=8, overlap_wgmma=True,
                          reset_acc=True, trim_rows=True)),
], ids=str)
def test_partial_tile_options_compiled(gmm_cfg, tgmm_cfg):
    m, e, k, n = 2000, 8, 256, 256
    lhs, rhs = random_gmm_inputs(4, m, k, n, e, jnp.bfloat16)
    cot = jax.random.normal(jax.random.PRNGKey(5), (m, n), jnp.float32).astype(jnp.bfloat16)
    ours = _grads(gmm_cfg, tgmm_cfg, interpret=False)
    for sizes in ([300, 0, 700, 0, 1, 250, 0, 500], [0, 0, 0, 0, 0, 0, m, 0], [5, 3, 0, 9, 1, 0, 2, 7]):
        gs = jnp.asarray(sizes, jnp.int32)
        got = [np.asarray(x, np.float32) for x in ours(lhs, rhs, gs, cot)]
        want = [np.asarray(x) for x in _reference(lhs, rhs, gs, cot)]
        for g, w, tol in zip(got, want, (BF16_FWD_RTOL, BF16_GRAD_RTOL, BF16_GRAD_RTOL)):
            assert rel_rmse(g, w) < tol, sizes
        assert not np.any(got[0][int(np.sum(sizes)):]), sizes
