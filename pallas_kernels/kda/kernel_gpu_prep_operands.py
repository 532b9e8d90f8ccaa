"""How ``kda_prep_fwd`` forms its wgmma operands with the fewest instructions.

The prep forward is bound by instruction issue (benchmarks/RESULTS.md, stop 13: ~11k SASS
instructions per thread per chunk, ~6 cycles between issues). Two of the three cuts that took it
from 2.20 to ~1.7 ms of device time at B,T,H,K = 4,8192,32,128 (stop 36; the third is the backward
reading the forward's G) live here:

* :func:`lhs`: a left wgmma operand straight from registers (no smem store, no fence before the
  wgmma); staged through smem under the CPU interpreter, whose wgmma reads both operands from smem.
* :func:`row_anchors`: every row's own tile anchor ``b_{i // 16}`` as a ``[C, K]`` array, so the
  score tiles' right operand ``k_j e^{b_s - G_j}`` takes one exp per element for all tiles (then
  masked per tile), not one per element per tile.

A per-channel sequential fp32 scan for the chunk cumsum (instead of ``tril(1) @ g`` on three bf16
parts) passed the interpreter but returned NaN compiled for the H200 (stop 35) and was deleted.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import int_ops


def lhs(x, stage, *, regs: bool, interpret: bool):
    """``x`` as a left wgmma operand: the register array itself (``regs``), or ``stage`` after
    storing it there (also under the interpreter); the caller fences smem before the wgmma."""
    if regs and not interpret:
        return x
    stage[...] = x
    return stage


def row_anchors(col_vec, anc_s, rows, *, sub: int):
    """``[C, K]``: row i holds ``anc_s[i // sub]`` (its own tile's anchor); ``rows`` is the row
    iota in the WGMMA layout, ``col_vec(ref)`` broadcasts a ``[K]`` smem row down the rows."""
    C = rows.shape[0]
    tile = int_ops.div(rows, sub)
    out = col_vec(anc_s.at[0])
    for t in range(1, C // sub):
        out = jnp.where(tile == t, col_vec(anc_s.at[t]), out)
    return out
