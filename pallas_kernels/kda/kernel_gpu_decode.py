"""KDA decode on the GPU: the delta rule over a few new tokens, the state read and written once.

XLA runs :func:`pallas_kernels.kda.reference.naive_recurrent_kda`'s step as separate passes over the
``[B, H, K, V]`` fp32 state (the decay and ``kᵀS``, the rank-1 update, ``qᵀS``) plus copies that move
K minor for the reductions; at batch 64 of ``small()`` the states are 302 MB a step, read several
times. Every column of a state is independent given the token's q, k, g and β
(``err_v = v_v − Σ_k k_k S_kv``), so one program owns a ``[K, block_v]`` slice of one (b, h) state,
walks the ``T`` new tokens in registers and writes the slice back in place
(``input_output_aliases``): one read and one write of the state per call, one kernel per layer.

Per token, in the reference's order: ``S ← S·exp(g)``, ``err = v − kᵀS``, ``S ← S + (βk) errᵀ``,
``o = (scale·q)ᵀS``. A Pallas-Triton kernel (one program per (b, h, V block)); ``interpret=True`` runs
it in the CPU interpreter (the default suite's test).

Below ``MIN_STATES`` the layer's XLA step is three fusions on the decode step's longest chain (the convs,
norms and gates with ``kᵀS``; ``qᵀS``; the state update), each one more launch a token waits for.
:func:`fused_step_pallas` is the whole step from the layer's packed input projections
(``reference_decode.fused_step_reference``, the layer's own XLA step bit for bit): each program reads its
head's q and k columns and its V block of v from the packed output, runs the causal depthwise convs over
the cached inputs and the new tokens, SiLU, q and k's L2 norms, β's sigmoid and the decay gate (``f_a ·
W_fb`` of its head in 32-row steps, ``+ dt_bias``, the bounded or softplus gate), makes a ragged row's
tokens past ``num_new`` no-ops, then the delta rule on its state slice, and writes the conv inputs that
continue the row for its columns (in place where a program owns its head's whole V, ``BLOCK_V >= V``: the
other programs of a head read all of its q and k tails; elsewhere to a new buffer, which the decode loop
copies into its state, one copy a layer): one kernel on the chain where XLA runs three (small()'s batch-1 step
224.7 → 197.5 kernels, 120 → 102 chained with the glue kernels, device-less; benchmarks/RESULTS.md,
stop 54). From ``FUSED_PRODUCT_STATES`` states every program re-reading its head's ``W_fb`` costs more
than XLA's matmul, so the layer passes the product ``z`` instead, and the kernel replaces the six around
the unfused one (batch 64: 372.4 → 335.4 kernels; on the H100 39.2 µs against the unfused path's 44.2).
Every input is read before any other work (the state, the windows, the taps, β's logits, the ``f_b``
terms, the bias last): a load placed after a reduction's or a layout conversion's barriers is one more trip
to memory on the step's chain (stop 63: device-less 29 → 41 of the 76 loads before the first barrier at
batch 1, 29 → 41 of 45 at batch 64, on an H100 the batch-1 step 0.651 → 0.632 ms with the matvecs' own
reorder, batch 64 1.622 → 1.595; stop 64: all 76 and all 45, with the MLA query's and the dense combine's
reorders 0.667–0.668 → 0.660–0.663 ms and 1.591–1.597 → 1.576–1.592 in one process). ptxas (sm_90a): 128
registers at one token, 91 with ``z`` given, no spills.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels.moe.validate import passes
from pallas_kernels.triton_blocks import is_block_dim
from pallas_kernels.triton_sums import sums

BLOCK_V = 32  # state columns per program: [128, 32] fp32 is 32 registers a thread at 4 warps
# Below this many (sequence, head) states XLA's path wins: it fuses the whole step, the q/k norms and
# the gates into one kernel, while the kernel needs its inputs materialised (device-less compile of
# small() decode at batch 1, B·H = 8: 354.7 → 370.7 kernels a step for 0.4 MB less written).
MIN_STATES = 64
MAX_FUSED_TOKENS = 4  # the fused step's new tokens a row (unrolled; each holds its q, k, v and z)
# Below this many (sequence, head) states the fused step's programs multiply their head's f_a by W_fb
# themselves; from there XLA's matmul makes z first (H100, bench_kda_decode.py: 8 and 96 states 13.7 /
# 14.2 µs inside against 17.0 / 18.0 with z; 512 states 56.2 against 39.2; RESULTS.md, stop 54).
FUSED_PRODUCT_STATES = 256


def supports(q, k, v, g, beta, state) -> bool:
    """The kernel's inputs: fp32 state, no float64, power-of-two head widths of at least 16."""
    floats = (q, k, v, g, beta, state)
    return (state.dtype == jnp.float32 and all(x.dtype != jnp.float64 for x in floats)
            and is_block_dim(q.shape[-1]) and is_block_dim(v.shape[-1]))


