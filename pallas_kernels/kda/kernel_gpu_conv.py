"""KDA's short convs on the GPU: ``short_convs``' forward as one Pallas-Triton pass per tensor.

The XLA formulation (:func:`pallas_kernels.kda.conv.short_convs`, the reference beside this file)
runs the forward in two stages fenced by ``optimization_barrier`` (per-head sums of squares, then the
outputs, the conv computed twice) because XLA's multi-output reductions were slow. Here program
``(i, c)`` owns rows ``i·BT ... i·BT+BT-1`` of the flattened ``[B·T, C]`` tensor and channels
``c·BC ...`` (one head of the L2 norm when it has one, so the per-head sums stay inside the program):
``z = Σ_j w[:, j] x[t-(W-1)+j]`` over the taps inside the document, ``s = z·σ(z)``, the per-head
``inv = 1/sqrt(Σ s² + eps)`` when normalised, ``y = s·inv``; it writes y and inv (the backward's
residual). q, k and v: 0.218 against 0.449 ms at B 8, T 4096, C 1024 on the H200 (stop 37).

A backward kernel of the same design (recomputing ``z`` at the W row shifts that ``dx`` needs) was
timed and deleted: fwd+bwd 1.20 against 1.47 ms without packed documents but 1.62 against 1.54 with
them, and its backward alone 2.95 against 2.53 ms at K3's width (benchmarks/RESULTS.md "Stop 37");
the backward stays on the XLA stages.

Shifted rows are gathered with row-index vectors (clamped, and masked where they leave the
sequence), which the CPU interpreter also runs. Rounding: sums in fp32 in the reference's tap order;
σ from each compiler's own logistic.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float

from pallas_kernels.triton_blocks import is_block_dim


@dataclasses.dataclass(frozen=True)
class ConvTiles:
    """``block_t``: rows per program; ``block_c``: channels per program (the L2 group when there
    is one); ``num_warps``: Triton warps per program."""

    block_t: int = 16
    block_c: int = 128
    num_warps: int = 4


def check_inputs(x, weight, keep, group: int | None, tiles: ConvTiles = ConvTiles()) -> None:
    """Raise ``ValueError`` naming the argument when the kernels cannot take these inputs."""
    if x.ndim != 3:
        raise ValueError(f"x must be [B, T, C], got shape {x.shape}")
    B, T, C = x.shape
    if weight.ndim != 2 or weight.shape[0] != C:
        raise ValueError(f"weight must be [C, W] = [{C}, W], got {weight.shape}")
    W = weight.shape[1]
    if W & (W - 1):
        raise ValueError(f"the conv kernels need a power-of-two width W (weight.shape[1]), got {W}")
    if keep is not None and keep.shape != (B, T, W - 1):
        raise ValueError(f"keep must be [B, T, W-1] = {(B, T, W - 1)}, got {keep.shape}")
    if not (tiles.block_t > 0 and tiles.block_t & (tiles.block_t - 1) == 0 and T % tiles.block_t == 0):
        raise ValueError(f"tiles.block_t={tiles.block_t} must be a power of two dividing T={T}")
    if not (is_block_dim(tiles.block_c) and C % tiles.block_c == 0):
        raise ValueError(f"tiles.block_c={tiles.block_c} must be a power of two >= 16 dividing C={C}")
    if group is not None and group != tiles.block_c:
        raise ValueError(f"the L2 group ({group} channels) must equal tiles.block_c={tiles.block_c}")
    if any(a is not None and jnp.dtype(a.dtype) == jnp.float64 for a in (x, weight)):
        raise ValueError("the conv kernels take no float64 input (Triton); use implementation='xla'")


def accepts(x, weight, keep, group: int | None, tiles: ConvTiles = ConvTiles()) -> bool:
    """Whether :func:`check_inputs` takes these inputs (what ``implementation=None`` asks)."""
    try:
        check_inputs(x, weight, keep, group, tiles)
    except ValueError:
        return False
    return True


def _tile(ref, rows, t, cols, d: int, T: int):
    """``ref``'s fp32 ``[BT, BC]`` tile at ``rows + d``: zero where ``t + d`` leaves the sequence
    (the zero history, the next sequence). Row indices are clamped so that the CPU interpreter's
    gather stays in bounds; the GPU load is masked instead."""
    ok = (t + d >= 0) & (t + d < T)
    idx = (jnp.clip(rows + d, 0, ref.shape[0] - 1)[:, None], cols[None, :])
    mask = jnp.broadcast_to(ok[:, None], (rows.shape[0], cols.shape[0]))
    return plgpu.load(ref.at[idx], mask=mask, other=0).astype(jnp.float32)


def _keep_rows(keep_ref, rows, shift: int, j: int):
    """``keep[rows + shift, j]`` as a ``[BT, 1]`` bool column."""
    return keep_ref[jnp.minimum(rows + shift, keep_ref.shape[0] - 1), j][:, None] != 0


def _pre_activation(xd: dict, w: list, keep_ref, rows, shift: int):
    """``z`` at rows ``rows + shift`` from the x tiles by row offset ``xd``: the taps summed in tap
    order, the packed-document mask ``keep`` applied per tap."""
    W = len(w)
    z = None
    for j in range(W):
        term = xd[shift - (W - 1) + j] * w[j]
        if keep_ref is not None and j < W - 1:
            term = jnp.where(_keep_rows(keep_ref, rows, shift, j), term, 0.0)
        z = term if z is None else z + term
    return z


def _program(x_ref, w_ref, T: int, BT: int, BC: int):
    """``(rows, t, cols, w)``: the program's flat rows, their time index, its channels, the taps."""
    i, c = pl.program_id(0), pl.program_id(1)
    rows = i * BT + jnp.arange(BT)
    t = (i * BT) % T + jnp.arange(BT)
    cols = c * BC + jnp.arange(BC)
    return rows, t, cols, [w_ref[cols, j].astype(jnp.float32)[None, :] for j in range(w_ref.shape[1])]


