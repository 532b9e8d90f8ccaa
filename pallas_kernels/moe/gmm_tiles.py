"""Work-tile pieces of the ``gmm`` kernels (``kernel_gpu``, ``kernel_gpu_gmm_ring``): the wgmma on a
tile's rows (half height where they fit) and the epilogues that store only its group's rows."""

import math

from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.moe.activations import value_and_partials
from pallas_kernels.moe.kernel_gpu_base import _zeros_wgmma


def store_rows(o_smem, o_gmem, row0, lo, count, n_slice, max_rows: int):
    """TMA-store rows ``[lo, lo + count)`` of ``o_smem`` to ``o_gmem[row0 + lo + …]``."""
    offset = lo
    size = 1 << (max_rows.bit_length() - 1)
    while size >= 1:
        part = count & size

        @pl.when(part != 0)
        def _():
            plgpu.copy_smem_to_gmem(
                o_smem.at[pl.ds(offset, size)], o_gmem.at[pl.ds(row0 + offset, size), n_slice]
            )

        offset = offset + part
        size //= 2


def gmm_epilogue(acc, o_smem, out_gmem, is_tail, row0, lo, count, n_slice, max_rows):
    """Stage one warpgroup's tile in SMEM (zeros for the tail group) and store its rows."""
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when(is_tail)
    def _():
        o_smem[...] = _zeros_wgmma(o_smem.shape, out_gmem.dtype)

    @pl.when(~is_tail)
    def _():
        o_smem[...] = acc[...].astype(out_gmem.dtype)

    plgpu.commit_smem()
    store_rows(o_smem, out_gmem, row0, lo, count, n_slice, max_rows)


def glu_epilogue(acc, o_smem, a_gmem, d_gmem, is_tail, row0, lo, count, col0, max_rows, glu, chunk: int = 32):
    """``gmm_glu``'s epilogue: the accumulator holds ``[g | u]`` (``h`` columns each; the tile at column
    ``col0`` of the interleaved product). Computes the activation ``a`` and its partial derivatives
    ``∂a/∂g``, ``∂a/∂u`` in float32 from the unrounded products, ``chunk`` columns at a time (so that
    few values are live beside the accumulator), stages them in ``o_smem [3, tm, h]`` and stores their
    rows: ``a`` to columns ``col0 / 2`` of ``a_gmem``, the derivatives to ``d_gmem`` in the product's
    interleaved layout (columns ``col0`` and ``col0 + h``). ``glu``: ``(activation, situ_beta,
    situ_linear_beta)``. The tail group stores zeros."""
    h, dtype = o_smem.shape[-1], a_gmem.dtype
    chunk = math.gcd(chunk, h)  # h is a multiple of 8 (gmm_glu checks)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when(is_tail)
    def _():
        for i in range(3):
            o_smem[i] = _zeros_wgmma(o_smem.shape[1:], dtype)

    @pl.when(~is_tail)
    def _():
        for j in range(0, h, chunk):
            cols = pl.ds(j, chunk)
            values = value_and_partials(acc[:, pl.ds(j, chunk)], acc[:, pl.ds(h + j, chunk)], *glu)
            for i, x in enumerate(values):
                o_smem[i, :, cols] = x.astype(dtype)

    plgpu.commit_smem()
    for i, (gmem, col) in enumerate(((a_gmem, col0 // 2), (d_gmem, col0), (d_gmem, col0 + h))):
        store_rows(o_smem.at[i], gmem, row0, lo, count, pl.ds(col, h), max_rows)


def half_or_full_wgmma(acc, a_smem, b, half):
    """``acc += a @ b``, on the first half of the rows only where ``half``: the other rows of
    the tile belong to other groups and are never stored (their accumulator rows stay 0)."""
    rows = pl.ds(0, acc.shape[0] // 2)

    @pl.when(half)
    def _():
        plgpu.wgmma(acc.at[rows], a_smem.at[rows], b)

    @pl.when(~half)
    def _():
        plgpu.wgmma(acc, a_smem, b)