def _delta_rule(S, q, k, v, g, b, scale: float):
    """One token of the gated delta rule on a ``[K, block_v]`` state slice (float32 operands):
    ``(o [block_v], S)``."""
    S = S * jnp.exp(g)[:, None]
    err = v - jnp.sum(k[:, None] * S, axis=0)
    S = S + (b * k)[:, None] * err[None, :]
    return jnp.sum((scale * q)[:, None] * S, axis=0), S


def _kernel(q_ref, k_ref, v_ref, g_ref, b_ref, s_ref, o_ref, s_out_ref, *, scale: float, tokens: int):
    f32 = jnp.float32
    S = s_ref[...].astype(f32)  # [K, block_v]
    for t in range(tokens):  # a few tokens: unrolled, the state stays in registers
        q, k, g = (r[t, :].astype(f32) for r in (q_ref, k_ref, g_ref))
        o, S = _delta_rule(S, q, k, v_ref[t, :].astype(f32), g, b_ref[t].astype(f32), scale)
        o_ref[t, :] = o.astype(o_ref.dtype)
    s_out_ref[...] = S


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def recurrent_step_pallas(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
                          g: Float[Array, "B T H K"], beta: Float[Array, "B T H"], state: Float[Array, "B H K V"],
                          *, scale: float, interpret: bool = False):
    """``(o [B,T,H,V] in v.dtype, new state [B,H,K,V] fp32)`` after the ``T`` tokens.

    ``T`` is padded to a power of two with tokens that change nothing (``g = 0``: no decay;
    ``β = 0``: no update); their outputs are dropped.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    padded = pl.next_power_of_2(T)
    if padded != T:
        pad = lambda x: jnp.pad(x, [(0, 0), (0, padded - T)] + [(0, 0)] * (x.ndim - 2))
        q, k, v, g, beta = map(pad, (q, k, v, g, beta))
    bv = min(BLOCK_V, V)
    heads = pl.BlockSpec((None, padded, None, K), lambda b, h, j: (b, 0, h, 0))
    values = pl.BlockSpec((None, padded, None, bv), lambda b, h, j: (b, 0, h, j))
    rates = pl.BlockSpec((None, padded, None), lambda b, h, j: (b, 0, h))
    states = pl.BlockSpec((None, None, K, bv), lambda b, h, j: (b, h, 0, j))
    o, state = pl.pallas_call(
        functools.partial(_kernel, scale=scale, tokens=T),
        grid=(B, H, V // bv),
        in_specs=[heads, heads, values, heads, rates, states],
        out_specs=[values, states],
        out_shape=[jax.ShapeDtypeStruct((B, padded, H, V), v.dtype), jax.ShapeDtypeStruct(state.shape, jnp.float32)],
        input_output_aliases={5: 1},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="kda_decode_step",
    )(q, k, v, g, beta, state.astype(jnp.float32))
    return o[:, :T], state


def check_fused_inputs(y, tails, conv_weights, decay, dt_bias, a_log, state, num_new, offsets) -> None:
    """Raise ``ValueError`` naming the argument when :func:`fused_step_pallas` cannot take these inputs."""
    if y.ndim != 3 or not 1 <= y.shape[1] <= MAX_FUSED_TOKENS:
        raise ValueError(f"y must be [B, T, N] with 1 <= T <= {MAX_FUSED_TOKENS} new tokens, got {y.shape}")
    B, T, N = y.shape
    if decay.ndim not in (3, 4) or (decay.ndim == 4 and (decay.shape[:2] != (B, T) or decay.dtype != y.dtype)):
        raise ValueError(f"decay must be W_fb [R, H, K] or the product z [B, T, H, K] = [{B}, {T}, H, K] in y's "
                         f"dtype {y.dtype}, got {decay.shape} {decay.dtype}")
    H, K = decay.shape[-2:]
    R = decay.shape[0] if decay.ndim == 3 else K
    if state.shape[:3] != (B, H, K) or state.ndim != 4 or state.dtype != jnp.float32:
        raise ValueError(f"state must be float32 [B, H, K, V] = [{B}, {H}, {K}, V], got {state.shape} {state.dtype}")
    V = state.shape[3]
    if V != K or not (is_block_dim(K) and is_block_dim(R)):
        raise ValueError(f"the fused step takes power-of-two widths >= 16 with V == K (one conv cache for q, k, v): "
                         f"K={K}, V={V}, R={R}")
    if tails.ndim != 4 or tails.shape[:2] != (3, B) or tails.shape[3] != H * K:
        raise ValueError(f"tails must be [3, B, W-1, H·K] = [3, {B}, W-1, {H * K}], got {tails.shape}")
    W = tails.shape[2] + 1
    if len(conv_weights) != 3 or any(w.shape != (W, H, K) for w in conv_weights):
        raise ValueError(f"conv_weights must be q's, k's and v's [W, H, K] = [{W}, {H}, {K}], got "
                         f"{[w.shape for w in conv_weights]}")
    if dt_bias.shape != (H, K) or a_log.shape != (H,) or num_new.shape != (B,):
        raise ValueError(f"dt_bias, a_log, num_new must be [{H}, {K}], [{H}], [{B}], got {dt_bias.shape}, "
                         f"{a_log.shape}, {num_new.shape}")
    widths = (H * K, H * K, H * K, H, R)
    if len(offsets) != 5 or any(at < 0 or at + n > N for at, n in zip(offsets, widths)):
        raise ValueError(f"offsets must be the columns of y (N={N}) where q, k, v, β and f_a start (widths "
                         f"{widths}), got {offsets}")
    if any(x.dtype == jnp.float64 for x in (y, tails, decay, dt_bias, a_log, *conv_weights)):
        raise ValueError("the fused step takes no float64 input (the reference does)")


def fused_accepts(y, tails, conv_weights, decay, dt_bias, a_log, state, num_new, offsets) -> bool:
    """Whether :func:`check_fused_inputs` takes these inputs."""
    return passes(check_fused_inputs, y, tails, conv_weights, decay, dt_bias, a_log, state, num_new, offsets)


def _fused_kernel(n_ref, y_ref, tail_ref, wq_ref, wk_ref, wv_ref, decay_ref, bias_ref, alog_ref, s_ref,
                  o_ref, s_out_ref, tail_out_ref, *, offsets, product: bool, in_place: bool, scale: float, lower_bound,
                  eps: float):
    f32 = jnp.float32
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    T, Wm1 = y_ref.shape[0], tail_ref.shape[1]
    K, bv = decay_ref.shape[-1], s_ref.shape[-1]
    dt = y_ref.dtype
    n = n_ref[b]  # the row's real new tokens
    head = pl.multiple_of(h * K, K)
    first = pl.multiple_of(j * bv, bv)  # this program's state columns within the head: first .. first+bv
    S = s_ref[...].astype(f32)  # read first: its trip from HBM overlaps the prologue

    def window(c, start, width):
        """Channel ``c``'s conv inputs over ``width`` columns of the head from ``start``: the W-1 cached,
        then the T new (float32)."""
        cols = pl.ds(start, width)
        return ([tail_ref[c, i, cols].astype(f32) for i in range(Wm1)]
                + [y_ref[t, pl.ds(offsets[c] + head + start, width)].astype(f32) for t in range(T)])

    def taps(w_ref, cols):
        return [w_ref[i, cols].astype(f32) for i in range(Wm1 + 1)]

    def silu_conv(xs, taps):
        """``SiLU`` of the causal conv of each new token (taps in order, as ``causal_conv1d`` sums)."""
        out = []
        for t in range(T):
            acc = xs[t] * taps[0]
            for i in range(1, Wm1 + 1):
                acc = acc + xs[t + i] * taps[i]
            out.append(acc * jax.nn.sigmoid(acc))
        return out

    # every input is read before any other work: Triton issues a load where the program reads it, and the first
    # layout conversion or reduction puts a barrier before every load after it (one more round trip on the
    # step's chain)
    windows = [window(0, 0, K), window(1, 0, K), window(2, first, bv)]
    # the tails' sources: the windows themselves in place, else this program's columns of q's and k's
    sources = windows if in_place else [window(0, first, bv), window(1, first, bv), windows[2]]
    conv_taps = [taps(wq_ref, pl.ds(0, K)), taps(wk_ref, pl.ds(0, K)), taps(wv_ref, pl.ds(first, bv))]
    logits = [y_ref[t, offsets[3] + h].astype(f32) for t in range(T)]  # beta's
    if product:  # z = f_a · W_fb of head h in R-row steps
        R = decay_ref.shape[0]
        step = min(R, 32)
        fbs = [decay_ref[pl.ds(r, step), :] for r in range(0, R, step)]
        fas = [[y_ref[t, pl.ds(offsets[4] + r, step)] for r in range(0, R, step)] for t in range(T)]
    else:
        zs = [decay_ref[t, :].astype(f32) for t in range(T)]
    # last: Triton converts the bias to the state columns' layout where it reads it (a barrier)
    alog, bias = alog_ref[h].astype(f32), bias_ref[...].astype(f32)
    qks = silu_conv(windows[0], conv_taps[0]) + silu_conv(windows[1], conv_taps[1])
    vs = [x.astype(dt).astype(f32) for x in silu_conv(windows[2], conv_taps[2])]
    rate = jnp.exp(alog)
    if product:  # token-major: token t's R / step partial products, f_b as the layer's product takes it
        terms = [fa.astype(f32)[:, None] * fb.astype(dt).astype(f32) for t in range(T) for fa, fb in zip(fas[t], fbs)]
    squares = sums(*(x * x for x in qks))  # every token's q and k norms in one reduction
    qks = [(x * jax.lax.rsqrt(ss + eps)).astype(dt).astype(f32) for x, ss in zip(qks, squares)]
    qs, ks = qks[:T], qks[T:]
    if product:
        parts = sums(*terms)  # the partial sums in one reduction
        per = R // step
        zs = [functools.reduce(jnp.add, parts[t * per:(t + 1) * per]) for t in range(T)]
        zs = [z.astype(dt).astype(f32) for z in zs]  # the f_b projection's output, rounded as the layer's
    for t in range(T):
        z = zs[t] + bias
        g = -rate * jax.nn.softplus(z) if lower_bound is None else lower_bound * jax.nn.sigmoid(rate * z)
        beta = jax.nn.sigmoid(logits[t])
        real = t < n
        g, beta = jnp.where(real, g, 0.0), jnp.where(real, beta, 0.0)
        o, S = _delta_rule(S, qs[t], ks[t], vs[t], g, beta, scale)
        o_ref[t, :] = o.astype(o_ref.dtype)
    s_out_ref[...] = S
    # the conv inputs that continue the row: window positions n .. n+W-2, this program's columns, from what it
    # read at its start (in place, never from the buffer it is overwriting)
    for c in range(3):
        xs = sources[c]
        for i in range(Wm1):
            pick = xs[0]
            for p in range(1, len(xs)):
                pick = jnp.where(n + i == p, xs[p], pick)
            tail_out_ref[c, i, :] = pick.astype(tail_out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("offsets", "scale", "lower_bound", "eps", "interpret"))
def fused_step_pallas(y: Float[Array, "B T N"], tails: Float[Array, "3 B Wm1 C"], conv_weights: tuple,
                      decay: Float[Array, "R H K"] | Float[Array, "B T H K"], dt_bias: Float[Array, "H K"],
                      a_log: Float[Array, "H"], state: Float[Array, "B H K V"], num_new: Int[Array, "B"], *,
                      offsets: tuple[int, ...], scale: float, lower_bound: float | None, eps: float,
                      interpret: bool = False):
    """``reference_decode.fused_step_reference`` (same arguments, same rounding points) as one kernel:
    ``(o [B, T, H, V] in y.dtype, state [B, H, K, V] float32 (written in place), tails [3, B, W-1, C])``.

    ``decay``: the decay's second factor ``W_fb [R, H, K]`` (each program multiplies its head's ``f_a`` by
    it: no kernel before this one) or the product ``z [B, T, H, K]`` itself (made before, e.g. by XLA's
    matmul at large batches, where every program re-reading its head's ``W_fb`` would cost more)."""
    check_fused_inputs(y, tails, conv_weights, decay, dt_bias, a_log, state, num_new, offsets)
    B, T, N = y.shape
    H, K = decay.shape[-2:]
    product = decay.ndim == 3
    W, V = tails.shape[2] + 1, state.shape[3]
    bv = min(BLOCK_V, V)
    nv = V // bv
    in_place = nv == 1  # the tails aliased: no other program reads the head's q and k tails
    per_head = lambda *lead: pl.BlockSpec((*lead, None, K), lambda b, h, j: (0,) * len(lead) + (h, 0))
    per_row = pl.BlockSpec((None, T, None, K), lambda b, h, j: (b, 0, h, 0))  # z's tokens of one (b, h)
    states = pl.BlockSpec((None, None, K, bv), lambda b, h, j: (b, h, 0, j))
    o, state, tails_out = pl.pallas_call(
        functools.partial(_fused_kernel, offsets=offsets, product=product, in_place=in_place, scale=scale,
                          lower_bound=lower_bound, eps=eps),
        grid=(B, H, nv),
        in_specs=[pl.BlockSpec((B,), lambda b, h, j: (0,)),
                  pl.BlockSpec((None, T, N), lambda b, h, j: (b, 0, 0)),
                  pl.BlockSpec((3, None, W - 1, K), lambda b, h, j: (0, b, 0, h)),
                  per_head(W), per_head(W), per_head(W),
                  per_head(decay.shape[0]) if product else per_row,
                  pl.BlockSpec((None, K), lambda b, h, j: (h, 0)),
                  pl.BlockSpec((H,), lambda b, h, j: (0,)), states],
        out_specs=[pl.BlockSpec((None, T, None, bv), lambda b, h, j: (b, 0, h, j)), states,
                   pl.BlockSpec((3, None, W - 1, bv), lambda b, h, j: (0, b, 0, h * nv + j))],
        out_shape=[jax.ShapeDtypeStruct((B, T, H, V), y.dtype), jax.ShapeDtypeStruct(state.shape, jnp.float32),
                   jax.ShapeDtypeStruct(tails.shape, tails.dtype)],
        input_output_aliases={9: 1, 2: 2} if in_place else {9: 1},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="kda_decode_fused",
    )(num_new.astype(jnp.int32), y, tails, *conv_weights, decay, dt_bias, a_log, state)
    return o, state, tails_out


__all__ = ["BLOCK_V", "FUSED_PRODUCT_STATES", "MAX_FUSED_TOKENS", "MIN_STATES", "check_fused_inputs", "fused_accepts",
           "fused_step_pallas", "recurrent_step_pallas", "supports"]
