"""Shared pieces of the Hopper grouped-matmul kernels (``kernel_gpu.gmm``, ``kernel_gpu_tgmm.tgmm``):
the tiling, the compute-warpgroup count, swizzled SMEM layouts and the interpret switch."""

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.target import current_target

_COMPUTE_WGS = 2
_DETECT_RACES = False  # tests switch on the GPU interpreter's race detector here


@dataclasses.dataclass(frozen=True)
class GpuTiling:
    """Tile sizes; the CTA tile is ``tile_m × 2·tile_n`` with ``stages`` shared-memory slots.

    In ``gmm`` ``tile_k`` is the contraction step; in ``tgmm`` the contraction runs over
    rows in steps of ``tile_m`` and ``tile_k`` is the output-row tile. ``group_chunk``
    (tgmm only): 0 runs one pipeline per (group, output tile); C > 0 one per C groups.
    ``overlap_wgmma`` (tgmm only): a step waits for the previous step's wgmma, not its own;
    its slot is released one step later, and the memory warpgroup waits for the compute
    warpgroups' last wgmma before it refills the slots for the next pipeline.
    ``aligned``: ``gmm`` work tiles start at their group's first row rounded down to 8
    (``schedule.aligned_tile_schedule``), per-group ``tgmm`` row blocks at the group's first row
    rounded down to 8; False: both at multiples of ``tile_m``.
    ``half_tiles`` (gmm only, ``tile_m`` a multiple of 128): a work tile whose rows all lie in its
    first ``tile_m / 2`` issues its wgmmas on those rows only (half the tensor-core work).
    ``trim_rows`` (tgmm only, ``tile_m`` at least two wgmma K groups): a row block contracts only
    over the K groups (64 rows at the 128-byte swizzle) that hold rows of its group.
    ``swizzle_bytes`` (tgmm only; 0: the widest that fits): the operand tiles' swizzle; a
    wgmma's K group is ``swizzle_bytes / itemsize`` rows, so 32 lets ``trim_rows`` trim to 16 rows.
    ``chain_tiles`` (gmm only; the K steps ``K / tile_k`` a multiple of ``stages``): a CTA's work tiles run
    as one pipeline of pipelines (``pipeline_state``): the memory warpgroup loads the next tile's first
    blocks while the compute warpgroups finish a tile and store it, instead of draining the ring per tile.
    ``group_run`` (per-group tgmm only): the tile loop takes the same (K tile, N tile) of ``group_run``
    consecutive groups in a row, so CTAs that run at the same time read different rows (1: all
    output tiles of a group in a row).
    ``ring`` (gmm and per-group tgmm, ``stages`` >= 2): one hand-written producer/consumer ring of
    slots across a CTA's tiles (``kernel_gpu_gmm_ring``, ``kernel_gpu_tgmm_ring``) instead of a
    pipeline per tile, so a tile's loads start while the previous tile's last wgmma and store
    finish; one wgmma stays in flight. ``ring_k_steps`` (gmm only): the ring is taken when a tile
    has at most this many K steps (``K / tile_k``), where a per-tile pipeline's ramp and drain weigh
    most. ``store_rows`` (ring tgmm only, a multiple of 64 dividing
    ``tile_k``; 0: all): the output tile goes through a staging tile of that many rows.
    ``cluster_n`` (gmm only): CTAs run in clusters of two that take adjacent N tiles of the same
    work tile, and each lhs block reaches both by one multicast TMA (a sixth less traffic a step).
    ``cluster_k`` (per-group tgmm only): CTAs run in clusters of two that take adjacent output-row
    tiles of the same (group, N tile), and each ``dout`` block reaches both by one multicast TMA:
    a third less L2-to-SM traffic per step (``dout`` is two thirds of a step's bytes).
    """

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    stages: int = 3
    grid_tile_width: int = 8
    aligned: bool = True  # gmm tiles / per-group tgmm row blocks start at group starts
    group_chunk: int = 0
    overlap_wgmma: bool = False  # tgmm only: keep one wgmma in flight (slots released a step late)
    reset_acc: bool = False  # chunked tgmm, compiled only: zero the accumulator at group ends
    half_tiles: bool = False  # gmm only: wgmma on the first tile_m/2 rows when the tile's rows fit there
    trim_rows: bool = False  # tgmm only: contract a partial row block over its valid K groups only
    swizzle_bytes: int = 0  # tgmm only: operand swizzle (0: widest; 32: 16-row K groups for trim_rows)
    cluster_n: bool = False  # gmm only: 2-CTA clusters share each lhs block by multicast
    cluster_k: bool = False  # per-group tgmm only: 2-CTA clusters share each dout block by multicast
    chain_tiles: bool = False  # gmm only: one pipeline across a CTA's tiles (next tile's loads overlap the store)
    group_run: int = 1  # per-group tgmm only: tiles of this many groups per (K tile, N tile) in a row
    ring: bool = False  # gmm, per-group tgmm: one slot ring across a CTA's tiles (no drain per tile)
    ring_k_steps: int = 0  # gmm only: ring=True when K / tile_k <= this (0: as ``ring`` says)
    store_rows: int = 0  # ring tgmm only: stage the output tile this many rows at a time (0: all)

    def cta_n(self) -> int:
        return _COMPUTE_WGS * self.tile_n


