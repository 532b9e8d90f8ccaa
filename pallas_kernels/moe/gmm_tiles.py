"""Work-tile pieces of the ``gmm`` kernels (``kernel_gpu``, ``kernel_gpu_gmm_ring``): the wgmma on a
tile's rows (half height where they fit) and the epilogue that stores only its group's rows."""

from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

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
