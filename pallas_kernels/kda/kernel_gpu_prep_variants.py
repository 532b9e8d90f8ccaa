"""Building blocks of the ``kda_prep_fwd`` variants selected by :class:`kernel_gpu_prep.FwdConfig`.

The prep forward is bound by instruction issue (benchmarks/RESULTS.md, stop 13: ~11k SASS
instructions per thread per chunk, ~6 cycles between issues), so each variant removes
per-element work without changing what is computed:

* :func:`scan_cumsum`: the chunk-local cumsum ``G`` as a plain fp32 running sum down each channel
  (one thread per channel, 64 loads, adds and stores), in place, with the anchors (G at each
  16-token tile's first row and at the last row) written on the way. The tensor-core form it
  replaces splits g into three bf16 parts (~3 conversions and subtractions per element), builds
  ``tril(1)``, runs three wgmmas and reads the anchors back from smem.
* :func:`row_anchors`: every row's own tile anchor ``b_{i // 16}`` as a ``[C, K]`` array, so the
  score tiles' right operand ``k_j e^{b_s - G_j}`` needs one exp per element for all tiles.
* :func:`lhs`: a left wgmma operand from registers (no smem store, no fence before the wgmma);
  staged through smem under the CPU interpreter, whose wgmma reads both operands from smem.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import int_ops

F32 = jnp.float32
WGMMA = plgpu.Layout.WGMMA
SCAN_WIDTH = 128  # channels of one scan: one per thread of the warpgroup


@dataclasses.dataclass(frozen=True)
class FwdConfig:
    """Static variants of ``kda_prep_fwd`` (all off: the kernel timed in benchmarks/RESULTS.md).

    ``cumsum="scan"``: G by a sequential fp32 sum down each channel, one thread per channel, in
    place in smem, the anchors captured on the way (:func:`scan_cumsum`;
    K = 128 only, K = 64 keeps the tensor-core cumsum), instead of ``tril(1) @ g`` on three bf16
    parts of g. ``ky_once``: the score tiles' right operand ``k_j e^{b_s - G_j}`` is formed once
    for all rows (each row with its own tile's anchor) and masked per tile, instead of one exp per
    element per tile (bit for bit the same operand). ``reg_lhs``: left wgmma operands (the score
    tiles' ``(q|k) e^{G-b}``, the inverse's S and Q, T for W and U) from registers, not stored to smem
    first (the same products; the interpreter still stages them through smem). ``save_g``: under
    ``jax.grad`` with the split backward (``prepare_split``) the kernel also writes G and its
    anchors, the backward kernels' inputs, instead of XLA taking the cumsum again in the backward
    (three fusions, ~2.3 GB of traffic at B,T,H,K = 4,8192,32,128, for ~0.6 GB of kernel stores).
    Compare them on the H200 with ``bench_kda.py --peers ours,ours-prep-<name>,...``.
    """

    cumsum: str = "mma"
    ky_once: bool = False
    reg_lhs: bool = False
    save_g: bool = False

    def __post_init__(self):
        if self.cumsum not in ("mma", "scan"):
            raise ValueError(f"cumsum must be 'mma' or 'scan', got {self.cumsum!r}")
        if self.cumsum == "scan":  # passes the interpreter, wrong on the GPU: kept only to be debugged
            raise ValueError("cumsum='scan' returned NaN compiled for the H200 (stop 35: "
                             "test_prep_variants_match_xla[...-scan-compiled]); use cumsum='mma'")


FWD_VARIANTS = {
    "default": FwdConfig(),
    "ky": FwdConfig(ky_once=True),
    "regs": FwdConfig(reg_lhs=True),
    "saveg": FwdConfig(save_g=True),
}


def lhs(x, stage, *, regs: bool, interpret: bool):
    """``x`` as a left wgmma operand: the register array itself, or ``stage`` after storing it
    there (``regs=False``, or under the interpreter); the caller fences smem before the wgmma."""
    if regs and not interpret:
        return x
    stage[...] = x
    return stage


def scan_cumsum(g_s, anc_s, *, sub: int):
    """``g_s <- cumsum(g_s, axis=0)`` in fp32 (rows in order, one thread per channel), in place.

    ``anc_s`` rows ``0 .. C/sub - 1`` get G at each ``sub``-row tile's first row, row ``C/sub`` G
    at the last row and row ``C/sub + 1`` its exp. ``g_s`` is ``[C, 128]`` f32 without transforms.
    The caller fences (``commit_smem``) before other threads read ``g_s`` or ``anc_s``, and loads
    G whole through another ref to the same memory: one ref accessed both by rows and whole
    sends Mosaic's layout inference into an endless search (so does a second ref used both ways).
    """
    C, K = g_s.shape
    if K != SCAN_WIDTH:
        raise ValueError(f"scan_cumsum needs K = {SCAN_WIDTH} channels (one per thread), got {K}")
    line = plgpu.Layout.WG_STRIDED((K,), vec_size=1)
    nt = C // sub

    def tile(t, acc):  # the tile's rows unrolled: the loop keeps the code small (instruction fetch)
        for r in range(sub):
            row = g_s.at[t * sub + r]
            acc = acc + plgpu.load(row, layout=line, optimized=False)
            row[...] = acc
            if r == 0:
                anc_s.at[t][...] = acc
        return acc

    last = lax.fori_loop(0, nt, tile, plgpu.layout_cast(jnp.zeros((K,), F32), line))
    anc_s.at[nt][...] = last
    anc_s.at[nt + 1][...] = jnp.exp(last)


def row_anchors(col_vec, anc_s, rows, *, sub: int):
    """``[C, K]``: row i holds ``anc_s[i // sub]`` (its own tile's anchor); ``rows`` is the row
    iota in the WGMMA layout, ``col_vec(ref)`` broadcasts a ``[K]`` smem row down the rows."""
    C = rows.shape[0]
    tile = int_ops.div(rows, sub)
    out = col_vec(anc_s.at[0])
    for t in range(1, C // sub):
        out = jnp.where(tile == t, col_vec(anc_s.at[t]), out)
    return out
