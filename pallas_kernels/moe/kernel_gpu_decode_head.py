"""Everything a LatentMoE decode step computes from its input row, in one Pallas-Triton kernel
(``MoEConfig.decode_implementation="pallas-fused"``): the router, ``down_proj`` and the shared experts'
gate and up products with their activation.

At batch 1 XLA compiles these to 7 kernels a layer in ``small()`` (5 for the router, see
``kernel_gpu_route``; one per product, each recomputing the pre-MoE norm and mixing it fuses in). Here
the grid's programs do different work, side by side: for token ``t``,

- program ``(t, 0)`` routes it (``kernel_gpu_route.route_token``: ids and fp32 weights);
- programs ``(t, 1 .. L/block_n)`` each write ``block_n`` columns of ``u = x W_down``;
- the programs after them ``block_n`` columns of the shared experts' ``h = act(x W_gate, x W_up)``.

The products are summed over D in fp32 (``block_d`` rows a step) and rounded to x's dtype, the
activation (``gated_activation``, fp32) rounded to it: the rounding points of the references, the XLA
code this replaces (``MoE._router``, the ``down_proj`` ``Proj``, ``MLP``'s gate / up and
``split_gated_activation``); only fp32 summation orders differ (XLA's batch-1 products may also round
each bf16 product before summing; the kernel keeps them exact, as a GEMM does). ``interpret=True``
runs it in the CPU interpreter.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels.moe import kernel_gpu_route
from pallas_kernels.moe.activations import gated_activation
from pallas_kernels.triton_blocks import is_block_dim


@dataclasses.dataclass(frozen=True)
class HeadTiles:
    """``block_n``: output columns per product program; ``block_d``: rows of every matrix (router
    included) per step over D; ``num_warps``: Triton warps per program; ``num_stages``: Triton's software
    pipelining of those steps (1: none; the router program streams its 256 KB fp32 matrix alone, in
    ``D/block_d`` steps, so it may be the long pole; untimed)."""

    block_n: int = 32  # small(): 1 + 16 + 32 programs; 64 KB of W_down, 128 KB of W_gate / W_up each
    block_d: int = 128
    num_warps: int = 4
    num_stages: int = 1

    @classmethod
    def fitting(cls, D: int, *widths: int) -> "HeadTiles":
        """The defaults, narrowed to D and the products' widths where they are smaller (tiny models)."""
        return cls(block_n=min(cls.block_n, *widths), block_d=min(cls.block_d, D))


def check_inputs(x, w_router, bias, w_down, w_gate, w_up, top_k: int, tiles: HeadTiles) -> None:
    """Raise ``ValueError`` naming the argument when the kernel cannot take these inputs."""
    kernel_gpu_route.check_inputs(x, w_router, bias, top_k, kernel_gpu_route.RouteTiles(block_d=tiles.block_d))
    D = x.shape[1]
    if w_down.ndim != 2 or w_down.shape[0] != D:
        raise ValueError(f"w_down must be [D, L] with D = x.shape[1]={D}, got {w_down.shape}")
    if (w_gate is None) != (w_up is None):
        raise ValueError("w_gate and w_up must be given together (the shared experts) or both be None")
    if w_gate is not None and (w_gate.ndim != 2 or w_gate.shape[0] != D or w_up.shape != w_gate.shape):
        raise ValueError(f"w_gate and w_up must be [D, F] with D={D}, got {w_gate.shape}, {w_up.shape}")
    widths = {"w_down": w_down.shape[1]} | ({"w_gate": w_gate.shape[1]} if w_gate is not None else {})
    for name, n in widths.items():
        if not is_block_dim(tiles.block_n) or n % tiles.block_n:
            raise ValueError(f"tiles.block_n={tiles.block_n} must be a power of two >= 16 dividing {name}'s "
                             f"{n} columns")
    if any(a is not None and jnp.dtype(a.dtype) == jnp.float64 for a in (w_down, w_gate, w_up)):
        raise ValueError("the head kernel takes no float64 input (Triton); use decode_implementation='pallas'")