def _num_sms(interpret: bool) -> int:
    """SMs of the GPU compiled for (the target's, so a device-less AOT compile sizes the grid right)."""
    if interpret:
        return 2
    cores = current_target().num_cores
    return cores if cores else jax.devices()[0].core_count


def _swizzled(minor_elems: int, dtype, swizzle_bytes: int = 0):
    """SMEM transforms of a tile with ``minor_elems`` contiguous elements: the widest swizzle
    that fits, or ``swizzle_bytes`` if nonzero."""
    swizzle = swizzle_bytes or plgpu.find_swizzle(minor_elems * jnp.dtype(dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def _compiler_params(interpret: bool):
    del interpret
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


def _interpret_arg(interpret: bool):
    return plgpu.InterpretGPUParams(detect_races=_DETECT_RACES) if interpret else None


def pad_rows_for_aligned(tile_m: int, *xs):
    """Zero rows appended to each ``[M, ·]`` array so that tiles starting at any multiple of 8 rows
    (``aligned`` tilings) fit: ``(rows, *padded)`` with ``rows = max(tile_m, M rounded up to 8)``."""
    m = xs[0].shape[0]
    rows = max(tile_m, m + (-m % 8))
    return (rows, *(jnp.pad(x, ((0, rows - m), (0, 0))) if rows != m else x for x in xs))


def _zeros_wgmma(shape, dtype):
    return plgpu.layout_cast(jnp.zeros(shape, dtype), plgpu.Layout.WGMMA)


def persistent_kernel(body, out_type, *, interpret: bool, name: str, cluster: int = 1):
    """``body`` as a persistent kernel: one CTA per SM, one memory + ``_COMPUTE_WGS`` compute
    warpgroups; with ``cluster > 1`` the CTAs run in clusters of that size (axis ``"cluster"``) and
    the grid axis ``"sm"`` counts clusters."""
    extra = dict(cluster=(cluster,), cluster_names=("cluster",)) if cluster > 1 else {}
    call = plgpu.kernel(
        body,
        out_type=out_type,
        grid=(_num_sms(interpret) // cluster,),  # looked up per call: tests pretend 132 SMs
        grid_names=("sm",),
        **extra,
        num_threads=_COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=_compiler_params(interpret),
        interpret=_interpret_arg(interpret),
        kernel_name=name,
    )

    def traced_x32(*args):
        # The kernel is traced with 32-bit defaults whatever the caller's ``jax_enable_x64``, so its
        # jaxpr is the same as without x64 (its operands are typed: bf16/f32 data, int32 metadata).
        # Under x64, Pallas' warp-specialised pipeline starts its slot counters from Python ints,
        # i.e. int64; the GPU interpreter then lowers that jaxpr again in worker threads, where a
        # ``jax.enable_x64()`` context (thread-local) is off, and a loop's int64 carry meets an
        # int32 initial value: "expect operands to be compatible with condition block arguments".
        with jax.enable_x64(False):
            return call(*args)

    return traced_x32
