"""The dense decode path's gate/up and down products as one Mosaic GPU kernel: a CTA per expert.

``kernel_gpu_decode_dense_tma`` streams every expert through two persistent kernels, ``gate_up`` then
``down``, with the activations ``a [E, Tp, F]`` written between them. Where an expert's activations fit
in shared memory (``Tp × F`` bf16 ≤ 64 KB: small()'s F = 512 at 64 token rows), one CTA can take a
whole expert: its memory warpgroup streams ``W1_e`` / ``W3_e`` slabs and then ``W2_e`` slabs through
one ring of slots, the two compute warpgroups store each gated tile of ``a_e`` into shared memory,
meet at a barrier, and run the down product with ``a_e`` as the ``wgmma`` A operand straight from
there. One kernel boundary a MoE layer fewer, no ``a`` in memory, and the ring's loads of ``W2_e``
start while the gate/up epilogue runs.

Per expert, ``Tp = 64`` token rows (one ``wgmma`` row group), ``tile_k = 64``-row slabs:
1. gate/up, ``F / 128`` column tiles: a step copies ``x[:, k-slab]`` (L2-resident), ``W1_e`` and
   ``W3_e``'s ``[64, 128]`` slabs; compute warpgroup ``w`` takes 64 columns of each, rounds both
   products to the compute dtype, applies the activation in float32 and stores the rounded tile as
   ``a_e``'s k-slab ``2·tile + w``;
2. down, ``L / 256`` column tiles: a step copies ``W2_e``'s ``[64, 256]`` slab as two halves, one a
   compute warpgroup; the product's tile is rounded and stored to ``y [E, Tp, L]`` by TMA.
The rounding points and the summation order over k-slabs are the two-kernel path's, so the outputs
equal it bit for bit. ``interpret=True`` runs the GPU interpreter on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float

from pallas_kernels.moe import slot_ring
from pallas_kernels.moe.activations import gated_activation
from pallas_kernels.moe.kernel_gpu_base import _COMPUTE_WGS, _swizzled, persistent_kernel

TOKEN_ROWS = 64
TILE_K = 64  # rows a slab; also each compute warpgroup's gate/up columns (one k-slab of a_e)
GU_COLS = _COMPUTE_WGS * TILE_K  # a gate/up column tile
DOWN_COLS = 2 * GU_COLS  # a down column tile: 128 a compute warpgroup
STAGES = 3
SMEM_BYTES = 227 * 1024  # Hopper's shared memory a CTA


def smem_bytes(F: int, stages: int = STAGES) -> int:
    """Shared memory the kernel takes at ``F`` intermediate columns (16-bit operands)."""
    slot = (TOKEN_ROWS * TILE_K + 2 * TILE_K * GU_COLS) * 2
    return stages * slot + TOKEN_ROWS * F * 2 + _COMPUTE_WGS * TOKEN_ROWS * GU_COLS * 2


def takes(T: int, L: int, F: int) -> bool:
    """Whether the kernel takes ``T`` tokens and experts ``[L, F]`` / ``[F, L]`` (``check_widths``)."""
    try:
        check_widths(T, L, F)
    except ValueError:
        return False
    return True


def check_widths(T: int, L: int, F: int) -> None:
    """Raise ``ValueError`` naming the width the kernel cannot take."""
    if not 1 <= T <= TOKEN_ROWS:
        raise ValueError(f"fused dense experts: T={T} tokens must be in 1..{TOKEN_ROWS}")
    if L % DOWN_COLS or F % GU_COLS:
        raise ValueError(f"fused dense experts: L={L} must be a multiple of {DOWN_COLS} and F={F} of {GU_COLS}")
    if smem_bytes(F) > SMEM_BYTES:
        raise ValueError(f"fused dense experts: F={F} needs {smem_bytes(F)} bytes of shared memory, over "
                         f"{SMEM_BYTES} (a_e is {TOKEN_ROWS} x F in shared memory)")


def _body(x_gmem, w1_gmem, w3_gmem, w2_gmem, y_gmem, *, epilogue):
    E, L, F = w1_gmem.shape
    dtype = x_gmem.dtype
    gu_tiles, gu_k, dn_tiles, dn_k = F // GU_COLS, L // TILE_K, L // DOWN_COLS, F // TILE_K
    n_gu, n_dn = gu_tiles * gu_k, dn_tiles * dn_k
    steps_per_expert = n_gu + n_dn
    swz = _swizzled(TILE_K, dtype)

    def for_each_expert(per_expert):
        @plgpu.nd_loop((E,), collective_axes="sm", init_carry=jnp.int32(0))
        def _experts(info, carry):
            per_expert(carry, info.index[0])
            return carry + steps_per_expert

        return _experts

    def scoped(loaded_gu, loaded_dn, consumed, a_ready, x_smem, w_smem, a_smem, o_smem):
        gu = slot_ring.SlotRing(STAGES, loaded_gu, consumed)
        dn = slot_ring.SlotRing(STAGES, loaded_dn, consumed)

        def load(ring, loaded, step, copies):
            """Once the step's slot is free, ``(gmem source, slot -> smem dest)`` copies into it."""
            slot = ring.slot(step)
            pl.when(step >= STAGES)(lambda: plgpu.barrier_wait(consumed.at[slot]))
            for src, dst in copies:
                plgpu.copy_gmem_to_smem(src, dst(slot), loaded.at[slot])

        def memory():
            def per_expert(step0, e):
                @pl.loop(0, gu_tiles)
                def _(c):
                    cols = pl.ds(c * GU_COLS, GU_COLS)

                    @pl.loop(0, gu_k)
                    def _(kk):
                        kcols = pl.ds(kk * TILE_K, TILE_K)
                        load(gu, loaded_gu, step0 + c * gu_k + kk, [
                            (x_gmem.at[:, kcols], lambda slot: x_smem.at[slot]),
                            (w1_gmem.at[e, kcols, cols], lambda slot: w_smem.at[slot, 0]),
                            (w3_gmem.at[e, kcols, cols], lambda slot: w_smem.at[slot, 1])])

                @pl.loop(0, dn_tiles)
                def _(c):
                    @pl.loop(0, dn_k)
                    def _(kk):
                        kcols = pl.ds(kk * TILE_K, TILE_K)
                        load(dn, loaded_dn, step0 + n_gu + c * dn_k + kk, [
                            (w2_gmem.at[e, kcols, pl.ds(c * DOWN_COLS + h * GU_COLS, GU_COLS)],
                             lambda slot, h=h: w_smem.at[slot, h]) for h in range(2)])

            gu.drain(for_each_expert(per_expert))

        def compute(wg):
            wg_cols = pl.ds(wg * TILE_K, TILE_K)

            def per_expert(step0, e):
                @pl.loop(0, gu_tiles)
                def _(c):
                    def step(accs, kk):
                        s = step0 + c * gu_k + kk
                        slot = gu.take(s)
                        for i, acc in enumerate(accs):
                            plgpu.wgmma(acc, x_smem.at[slot], w_smem.at[slot, i, :, wg_cols])
                        gu.release_previous(s, kk == 0)

                    @functools.partial(pl.run_scoped, accs=[plgpu.ACC((TOKEN_ROWS, TILE_K), jnp.float32) for _ in range(2)])
                    def _acc(accs):
                        pl.loop(0, gu_k)(functools.partial(step, accs))
                        plgpu.wgmma_wait(0)
                        gu.release(step0 + c * gu_k + gu_k - 1)
                        a_smem.at[c * _COMPUTE_WGS + wg][...] = epilogue(accs).astype(dtype)

                plgpu.commit_smem()  # the tiles are wgmma operands: visible to the async proxy
                plgpu.barrier_arrive(a_ready)
                plgpu.barrier_wait(a_ready)  # both warpgroups' tiles of a_e are in

                @pl.loop(0, dn_tiles)
                def _(c):
                    def step(acc, kk):
                        s = step0 + n_gu + c * dn_k + kk
                        slot = dn.take(s)
                        plgpu.wgmma(acc, a_smem.at[kk], w_smem.at[slot, wg])
                        dn.release_previous(s, kk == 0)

                    @functools.partial(pl.run_scoped, acc=plgpu.ACC((TOKEN_ROWS, GU_COLS), jnp.float32))
                    def _acc(acc):
                        pl.loop(0, dn_k)(functools.partial(step, acc))
                        plgpu.wgmma_wait(0)
                        dn.release(step0 + n_gu + c * dn_k + dn_k - 1)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last store has read o_smem
                        o_smem.at[wg][...] = acc[...].astype(y_gmem.dtype)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(o_smem.at[wg],
                                                y_gmem.at[e, :, pl.ds(c * DOWN_COLS + wg * GU_COLS, GU_COLS)])

                # Every down wgmma of both warpgroups has read a_e before the next expert overwrites it.
                plgpu.barrier_arrive(a_ready)
                plgpu.barrier_wait(a_ready)

            for_each_expert(per_expert)

        slot_ring.split_warpgroups(memory, compute)

    pl.run_scoped(
        scoped,
        loaded_gu=plgpu.Barrier(num_arrivals=3, num_barriers=STAGES),
        loaded_dn=plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),
        consumed=plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=STAGES),
        a_ready=plgpu.Barrier(num_arrivals=_COMPUTE_WGS),
        x_smem=plgpu.SMEM((STAGES, TOKEN_ROWS, TILE_K), dtype, transforms=swz),
        w_smem=plgpu.SMEM((STAGES, 2, TILE_K, GU_COLS), dtype, transforms=_swizzled(GU_COLS, dtype)),
        a_smem=plgpu.SMEM((F // TILE_K, TOKEN_ROWS, TILE_K), dtype, transforms=swz),
        o_smem=plgpu.SMEM((_COMPUTE_WGS, TOKEN_ROWS, GU_COLS), y_gmem.dtype),
        collective_axes="wg",
    )
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def expert_outputs(x: Float[Array, "T L"], w1: Float[Array, "E L F"], w3: Float[Array, "E L F"],
                   w2: Float[Array, "E F L"], *, activation: str, situ_beta: float = 4.0,
                   situ_linear_beta: float = 25.0, interpret: bool = False) -> Float[Array, "E T L"]:
    """Every expert's output on every token, ``[E, T, L]``: ``round(act(round(x·W1_e), round(x·W3_e))·W2_e)``
    (``kernel_gpu_decode_dense_tma.expert_outputs``'s values, in one kernel)."""
    T, L = x.shape
    E, _, F = w1.shape
    check_widths(T, L, F)
    dt = x.dtype

    def epilogue(accs):
        g, u = (acc[...].astype(dt).astype(jnp.float32) for acc in accs)
        return gated_activation(g, u, activation, situ_beta, situ_linear_beta)

    xp = jnp.pad(x, ((0, TOKEN_ROWS - T), (0, 0))) if T != TOKEN_ROWS else x
    call = persistent_kernel(functools.partial(_body, epilogue=epilogue),
                             jax.ShapeDtypeStruct((E, TOKEN_ROWS, L), dt), interpret=interpret,
                             name="moe_decode_dense_fused")
    return call(xp, w1, w3, w2)[:, :T]