def _products(x_ref, w_refs, cols, *, block_d: int):
    """``x · W[:, cols]`` for each ``W`` of ``w_refs``, summed over D in fp32 (one pass over x)."""
    f32 = jnp.float32
    D = x_ref.shape[0]

    def step(c, accs):
        rows = pl.ds(pl.multiple_of(c * block_d, block_d), block_d)
        h = x_ref[rows].astype(f32)[:, None]  # [BD, 1]
        return tuple(acc + jnp.sum(h * w[rows, cols].astype(f32), axis=0) for acc, w in zip(accs, w_refs))

    return jax.lax.fori_loop(0, D // block_d, step, tuple(jnp.zeros((cols.size,), f32) for _ in w_refs))


def _kernel(x_ref, wr_ref, b_ref, wd_ref, *refs, shared: bool, n_down: int, block_n: int, block_d: int,
            route: dict, act: dict):
    if shared:
        wg_ref, wu_ref, ids_ref, weights_ref, u_ref, h_ref = refs
    else:
        ids_ref, weights_ref, u_ref = refs
    dt = x_ref.dtype
    p = pl.program_id(1)

    @pl.when(p == 0)
    def _route():
        ids_ref[...], weights_ref[...] = kernel_gpu_route.route_token(x_ref, wr_ref, b_ref, block_d=block_d, **route)

    @pl.when((p >= 1) & (p <= n_down))
    def _down():
        cols = pl.ds(pl.multiple_of((p - 1) * block_n, block_n), block_n)
        (u,) = _products(x_ref, (wd_ref,), cols, block_d=block_d)
        u_ref[cols] = u.astype(u_ref.dtype)

    if shared:
        @pl.when(p > n_down)
        def _shared():
            cols = pl.ds(pl.multiple_of((p - 1 - n_down) * block_n, block_n), block_n)
            g, u = _products(x_ref, (wg_ref, wu_ref), cols, block_d=block_d)
            h_ref[cols] = gated_activation(g.astype(dt), u.astype(dt), **act).astype(h_ref.dtype)


@functools.partial(jax.jit, static_argnames=("top_k", "renormalize", "scaling", "activation", "situ_beta",
                                             "situ_linear_beta", "tiles", "interpret"))
def decode_head_pallas(x: Float[Array, "T D"], w_router: Float[Array, "D E"], bias: Float[Array, "E"],
                       w_down: Float[Array, "D L"], w_gate: Float[Array, "D F"] | None = None,
                       w_up: Float[Array, "D F"] | None = None, *, top_k: int, renormalize: bool, scaling: float,
                       activation: str, situ_beta: float = 4.0, situ_linear_beta: float = 25.0,
                       tiles: HeadTiles | None = None, interpret: bool = False
                       ) -> tuple[Int[Array, "T k"], Float[Array, "T k"], Float[Array, "T L"], Float[Array, "T F"] | None]:
    """``(ids, weights, u, h)``: the router's ``route`` (fp32 weights), ``u = x W_down`` and the shared
    experts' ``h = act(x W_gate, x W_up)`` (None without ``w_gate``), both in x's dtype. ``tiles``: None
    picks ``HeadTiles.fitting`` the shapes."""
    if tiles is None:
        tiles = HeadTiles.fitting(x.shape[1], w_down.shape[1], *(() if w_gate is None else (w_gate.shape[1],)))
    check_inputs(x, w_router, bias, w_down, w_gate, w_up, top_k, tiles)
    T, D = x.shape
    L = w_down.shape[1]
    shared = w_gate is not None
    n_down = L // tiles.block_n
    n_shared = w_gate.shape[1] // tiles.block_n if shared else 0
    weights_in = (w_router, bias, w_down) + ((w_gate, w_up) if shared else ())
    whole = lambda a: pl.BlockSpec(a.shape, lambda t, p: (0,) * a.ndim)
    row = lambda n: pl.BlockSpec((None, n), lambda t, p: (t, 0))
    widths = (top_k, top_k, L) + ((w_gate.shape[1],) if shared else ())
    dtypes = (jnp.int32, jnp.float32, x.dtype) + ((x.dtype,) if shared else ())
    outs = pl.pallas_call(
        functools.partial(_kernel, shared=shared, n_down=n_down, block_n=tiles.block_n, block_d=tiles.block_d,
                          route=dict(top_k=top_k, renormalize=renormalize, scaling=scaling),
                          act=dict(activation=activation, situ_beta=situ_beta, situ_linear_beta=situ_linear_beta)),
        grid=(T, 1 + n_down + n_shared),
        in_specs=[row(D)] + [whole(a) for a in weights_in],
        out_specs=[row(n) for n in widths],
        out_shape=[jax.ShapeDtypeStruct((T, n), d) for n, d in zip(widths, dtypes)],
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret, name="moe_decode_head",
    )(x, *weights_in)
    return tuple(outs) if shared else (*outs, None)


__all__ = ["HeadTiles", "check_inputs", "decode_head_pallas"]
