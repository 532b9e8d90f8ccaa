"""KDA's short convs on the GPU: ``short_convs``' forward as one Pallas-Triton pass, its backward as one
pass to the pre-activation gradient ``dz`` and the transposed conv in XLA.

The XLA formulation (:func:`pallas_kernels.kda.conv.short_convs`, the reference beside this file)
runs in stages fenced by ``optimization_barrier`` because XLA's multi-output reductions were slow,
so each stage re-reads the inputs and the backward writes the fp32 ``dz`` between stages: the
whole q/k/v op took 1.46 ms fwd+bwd at B 8, T 4096, C 1024 on the H200, against ~0.5 ms for the
bytes a single pass must move (stop 36, ``bench_kda_conv.py``). Here program ``(i, c)`` owns rows
``i·BT ... i·BT+BT-1`` of the flattened ``[B·T, C]`` tensor and channels ``c·BC ...`` (one head of
the L2 norm when it has one, so the per-head sums stay inside the program) and:

- forward: ``z = Σ_j w[:, j] x[t-(W-1)+j]`` over the taps inside the document, ``s = z·σ(z)``, the
  per-head ``inv = 1/sqrt(Σ s² + eps)`` when normalised, ``y = s·inv``; writes y and inv.
- backward (:func:`conv_dz`): recomputes ``z`` at the block's rows, writes ``dz = SiLU'(z)·(inv·dy −
  s·inv³·Σ(dy·s))`` in fp32 and the block's partial ``Σ_t x[t-(W-1)+j] dz[t]`` per tap (XLA sums
  the partials); the caller forms ``dx = Σ_j w[:, j] dz[u+W-1-j]`` (a bandwidth-bound XLA fusion).

History on the H200: stop 37's backward was one pass that also formed ``dx``, recomputing ``z`` and
``dz`` at the block's rows shifted by ``0 … W-1`` (each row's ``dz`` four times). Stop 40 (q, k, v,
``.stage_dev``-style A/B in one process, bf16): that pass 2.938 ms, this ``dz`` pass plus the XLA
``dx`` 2.786 ms (16 rows × 4 warps) and **2.710 ms (16 × 2, the default)** at K3's B 1, T 8192,
C 12288; 1.003 / 0.978 / 0.939 ms at B 8, T 4096, C 1024 (stop 37's forward sweep also favoured
16 × 2: 0.532 against 0.581 ms at K3). With packed documents (~300 tokens) fwd+bwd 3.659 against
5.495 ms for the XLA stages at K3 and 1.289 against 2.085 ms at B 8, T 4096, C 1024, so
``short_convs`` takes these kernels with documents too. A row block whose rows (and the W-1 after
them) hold no document start skips the per-tap masks (``mask_operands``' flag, one branch per
program): with documents of a few hundred tokens nearly every block.

Shifted rows are gathered with row-index vectors (clamped at 0 and masked), which the CPU
interpreter also runs. Rounding: every sum in fp32 as the reference, σ from each compiler's own
logistic; the weight gradient's sum over rows is split into blocks (fp32 summation order).
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
    num_warps: int = 2


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
    if W - 1 > tiles.block_t:
        raise ValueError(f"tiles.block_t={tiles.block_t} must be >= W-1 = {W - 1}")
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


def _masked_where_needed(body, keep_ref, clean_ref) -> None:
    """``body(keep_ref)`` in a block whose rows (and the W-1 after them) hold a document start, else
    ``body(None)``: most blocks of packed documents have none, and the per-tap masks cost more than
    the bytes the kernels save (see the module docstring)."""
    if keep_ref is None:
        body(None)
        return
    clean = clean_ref[pl.program_id(0)] != 0
    pl.when(clean)(lambda: body(None))
    pl.when(jnp.logical_not(clean))(lambda: body(keep_ref))


def _fwd_kernel(x_ref, w_ref, *refs, T: int, BT: int, BC: int, grouped: bool, has_keep: bool, eps: float):
    keep_ref, clean_ref = refs[:2] if has_keep else (None, None)
    y_ref = refs[2 * has_keep]
    inv_ref = refs[2 * has_keep + 1] if grouped else None
    rows, t, cols, w = _program(x_ref, w_ref, T, BT, BC)

    def body(keep_ref):
        xd = {d: _tile(x_ref, rows, t, cols, d, T) for d in range(1 - len(w), 1)}
        z = _pre_activation(xd, w, keep_ref, rows, 0)
        s = z * jax.nn.sigmoid(z)
        if grouped:
            inv = jax.lax.rsqrt(jnp.sum(jnp.square(s), axis=1) + eps)
            inv_ref[...] = inv
            s = s * inv[:, None]
        y_ref[...] = s.astype(y_ref.dtype)

    _masked_where_needed(body, keep_ref, clean_ref)


def _dz_kernel(x_ref, w_ref, dy_ref, *refs, T: int, BT: int, BC: int, grouped: bool, has_keep: bool):
    keep_ref, clean_ref = refs[:2] if has_keep else (None, None)
    inv_ref = refs[2 * has_keep] if grouped else None
    dz_ref, dw_ref = refs[2 * has_keep + grouped], refs[2 * has_keep + grouped + 1]
    rows, t, cols, w = _program(x_ref, w_ref, T, BT, BC)
    W = len(w)

    def body(keep_ref):
        xd = {d: _tile(x_ref, rows, t, cols, d, T) for d in range(1 - W, 1)}
        z = _pre_activation(xd, w, keep_ref, rows, 0)
        sig = jax.nn.sigmoid(z)
        dy = dy_ref[...].astype(jnp.float32)
        if grouped:  # d(s·inv)/ds: inv·dy − s·inv³·Σ(dy·s)
            inv = inv_ref[...]
            dot = jnp.sum(dy * z * sig, axis=1)
            dy = dy * inv[:, None] - (z * sig) * (dot * inv**3)[:, None]
        dz = dy * sig * (1.0 + z * (1.0 - sig))
        dz_ref[...] = dz
        for j in range(W):  # the block's share of dw[:, j] = Σ_t x[t-(W-1)+j] dz[t] over same-document taps
            term = xd[j - (W - 1)] * dz
            if keep_ref is not None and j < W - 1:
                term = jnp.where(_keep_rows(keep_ref, rows, 0, j), term, 0.0)
            dw_ref[j, :] = jnp.sum(term, axis=0)

    _masked_where_needed(body, keep_ref, clean_ref)


def mask_operands(keep, block_t: int) -> list:
    """``[keep [B·T, W-1] int8, clean [B·T/block_t] int32]``: the document mask, and per row block
    whether every tap of its rows and of the W-1 rows after it (whose ``dz`` its ``dx`` reads) stays
    in its document, so the block needs no mask. ``[]`` without a mask."""
    if keep is None:
        return []
    B, T, Wm1 = keep.shape
    rows_ok = jnp.all(keep.reshape(B * T, Wm1), axis=1)
    nb = B * T // block_t
    ext = jnp.concatenate([rows_ok, jnp.ones((block_t,), bool)]).reshape(nb + 1, block_t)
    clean = jnp.all(ext[:nb], axis=1) & jnp.all(ext[1:, :Wm1], axis=1)
    return [keep.reshape(B * T, Wm1).astype(jnp.int8), clean.astype(jnp.int32)]


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
    operands = [x2, weight] + mask_operands(keep, BT)
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


@functools.partial(jax.jit, static_argnames=("tiles", "interpret"))
def conv_dz(x: Float[Array, "B T C"], weight: Float[Array, "C W"], keep, inv, dy: Float[Array, "B T C"], *,
            tiles: ConvTiles = ConvTiles(), interpret: bool = False):
    """``(dz [B, T, C] fp32, dw [C, W] fp32)`` for the cotangent ``dy`` of :func:`conv_forward`'s output
    (``inv`` its saved per-head inverse norms, or None without the norm): ``dz`` the gradient of the
    conv's pre-activation, from which the caller forms ``dx`` (the transposed conv)."""
    group = None if inv is None else x.shape[2] // inv.shape[2]
    check_inputs(x, weight, keep, group, tiles)
    if dy.shape != x.shape:
        raise ValueError(f"dy must have x's shape {x.shape}, got {dy.shape}")
    B, T, C = x.shape
    W, BT, BC = weight.shape[1], tiles.block_t, tiles.block_c
    whole, block = _specs(tiles)
    operands = [x.reshape(B * T, C), weight, dy.reshape(B * T, C)] + mask_operands(keep, BT)
    in_specs = [whole((B * T, C)), whole(weight.shape), block]
    in_specs += [whole(a.shape) for a in operands[3:]]
    if inv is not None:
        operands.append(inv.reshape(B * T, C // BC))
        in_specs.append(pl.BlockSpec((BT, None), lambda i, c: (i, c)))
    nb = B * T // BT
    dz, dw = pl.pallas_call(
        functools.partial(_dz_kernel, T=T, BT=BT, BC=BC, grouped=inv is not None, has_keep=keep is not None),
        grid=(nb, C // BC),
        in_specs=in_specs,
        out_specs=[block, pl.BlockSpec((None, W, BC), lambda i, c: (i, 0, c))],
        out_shape=[jax.ShapeDtypeStruct((B * T, C), jnp.float32), jax.ShapeDtypeStruct((nb, W, C), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=interpret, name="kda_short_conv_dz",
    )(*operands)
    return dz.reshape(B, T, C), jnp.sum(dw, axis=0).T


__all__ = ["ConvTiles", "accepts", "check_inputs", "conv_dz", "conv_forward", "mask_operands"]
