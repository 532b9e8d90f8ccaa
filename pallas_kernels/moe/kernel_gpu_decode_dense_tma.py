"""The dense decode path's two expert kernels in Pallas Mosaic GPU: TMA streams, ``wgmma`` products.

``kernel_gpu_decode_dense`` runs the gate/up and down products of every expert on every token as
Pallas-Triton kernels, whose ``cp.async`` copies stream ``small()``'s 100 MB of experts at ~2.2 TB/s
on the H200 (RESULTS.md stop 52), under half its HBM. Here the same two kernels are persistent
Hopper kernels, warp-specialised (as the training forward's ``kernel_gpu_gmm_ring``): one memory
warpgroup streams TMA copies of ``[tile_k, 2·tile_n]`` weight slabs (and the token rows' ``[Tp, tile_k]``
slab, L2-resident) into a ring of ``stages`` shared-memory slots (``slot_ring``) that runs on across the
CTA's (expert, column tile) pairs, two compute warpgroups issue ``wgmma`` into float32 accumulators, each
owning ``tile_n`` of the slab's columns, and release a slot once the next step's wgmmas are issued.

1. :func:`gate_up`: ``x [Tp, L]`` (every expert's rows) against ``W1_e``, ``W3_e`` — two
   accumulators, both rounded to the compute dtype, the gated activation in float32, rounded, and
   the tile stored to ``a [E, Tp, F]`` by TMA;
2. :func:`down`: ``a_e [Tp, F]`` against ``W2_e``, rounded, stored to ``y [E, Tp, L]``.

The rounding points are ``kernel_gpu_decode_dense``'s (the reference's); only the float32 summation
order differs. ``Tp`` is the token count padded to ``TOKEN_ROWS`` (one ``wgmma`` row group; more
tokens take the Triton kernels). ``kernel_gpu_decode_dense.expert_outputs`` runs these where they take
the shapes (:func:`takes`) and no Triton tiling is asked for: on an H100 they stream small()'s experts
5.7 % faster (51.5 against 54.6 µs a layer; XLA's one-pass read of the same 100 MB, 41.8 µs, is the
ceiling measured beside them), and the ring 1.6 % faster again than one pipeline a tile (50.7 against
51.6 µs; the decode step at batch 64 1.745 -> 1.734 ms; RESULTS.md stop 58). ``interpret=True`` runs
the GPU interpreter on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float

from pallas_kernels.moe import slot_ring
from pallas_kernels.moe.activations import gated_activation
from pallas_kernels.moe.kernel_gpu_base import _COMPUTE_WGS, _swizzled, persistent_kernel
from pallas_kernels.moe.validate import passes

TOKEN_ROWS = 64  # one wgmma row group: every token of a tile in one accumulator


@dataclasses.dataclass(frozen=True)
class TmaTiles:
    """``tile_n`` columns a compute warpgroup (a CTA streams ``2·tile_n``), ``tile_k`` rows a slab,
    ``stages`` slabs in flight."""

    tile_n: int = 128
    tile_k: int = 64
    stages: int = 2

    def cta_n(self) -> int:
        return _COMPUTE_WGS * self.tile_n


# 64 columns a compute warpgroup, 5 slabs in flight: small()'s batch 64 (E 64, L = F = 512) in 51.5 µs a
# layer on an H100 against 54.6 for the Triton kernels' WIDE tiles and 53.4 with 128 columns and 2 slabs
# (``bench_moe_decode.py --path dense``, cold weights; RESULTS.md stop 55); on the ring 50.7 µs, 4 slabs
# 50.1, 3 slabs 51.3, 128-row slabs 52.7, 128 columns 54.9 (stop 58; 32-row slabs and 32 columns do not
# lower)
DEFAULT = TmaTiles(tile_n=64, tile_k=64, stages=5)


def takes(T: int, L: int, F: int, tiles: TmaTiles = DEFAULT) -> bool:
    """Whether the kernels take ``T`` tokens and experts ``[L, F]`` / ``[F, L]`` (:func:`check_widths` of both)."""
    return all(passes(check_widths, T, K, N, tiles, "takes") for K, N in ((L, F), (F, L)))


def check_widths(T: int, K: int, N: int, tiles: TmaTiles, name: str) -> None:
    """Raise ``ValueError`` unless the kernels take ``T`` tokens and a ``[K, N]`` weight."""
    if not 1 <= T <= TOKEN_ROWS:
        raise ValueError(f"{name}: the TMA kernels take 1..{TOKEN_ROWS} tokens, got {T}")
    if K % tiles.tile_k or N % tiles.cta_n():
        raise ValueError(f"{name}: K={K} must be a multiple of tiles.tile_k={tiles.tile_k} and N={N} of "
                         f"2·tiles.tile_n={tiles.cta_n()}")


def _body(lhs_gmem, *refs, tiles: TmaTiles, epilogue, shared_lhs: bool):
    """Persistent CTA: (expert, column tile) pairs over one ``slot_ring`` that persists across its tiles;
    ``refs`` = weights ``[E, K, N]`` then the output ``[E, Tp, N_out]``; ``epilogue(accs) -> tile`` makes the
    stored tile from the accumulators. The memory warpgroup loads the next tile's first slabs while the
    compute warpgroups finish a tile and store it, and one step's wgmmas stay in flight
    (``kernel_gpu_gmm_ring``'s pattern)."""
    *w_gmems, out_gmem = refs
    E, K, N = w_gmems[0].shape
    Tp, tn, tk, cta_n = lhs_gmem.shape[-2], tiles.tile_n, tiles.tile_k, tiles.cta_n()
    dtype, n_tiles, ksteps = lhs_gmem.dtype, N // cta_n, K // tiles.tile_k

    def for_each_tile(per_tile):
        """``per_tile(step0, e, ni)`` over this CTA's (expert, column tile) pairs, ``step0`` the ring steps of
        its earlier tiles; returns the steps of all of them."""

        @plgpu.nd_loop((E * n_tiles,), collective_axes="sm", init_carry=jnp.int32(0))
        def _tiles(info, carry):
            per_tile(carry, info.index[0] // n_tiles, info.index[0] % n_tiles)
            return carry + ksteps

        return _tiles

    w_smems = {f"w{i}_smem": plgpu.SMEM((tiles.stages, tk, cta_n), dtype, transforms=_swizzled(cta_n, dtype))
               for i in range(len(w_gmems))}

    @slot_ring.scoped(tiles.stages, copies_per_step=1 + len(w_gmems),
                      x_smem=plgpu.SMEM((tiles.stages, Tp, tk), dtype, transforms=_swizzled(tk, dtype)),
                      o_smem=plgpu.SMEM((_COMPUTE_WGS, Tp, tn), out_gmem.dtype), **w_smems)
    def _scope(ring, x_smem, o_smem, **w_refs):
        ws = [w_refs[f"w{i}_smem"] for i in range(len(w_gmems))]

        def memory():
            def per_tile(step0, e, ni):
                lhs = lhs_gmem if shared_lhs else lhs_gmem.at[e]
                cols = pl.ds(ni * cta_n, cta_n)

                @pl.loop(0, ksteps)
                def _(kk):
                    kcols = pl.ds(kk * tk, tk)
                    ring.load(step0 + kk, [(lhs.at[:, kcols], x_smem)]
                              + [(w.at[e, kcols, cols], w_smem) for w, w_smem in zip(w_gmems, ws)])

            ring.drain(for_each_tile(per_tile))

        def compute(wg):
            wg_n = pl.ds(wg * tn, tn)

            def per_tile(step0, e, ni):
                def step(accs, kk):
                    slot = ring.take(step0 + kk)
                    for acc, w_smem in zip(accs, ws):
                        plgpu.wgmma(acc, x_smem.at[slot], w_smem.at[slot, :, wg_n])
                    ring.release_previous(step0 + kk, kk == 0)

                @functools.partial(pl.run_scoped, accs=[plgpu.ACC((Tp, tn), jnp.float32) for _ in w_gmems])
                def _acc(accs):
                    pl.loop(0, ksteps)(functools.partial(step, accs))
                    plgpu.wgmma_wait(0)
                    ring.release(step0 + ksteps - 1)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's store has read o_smem
                    o_smem.at[wg][...] = epilogue(accs).astype(out_gmem.dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(o_smem.at[wg], out_gmem.at[e, :, pl.ds(ni * cta_n + wg * tn, tn)])

            for_each_tile(per_tile)

        slot_ring.split_warpgroups(memory, compute)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _pad_tokens(x, axis: int):
    T = x.shape[axis]
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, TOKEN_ROWS - T)
    return jnp.pad(x, pad) if T != TOKEN_ROWS else x


def gate_up(x: Float[Array, "T L"], w1: Float[Array, "E L F"], w3: Float[Array, "E L F"], *, activation: str,
            situ_beta: float = 4.0, situ_linear_beta: float = 25.0, tiles: TmaTiles = DEFAULT,
            interpret: bool = False) -> Float[Array, "E Tp F"]:
    """``a_e = act(round(x·W1_e), round(x·W3_e))`` for every expert, ``[E, Tp, F]`` (rows past T: zero
    tokens' activations, never read by the combine)."""
    T, L = x.shape
    E, _, F = w1.shape
    check_widths(T, L, F, tiles, "gate_up")
    dt = x.dtype

    def epilogue(accs):
        g, u = (acc[...].astype(dt).astype(jnp.float32) for acc in accs)
        return gated_activation(g, u, activation, situ_beta, situ_linear_beta)

    body = functools.partial(_body, tiles=tiles, epilogue=epilogue, shared_lhs=True)
    return persistent_kernel(body, jax.ShapeDtypeStruct((E, TOKEN_ROWS, F), dt), interpret=interpret,
                             name="moe_decode_dense_tma_gate_up")(_pad_tokens(x, 0), w1, w3)


def down(a: Float[Array, "E Tp F"], w2: Float[Array, "E F L"], *, tiles: TmaTiles = DEFAULT,
         interpret: bool = False) -> Float[Array, "E Tp L"]:
    """``y_e = round(a_e·W2_e)`` for every expert, ``[E, Tp, L]``."""
    E, Tp, F = a.shape
    L = w2.shape[2]
    check_widths(Tp, F, L, tiles, "down")
    body = functools.partial(_body, tiles=tiles, epilogue=lambda accs: accs[0][...], shared_lhs=False)
    return persistent_kernel(body, jax.ShapeDtypeStruct((E, Tp, L), a.dtype), interpret=interpret,
                             name="moe_decode_dense_tma_down")(a, w2)


def expert_outputs(x: Float[Array, "T L"], w1, w3, w2, *, activation: str, situ_beta: float = 4.0,
                   situ_linear_beta: float = 25.0, tiles: TmaTiles = DEFAULT,
                   interpret: bool = False) -> Float[Array, "E T L"]:
    """Every expert's output on every token, ``[E, T, L]`` (``kernel_gpu_decode_dense.expert_outputs``)."""
    a = gate_up(x, w1, w3, activation=activation, situ_beta=situ_beta, situ_linear_beta=situ_linear_beta,
                tiles=tiles, interpret=interpret)
    return down(a, w2, tiles=tiles, interpret=interpret)[:, :x.shape[0]]
