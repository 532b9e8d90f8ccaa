"""The gated activations (SiTU-GLU, SwiGLU) and their backward as Pallas-Triton elementwise passes.

XLA's fusions of these activations are bound by arithmetic, not bytes, on the H200: each ``tanh``
is a rational polynomial with a division, the sigmoid an exponential and an IEEE division, and
``u / β2`` another division, so the K3 routed experts' activation (``[131072, 3072]`` bf16 at 8 K
tokens) took 1.24 ms forward and 1.86 ms backward in the MLA layer's profile (stop 45), where its
bytes alone (2.4 and 4.0 GB) need ~0.7 and ~1.2 ms. Here every transcendental comes from one
hardware exponential (``ex2``) and one approximate reciprocal (``rcp.approx``, inline PTX) per
argument:

- ``tanh x = sign(x)·(1 − e)/(1 + e)`` and ``sech² x = 4e/(1 + e)²`` with ``e = exp(−2|x|)``; below
  ``|x| < 2⁻⁷`` the series ``x(1 − x²/3 + 2x⁴/15)`` (no cancellation in ``1 − e``);
- ``σ(x) = 1/(1 + z)`` or ``z/(1 + z)`` and ``σ'(x) = z/(1 + z)²`` with ``z = exp(−|x|)`` (no overflow
  on either side, no ``1 − σ`` cancellation).

On the H200 at that shape (one-process A/B, RESULTS.md stop 45; ``benchmarks/bench_activation.py``
repeats it): forward 0.858 ms and backward 1.123 ms against XLA's 1.170 and 1.700 (an XLA fusion
moving the same bytes with one multiply each: 0.594 and 1.232 ms).

Every value is fp32 (SPEC §10) and rounded once to the output dtype; against the float64 reference
the fp32 results are within ~2e-6 relative (``tests/pallas_kernels/moe/test_activation_gpu.py``),
far below the bf16 outputs' rounding. The pure-JAX reference beside this file is
:mod:`pallas_kernels.moe.activations` (what every other target runs).

Operands are ``[M, F]`` row views tiled ``(block_rows, block_cols)``; the gate and up operands may
be two arrays or the two halves of one packed ``[M, 2F]`` product (the same array passed twice,
its column blocks offset by ``F``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

LOG2E = math.log2(math.e)
SMALL = 2.0**-7  # below it tanh takes its series: 1 - e would cancel


@dataclasses.dataclass(frozen=True)
class ActTiles:
    """``block_rows`` × ``block_cols`` elements per program (powers of two), ``num_warps`` per program."""

    block_rows: int = 2
    block_cols: int = 1024
    num_warps: int = 4

    def fits(self, rows: int, cols: int) -> bool:
        return rows % self.block_rows == 0 and cols % self.block_cols == 0


PROGRAM_ELEMENTS = 2048  # per program; H200 sweep (RESULTS.md, stop 45): 2 × 1024 with 4 warps won


def tiles_for(rows: int, cols: int) -> ActTiles | None:
    """Tiles of ``PROGRAM_ELEMENTS`` for ``[rows, cols]`` (columns the largest power of two up to 1024
    dividing ``cols``, at least 128), or None when the shape does not tile."""
    block_cols = min(1024, cols & -cols) if cols > 0 else 0
    if block_cols < 128:
        return None
    tiles = ActTiles(PROGRAM_ELEMENTS // block_cols, block_cols)
    return tiles if tiles.fits(rows, cols) else None


def _rcp(x, fast: bool):
    """``1/x`` for ``x >= 1`` (every use here): ``rcp.approx`` (relative error < 2⁻²²) on the GPU,
    a division in the interpreter."""
    if not fast:
        return 1.0 / x
    [r] = plgpu.elementwise_inline_asm("rcp.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
                                       result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])
    return r


def _neg_exp(x):
    """``exp(−|x|)`` (one ``ex2``)."""
    return jnp.exp2(jnp.abs(x) * -LOG2E)


def _tanh(x, e, r):
    """``tanh x`` from ``e = exp(−2|x|)`` and ``r = 1/(1 + e)``; the series below ``SMALL``."""
    ax, x2 = jnp.abs(x), x * x
    t = jnp.where(ax < SMALL, ax * (1.0 - x2 * (1.0 / 3.0) * (1.0 - x2 * 0.4)), (1.0 - e) * r)
    return jnp.where(x < 0, -t, t)


def _tanh_sech2(x, fast: bool):
    """``(tanh x, sech² x)`` from one exponential and one reciprocal."""
    e = _neg_exp(2.0 * x)
    r = _rcp(1.0 + e, fast)
    return _tanh(x, e, r), 4.0 * e * r * r


def _sigmoid_slope(x, fast: bool):
    """``(σ(x), σ'(x))`` from one exponential and one reciprocal."""
    z = _neg_exp(x)
    s = _rcp(1.0 + z, fast)
    return jnp.where(x >= 0, s, z * s), z * s * s


def _situ(g, u, beta1: float, beta2: float, fast: bool, partials: bool):
    """SiTU-GLU ``β1·tanh(g/β1)·σ(g) · β2·tanh(u/β2)``. One reciprocal per term: one reciprocal of the
    three terms' product split back by multiplications ran 0.77× XLA's forward at K3's routed shape
    (0.923 / 1.195 ms), this form 0.73× (0.858 / 1.170 ms, another call; RESULTS.md, stop 45)."""
    (t1, s1), (sig, dsig), (t2, s2) = _tanh_sech2(g * (1.0 / beta1), fast), _sigmoid_slope(g, fast), \
        _tanh_sech2(u * (1.0 / beta2), fast)
    gate, up = beta1 * t1 * sig, beta2 * t2
    if not partials:
        return gate * up
    return gate * up, up * (s1 * sig + beta1 * t1 * dsig), gate * s2


def _swiglu(g, u, fast: bool, partials: bool):
    sig, dsig = _sigmoid_slope(g, fast)
    if not partials:
        return g * sig * u
    return g * sig * u, u * (sig + g * dsig), g * sig


def value_and_partials(g, u, activation: str, beta1: float, beta2: float, fast: bool, partials: bool = True):
    """``a`` (``partials=False``) or ``(a, ∂a/∂g, ∂a/∂u)`` of fp32 tiles."""
    if activation == "situ":
        return _situ(g, u, beta1, beta2, fast, partials)
    if activation == "swiglu":
        return _swiglu(g, u, fast, partials)
    raise ValueError(f"activation must be 'situ' or 'swiglu', got {activation!r}")


def _fwd_kernel(g_ref, u_ref, a_ref, *, act):
    a = act(g_ref[...].astype(jnp.float32), u_ref[...].astype(jnp.float32), partials=False)
    a_ref[...] = a.astype(a_ref.dtype)


def _bwd_kernel(g_ref, u_ref, da_ref, dg_ref, du_ref, *, act):
    _, d_g, d_u = act(g_ref[...].astype(jnp.float32), u_ref[...].astype(jnp.float32), partials=True)
    da = da_ref[...].astype(jnp.float32)
    dg_ref[...] = (da * d_g).astype(dg_ref.dtype)
    du_ref[...] = (da * d_u).astype(du_ref.dtype)


def _partials_kernel(g_ref, u_ref, a_ref, dg_ref, du_ref, *, act):
    a, d_g, d_u = act(g_ref[...].astype(jnp.float32), u_ref[...].astype(jnp.float32), partials=True)
    a_ref[...] = a.astype(a_ref.dtype)
    dg_ref[...] = d_g.astype(dg_ref.dtype)
    du_ref[...] = d_u.astype(du_ref.dtype)


def _call(kernel, operands, outs, *, cols: int, packed: bool, activation, beta1, beta2, tiles, interpret, name):
    """Run ``kernel`` over ``[M, cols]`` tiles: operands ``(g, u, *rest)`` (``packed``: ``g is u`` holds
    ``[g | u]`` and u's column blocks start ``cols`` further), outputs ``[M, cols]`` of ``outs``' dtypes."""
    g = operands[0]
    rows = g.shape[0]
    tiles = tiles or tiles_for(rows, cols)
    if tiles is None or not tiles.fits(rows, cols):
        raise ValueError(f"g: [rows, cols] = [{rows}, {cols}] must tile by {tiles or 'ActTiles'} (tiles_for: cols with "
                         f"a power-of-two factor >= 128, rows a multiple of {PROGRAM_ELEMENTS} / that factor)")
    br, bc = tiles.block_rows, tiles.block_cols
    shift = cols // bc if packed else 0
    spec = pl.BlockSpec((br, bc), lambda i, j: (i, j))
    up = pl.BlockSpec((br, bc), lambda i, j: (i, j + shift))
    act = functools.partial(value_and_partials, activation=activation, beta1=beta1, beta2=beta2, fast=not interpret)
    return pl.pallas_call(
        functools.partial(kernel, act=act), grid=(rows // br, cols // bc),
        in_specs=[spec, up] + [spec] * (len(operands) - 2), out_specs=[spec] * len(outs),
        out_shape=[jax.ShapeDtypeStruct((rows, cols), d) for d in outs],
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=interpret, name=name,
    )(*operands)


def activation_forward(g, u, *, activation: str, beta1: float, beta2: float, out_dtype, cols: int | None = None,
                       tiles: ActTiles | None = None, interpret: bool = False):
    """``a [M, F]`` in ``out_dtype``; ``u is g`` with ``cols = F`` reads the halves of ``[g | u]``."""
    packed = u is g
    (a,) = _call(_fwd_kernel, (g, u), [out_dtype], cols=cols or g.shape[1], packed=packed, activation=activation,
                 beta1=beta1, beta2=beta2, tiles=tiles, interpret=interpret, name="gated_act_fwd")
    return a


def activation_backward(g, u, da, *, activation: str, beta1: float, beta2: float, tiles: ActTiles | None = None,
                        interpret: bool = False):
    """``(da·∂a/∂g, da·∂a/∂u)`` ``[M, F]`` in ``g.dtype``, recomputing the partials from ``g``, ``u``."""
    return _call(_bwd_kernel, (g, u, da), [g.dtype, g.dtype], cols=g.shape[1], packed=False,
                 activation=activation, beta1=beta1, beta2=beta2, tiles=tiles, interpret=interpret,
                 name="gated_act_bwd")


def activation_with_partials(gu, *, activation: str, beta1: float, beta2: float, out_dtype,
                             tiles: ActTiles | None = None, interpret: bool = False):
    """``(a, ∂a/∂g, ∂a/∂u)`` of the packed ``[M, 2F]`` product: ``a`` in ``out_dtype``, the partials
    in ``gu.dtype`` (``packed_gated_activation``'s stored derivatives)."""
    cols = gu.shape[1] // 2
    return _call(_partials_kernel, (gu, gu), [out_dtype, gu.dtype, gu.dtype], cols=cols, packed=True,
                 activation=activation, beta1=beta1, beta2=beta2, tiles=tiles, interpret=interpret,
                 name="gated_act_partials")