def _fwd_kernel(x_ref, w_ref, *refs, T: int, BT: int, BC: int, grouped: bool, has_keep: bool, eps: float):
    keep_ref = refs[0] if has_keep else None
    y_ref, inv_ref = refs[has_keep], (refs[has_keep + 1] if grouped else None)
    rows, t, cols, w = _program(x_ref, w_ref, T, BT, BC)
    xd = {d: _tile(x_ref, rows, t, cols, d, T) for d in range(1 - len(w), 1)}
    z = _pre_activation(xd, w, keep_ref, rows, 0)
    s = z * jax.nn.sigmoid(z)
    if grouped:
        inv = jax.lax.rsqrt(jnp.sum(jnp.square(s), axis=1) + eps)
        inv_ref[...] = inv
        s = s * inv[:, None]
    y_ref[...] = s.astype(y_ref.dtype)


def _specs(tiles):
    """The whole-array spec (row gathers read any row) and the program's ``[BT, BC]`` block."""
    whole = lambda shape: pl.BlockSpec(shape, lambda i, c: (0,) * len(shape))
    return whole, pl.BlockSpec((tiles.block_t, tiles.block_c), lambda i, c: (i, c))


@functools.partial(jax.jit, static_argnames=("group", "eps", "out_dtype", "tiles", "interpret"))
def conv_forward(x: Float[Array, "B T C"], weight: Float[Array, "C W"], keep, *, group: int | None, eps: float,
                 out_dtype, tiles: ConvTiles = ConvTiles(), interpret: bool = False):
    """``(y [B, T, C] in out_dtype, inv [B, T, C/group, 1] fp32 or None)``: SiLU of the conv, each head
    scaled to unit norm when ``group`` is given (``short_convs``' forward for one tensor)."""
    check_inputs(x, weight, keep, group, tiles)
    B, T, C = x.shape
    W, BT, BC = weight.shape[1], tiles.block_t, tiles.block_c
    whole, block = _specs(tiles)
    x2 = x.reshape(B * T, C)
    operands = [x2, weight] + ([keep.reshape(B * T, W - 1).astype(jnp.int8)] if keep is not None else [])
    out_shape = [jax.ShapeDtypeStruct((B * T, C), out_dtype)]
    out_specs = [block]
    if group is not None:
        out_shape.append(jax.ShapeDtypeStruct((B * T, C // BC), jnp.float32))
        out_specs.append(pl.BlockSpec((BT, None), lambda i, c: (i, c)))
    outs = pl.pallas_call(
        functools.partial(_fwd_kernel, T=T, BT=BT, BC=BC, grouped=group is not None,
                          has_keep=keep is not None, eps=eps),
        grid=(B * T // BT, C // BC),
        in_specs=[whole(a.shape) for a in operands], out_specs=out_specs, out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=interpret, name="kda_short_conv_fwd",
    )(*operands)
    inv = outs[1].reshape(B, T, C // BC, 1) if group is not None else None
    return outs[0].reshape(B, T, C), inv


__all__ = ["ConvTiles", "accepts", "check_inputs", "conv_forward"]
