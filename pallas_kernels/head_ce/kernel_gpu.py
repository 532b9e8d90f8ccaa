"""One chunk's output-head logits with their logsumexp partials, for Hopper in Pallas Mosaic GPU.

``logits_partials(f [C, D], w [D, V])`` → ``logits [C, V]`` (bf16 or fp32), ``pmax, psum [V/tile_n, C]``;
``logits_partials(f, w, shift [C], labels [C])`` → shifted exponentials ``[C, V]`` (bf16) instead.

The cross-entropy needs each row's logsumexp over V = 163840 logits; XLA computes it with two
reduction passes over the stored logits (max, then Σ exp), 2 × 2.7 GB of fp32 reads per 4096-token
chunk. Here the matmul's epilogue computes them from the accumulator while it is in registers:
1. A persistent kernel (``moe.kernel_gpu_base.persistent_kernel``: one CTA per SM, one memory and
   two compute warpgroups) walks the (row block of ``tile_m``, vocabulary block of ``2 · tile_n``)
   output tiles, the row blocks of one vocabulary block consecutively, so the ``[D, 2 · tile_n]``
   head panel is read from HBM once and the chunk's features (8 MB) stay in L2.
2. Each tile is the warp-specialised TMA → wgmma pipeline over D of the MoE ``gmm``
   (``moe.kernel_gpu._gmm_pipeline``); each compute warpgroup accumulates ``tile_m × tile_n`` in fp32.
3. Epilogue per warpgroup: round the accumulator to the stored dtype (so the partials describe the
   logits as stored, exactly as XLA's logsumexp of the stored logits), take each row's max ``m`` and
   ``s = Σ exp(x − m)`` over its ``tile_n`` columns, and TMA-store the logits in 64 × ``epi_cols``
   sub-tiles through two SMEM slots (a store overlaps the next sub-tile's SMEM write) plus ``m`` and
   ``s`` as row ``vocab tile`` of ``pmax`` / ``psum``.
``reference.combine_partials`` turns the partials into the logsumexp (a [V/tile_n, C] read, 1.6 %
of the fp32 logits' bytes at tile_n = 128).
4. For the training loss's gradients (``shift``, ``labels`` given) the epilogue stores, instead of the
   logits, ``exp(x − shift)`` in bf16 with the label's column zeroed
   (``reference.shifted_exponentials``): from the ``exp(x − m)`` it already forms for ``s``, times the
   row's ``exp(min(m − shift, CLAMP))``; half the bytes of fp32 logits, and no pass over them
   before the gradient matmuls (``k3jax.train.loss``).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.head_ce.reference import CLAMP
from pallas_kernels.moe.kernel_gpu import _chain_state, _gmm_pipeline
from pallas_kernels.moe.kernel_gpu_base import _COMPUTE_WGS, GpuTiling, _swizzled, persistent_kernel


@dataclasses.dataclass(frozen=True)
class HeadTiling(GpuTiling):
    """The MoE ``GpuTiling`` (its ``tile_m``, ``tile_n``, ``tile_k``, ``stages``, ``chain_tiles`` and
    ``overlap_wgmma`` apply here) plus ``epi_cols``: the logits leave through SMEM in
    64 × ``epi_cols`` sub-tiles, two slots per warpgroup.

    ``chain_tiles``: one pipeline across a CTA's tiles, as in the MoE gmm, so the next tile's loads
    overlap the epilogue. ``overlap_wgmma``: a step waits for the previous step's wgmma, not its own,
    and its slots are released one step late (``delay_release``; not with ``chain_tiles``).
    """

    epi_cols: int = 64


# SMEM at the default: 3 × (128 × 64 + 64 × 256) × 2 B = 144 KB of operand slots + 2 × 2 × 64 × 64 ×
# 4 B = 64 KB of fp32 logits slots + 2 KB of partials, under the 232448 B a CTA may take.
HEAD_TILING = HeadTiling(tile_m=128, tile_n=128, tile_k=64, stages=3)
# Candidates for bench_loss.py --tilings (the kernel alone, bf16 logits), with Mosaic GPU's SMEM count
# at bf16 / fp32 logits. A fourth 48 KB operand stage fits only beside 64 × 32 bf16 logits slots.
HEAD_CANDIDATES = {
    "default": HEAD_TILING,  # 182 / 215 KB
    "overlap": dataclasses.replace(HEAD_TILING, overlap_wgmma=True),
    "chain2": dataclasses.replace(HEAD_TILING, stages=2, chain_tiles=True),  # 133 / 166 KB
    "n64_chain4": dataclasses.replace(HEAD_TILING, tile_n=64, stages=4, chain_tiles=True),  # 166 / 199 KB
    "n64_overlap4": dataclasses.replace(HEAD_TILING, tile_n=64, stages=4, overlap_wgmma=True),
    "overlap4": dataclasses.replace(HEAD_TILING, stages=4, overlap_wgmma=True, epi_cols=32),  # bf16 only
    "chain4": dataclasses.replace(HEAD_TILING, stages=4, chain_tiles=True, epi_cols=32),  # bf16 only
}
_EPI_ROWS = 64  # a WGMMA row group
_LOG2E = math.log2(math.e)


def _epilogue(acc, o_smem, r_smem, out_gmem, pmax_gmem, psum_gmem, logits_dtype, shifted=None):
    """One warpgroup's ``tile_m × tile_n`` accumulator → its logits (or, with ``shifted``, its shifted
    exponentials) and row partials in HBM. ``shifted``: the tile rows' ``(shift, label)`` from
    :func:`_row_values` and the tile's first column."""
    x = acc[...].astype(logits_dtype)  # [tm, tn], rounded as the logits are stored
    xr = x.astype(jnp.float32)
    top = xr.max(axis=1)  # [tm]
    p = jnp.exp2((xr - lax.broadcast_in_dim(top, xr.shape, [0])) * _LOG2E)
    sums = p.sum(axis=1)
    if shifted is None:
        out = x
    else:  # exp(x − shift) as exp(x − top) · exp(min(top − shift, CLAMP)), 0 at the label's column
        (shift, label), col0 = shifted
        scale = jnp.exp2(jnp.minimum(top - shift, CLAMP) * _LOG2E)
        cols = col0 + plgpu.broadcasted_iota(jnp.int32, xr.shape, 1, layout=plgpu.Layout.WGMMA)
        hit = cols == lax.broadcast_in_dim(label, xr.shape, [0])
        out = jnp.where(hit, 0.0, p * lax.broadcast_in_dim(scale, xr.shape, [0])).astype(out_gmem.dtype)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's stores have read the slots
    r_smem[0] = top
    r_smem[1] = sums
    tm, tn = out.shape
    em, en = o_smem.shape[1:]
    subs = [(i, j) for i in range(tm // em) for j in range(tn // en)]
    for step, (i, j) in enumerate(subs):
        slot = step % 2
        if step >= 2:
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the store two sub-tiles back is done
        o_smem[slot] = out[i * em:(i + 1) * em, j * en:(j + 1) * en]
        plgpu.commit_smem()
        if step == 0:
            plgpu.copy_smem_to_gmem(r_smem.at[0], pmax_gmem)
            plgpu.copy_smem_to_gmem(r_smem.at[1], psum_gmem)
        plgpu.copy_smem_to_gmem(o_smem.at[slot], out_gmem.at[pl.ds(i * em, em), pl.ds(j * en, en)])


def _row_values(shift_ref, label_ref):
    """The tile rows' shift and label in the accumulator's row layout, loaded from HBM before the
    tile's matmul so that their latency hides under it."""
    row = plgpu.Layout.WGMMA.reduce(1)
    return plgpu.load(shift_ref, layout=row, optimized=False), plgpu.load(label_ref, layout=row, optimized=False)


def _body(f_gmem, w_gmem, *refs, cfg, c, d, v, logits_dtype):
    shifted = len(refs) == 5  # (shift, labels, out, pmax, psum) or (out, pmax, psum)
    shift_gmem, label_gmem = refs[:2] if shifted else (None, None)
    out_gmem, pmax_gmem, psum_gmem = refs[-3:]
    tm, tn, cta_n = cfg.tile_m, cfg.tile_n, cfg.cta_n()
    grid_m, grid_n = c // tm, v // cta_n
    delay = 1 if cfg.overlap_wgmma else 0  # wgmmas left in flight when a step returns
    pipeline = functools.partial(_gmm_pipeline, cfg, d, f_gmem.dtype, False, delay_release=delay)
    ignore = lambda *_, **__: None
    em, en = min(_EPI_ROWS, tm), min(getattr(cfg, "epi_cols", 64), tn)  # a plain GpuTiling: 64

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(f_gmem.at[pl.ds(0, tm)], w_gmem.at[:, pl.ds(0, cta_n)]),
        o_smem=plgpu.SMEM((_COMPUTE_WGS, 2, em, en), out_gmem.dtype, transforms=_swizzled(en, out_gmem.dtype)),
        r_smem=plgpu.SMEM((_COMPUTE_WGS, 2, tm), jnp.float32),
        collective_axes="wg",
    )
    def _scope(allocs, o_smem, r_smem):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((grid_m * grid_n,), collective_axes="sm")
        def _tiles(info):
            # consecutive tiles share the vocabulary block: its head panel is read from HBM once
            mi, ni = info.index[0] % grid_m, info.index[0] // grid_m
            rows = pl.ds(mi * tm, tm)
            vt = ni * _COMPUTE_WGS + wg  # this warpgroup's vocabulary tile

            def compute_context(run):
                rows_of = (_row_values(shift_gmem.at[rows], label_gmem.at[rows]), vt * tn) if shifted else None

                @functools.partial(pl.run_scoped, acc=plgpu.ACC((tm, tn), jnp.float32))
                def _acc(acc):
                    run(acc)
                    _epilogue(acc, o_smem.at[wg], r_smem.at[wg], out_gmem.at[rows, pl.ds(vt * tn, tn)],
                              pmax_gmem.at[vt, rows], psum_gmem.at[vt, rows], logits_dtype, rows_of)

            def mma(_, a_smem, b_smem, acc):
                plgpu.wgmma(acc, a_smem, b_smem.at[:, pl.ds(wg * tn, tn)])
                # the step's slots are released when the body returns (delay: that many steps later)
                plgpu.wgmma_wait(delay)
                return acc

            def run(state):
                pipeline(mma, compute_context, state=state)(
                    f_gmem.at[rows], w_gmem.at[:, pl.ds(ni * cta_n, cta_n)], allocations=allocs)

            if cfg.chain_tiles:  # the next tile's loads overlap this tile's epilogue
                pl.when(info.num_local_steps == 1)(lambda: run(None))
                pl.when(info.num_local_steps > 1)(lambda: run(_chain_state(info)))
            else:
                run(None)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def check_shapes(c: int, d: int, v: int, tiling: GpuTiling = HEAD_TILING) -> str | None:
    """Why the kernel cannot take ``f [c, d] @ w [d, v]`` at ``tiling``, or None if it can."""
    if c % tiling.tile_m:
        return f"the chunk's rows C={c} must be a multiple of tile_m={tiling.tile_m}"
    if d % tiling.tile_k:
        return f"D={d} must be a multiple of tile_k={tiling.tile_k}"
    if v % tiling.cta_n():
        return f"V={v} must be a multiple of 2·tile_n={tiling.cta_n()}"
    if tiling.chain_tiles and tiling.overlap_wgmma:
        return "tiling.chain_tiles and tiling.overlap_wgmma exclude each other (a chain has no delayed release)"
    if tiling.overlap_wgmma and tiling.stages < 2:
        return f"tiling.overlap_wgmma needs stages >= 2, got {tiling.stages}"
    if tiling.chain_tiles and (d // tiling.tile_k) % tiling.stages:
        return (f"tiling.chain_tiles needs D/tile_k a multiple of stages, got {d}/{tiling.tile_k} and "
                f"stages={tiling.stages}")
    return None


# Jitted so that every chunk (and every call with the same shapes) reuses one Mosaic GPU kernel.
@functools.partial(jax.jit, static_argnames=("logits_dtype", "tiling", "interpret"))
def logits_partials(f, w, shift=None, labels=None, *, logits_dtype=jnp.float32, tiling: GpuTiling | None = None,
                    interpret: bool = False):
    """``f [C, D]`` (bf16/f16), ``w [D, V]`` (same dtype) → logits ``[C, V]`` in ``logits_dtype``,
    ``pmax, psum [V/tile_n, C]`` (fp32): per vocabulary tile and row, the max and Σ exp(x − max).

    With ``shift [C]`` (fp32) and ``labels [C]`` (int32) the first output is instead
    ``exp(min(x − shift, CLAMP))`` in ``f``'s dtype, 0 at each row's label column
    (``reference.shifted_exponentials``); ``x`` is still rounded to ``logits_dtype`` first."""
    cfg = tiling or HEAD_TILING
    (c, d), v = f.shape, w.shape[1]
    if w.shape[0] != d or w.dtype != f.dtype:
        raise ValueError(f"w must be [D={d}, V] in {f.dtype}, got {w.shape} {w.dtype}")
    if (shift is None) != (labels is None):
        raise ValueError("shift and labels must be given together")
    if shift is not None and (shift.shape != (c,) or shift.dtype != jnp.float32 or labels.shape != (c,)
                              or labels.dtype != jnp.int32):
        raise ValueError(f"shift must be float32 [C={c}] and labels int32 [C={c}], got {shift.shape} {shift.dtype}, "
                         f"{labels.shape} {labels.dtype}")
    why = check_shapes(c, d, v, cfg)
    if why:
        raise ValueError(why)
    body = functools.partial(_body, cfg=cfg, c=c, d=d, v=v, logits_dtype=jnp.dtype(logits_dtype))
    part = jax.ShapeDtypeStruct((v // cfg.tile_n, c), jnp.float32)
    out_dtype = jnp.dtype(logits_dtype) if shift is None else f.dtype
    out_type = (jax.ShapeDtypeStruct((c, v), out_dtype), part, part)
    operands = (f, w) if shift is None else (f, w, shift, labels)
    name = "head_logits_lse" if shift is None else "head_exps_lse"
    return persistent_kernel(body, out_type, interpret=interpret, name=name)(*operands)
