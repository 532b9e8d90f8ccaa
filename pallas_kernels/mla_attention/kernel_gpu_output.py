"""MLA's decode output in one kernel: the attention's splits merged, ``W_v`` applied and the output gate.

After the decode attention (``kernel_gpu_decode.split_outputs``: per key split, an unnormalised weighted
latent with its row max and sum), XLA runs an MLA layer's output at batch 64 as five kernels on the
step's longest chain: the splits' weights, their merge, ``W_v`` as a split-K batched matmul, its
reduction with the output gate, and a transpose (``benchmarks/decode_kernels.py``). Here one Pallas-Triton
kernel does it for 1 to ``MAX_ROWS`` new tokens. From ``GROUP`` rows program ``(h, g)`` takes head ``h`` of
``GROUP`` token rows, merges their splits (the splits' row maxes first, then one split at a time into a
float32 accumulator), multiplies the merged latent by its head's ``W_v`` on the tensor cores and gates it.
Below ``GROUP`` rows the splits are many (18 at batch 1 over a 1 K cache: as many dependent steps of that
loop), so program ``(h, r)`` takes one row and reads ``SPLIT_CHUNK`` splits at once. At batch 1 XLA fused
the merge, ``W_v`` and the gate with the gate's own 2 MB product into one kernel of 7.3 µs on the chain
(H100, RESULTS.md stop 65); here that product runs beside the attention, off the chain, and ``small()``'s
batch-1 step takes 0.613 → 0.604 ms (H100, stop 66).

Rounding points are the layer's (``k3jax.layers.mla.MLA._attend_cached`` with
``kernel_gpu_decode.cached_attention_pallas``'s merge, then ``gates.sigmoid_gate``; the reference is
:func:`reference_decode.gated_output_reference`): the merge and ``W_v`` in float32 — the merged latent
enters the tensor cores as three bfloat16 parts that sum to it, ``W_v`` is 16-bit, so every product is exact
— the gate in float32, one rounding to the output dtype. Only the
float32 summation order differs. ``interpret=True`` runs the kernel in the CPU interpreter.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float

from pallas_kernels.mla_attention.kernel_gpu_query import MAX_ROWS, bf16_parts, dot_f32
from pallas_kernels.moe.validate import passes
from pallas_kernels.triton_blocks import is_block_dim

GROUP = 16  # token rows a program: one tensor-core row tile
SPLIT_CHUNK = 32  # below GROUP rows: key splits read at once
HOISTED_FLOATS = 1 << 14  # below GROUP rows: latent floats read before the first reduction (128 a thread)
NUM_WARPS = 4


def check_inputs(o, m, l, w_kv_b, gate, *, nope_dim: int) -> None:
    """Raise ``ValueError`` naming the argument when :func:`gated_output` cannot take these inputs."""
    if o.ndim != 4 or m.shape != o.shape[:3] or l.shape != o.shape[:3]:
        raise ValueError(f"o must be [B, n, M, R] and m, l [B, n, M] (split_outputs'), got {o.shape}, {m.shape}, "
                         f"{l.shape}")
    B, _, M, R = o.shape
    if gate.ndim != 4 or gate.shape[0] != B or not 1 <= B * gate.shape[1] <= MAX_ROWS:
        raise ValueError(f"gate must be [B, T, H, dv] = [{B}, T, H, dv] with 1 <= B·T <= {MAX_ROWS}, got "
                         f"{gate.shape}")
    _, T, H, dv = gate.shape
    if w_kv_b.ndim != 3 or w_kv_b.shape[:2] != (R, H) or w_kv_b.shape[2] != nope_dim + dv or T * H > M:
        raise ValueError(f"w_kv_b must be [R, H, nope_dim + dv] = [{R}, {H}, {nope_dim + dv}] with T·H <= M={M}, "
                         f"got {w_kv_b.shape}, T·H = {T * H}")
    if not (is_block_dim(R) and is_block_dim(dv)):
        raise ValueError(f"the output kernel needs R={R} and dv={dv} powers of two >= 16")
    if any(jnp.dtype(x.dtype) != jnp.float32 for x in (o, m, l)):
        raise ValueError(f"o, m, l must be float32 (split_outputs'), got {o.dtype}, {m.dtype}, {l.dtype}")
    if jnp.dtype(w_kv_b.dtype) not in map(jnp.dtype, (jnp.bfloat16, jnp.float16)):
        # float32 W_v in three parts held all nine products' operands: 25 K spilled stores (ptxas, sm_90a)
        raise ValueError(f"w_kv_b must be bfloat16 or float16 (float32 parameters take the layer's XLA path), got "
                         f"{w_kv_b.dtype}")
    if jnp.dtype(gate.dtype) == jnp.float64:
        raise ValueError("the output kernel takes no float64 input (Triton); the layer's XLA path does")


def accepts(o, m, l, w_kv_b, gate, *, nope_dim: int) -> bool:
    """Whether :func:`check_inputs` takes these inputs."""
    return passes(functools.partial(check_inputs, nope_dim=nope_dim), o, m, l, w_kv_b, gate)


def _kernel(o_ref, m_ref, l_ref, wv_ref, gate_ref, out_ref, *, T: int, H: int, M: int, R: int, dv: int, Dkv: int,
            nope: int, splits: int):
    f32 = jnp.float32
    h, g = pl.program_id(0), pl.program_id(1)
    n_rows = gate_ref.shape[0]
    rows = g * GROUP + jnp.arange(GROUP)  # token rows b·T + t
    live = rows < n_rows
    read = jnp.minimum(rows, n_rows - 1)  # padding rows read the last row's (and store nothing)
    b, at = read // T, (read % T) * H + h  # the sequence, and the query row within its splits' M
    w_v = wv_ref[:, pl.ds(pl.multiple_of(h * Dkv + nope, math.gcd(Dkv, nope)), dv)]  # [R, dv]
    gate = gate_ref[read[:, None], (h * dv + jnp.arange(dv))[None, :]].astype(f32)  # [G, dv]
    top = m_ref[b, at]
    for s in range(1, splits):
        top = jnp.maximum(top, m_ref[b, s * M + at])  # finite: every row sees key 0

    def merge(s, carry):
        num, den = carry
        mx = m_ref[b, s * M + at]
        w = jnp.where(mx == -jnp.inf, 0.0, jnp.exp(mx - top))  # a split that saw nothing weighs 0
        part = o_ref[b[:, None], ((s * M + at) * R)[:, None] + jnp.arange(R)[None, :]]  # [G, R]
        return num + part * w[:, None], den + l_ref[b, s * M + at] * w

    num, den = jax.lax.fori_loop(0, splits, merge, (jnp.zeros((GROUP, R), f32), jnp.zeros((GROUP,), f32)))
    latent = num / den[:, None]  # [G, R]: the attention-weighted latent
    o = sum(dot_f32(x, w_v, ((1,), (0,))) for x in bf16_parts(latent))  # [G, dv], W_v applied
    gated = (o * jax.nn.sigmoid(gate)).astype(out_ref.dtype)
    plgpu.store(out_ref.at[rows[:, None], (h * dv + jnp.arange(dv))[None, :]], gated, mask=live[:, None])


def _few_kernel(o_ref, m_ref, l_ref, wv_ref, gate_ref, out_ref, *, T: int, H: int, M: int, R: int, dv: int,
                Dkv: int, nope: int, splits: int):
    """Below ``GROUP`` rows: program ``(h, r)`` takes head ``h`` of token row ``r`` alone and reads its splits
    ``SPLIT_CHUNK`` at a time (the row-group kernel's loop over the splits is one dependent trip to memory a
    split): every split's row max and sum, and the latents of the first ``HOISTED_FLOATS`` worth of chunks,
    before the first reduction; ``W_v`` by the vector units."""
    f32 = jnp.float32
    h, r = pl.program_id(0), pl.program_id(1)
    b, at = r // T, (r % T) * H + h
    w_v = wv_ref[:, pl.ds(pl.multiple_of(h * Dkv + nope, math.gcd(Dkv, nope)), dv)].astype(f32)  # [R, dv]
    gate = gate_ref[r, pl.ds(h * dv, dv)].astype(f32)  # [dv]
    chunks = [c + jnp.arange(SPLIT_CHUNK) for c in range(0, splits, SPLIT_CHUNK)]  # each chunk's splits
    rows = [(s < splits, jnp.minimum(s, splits - 1) * M + at) for s in chunks]  # (a real split, its m / l index)
    latent = lambda i: o_ref[b, rows[i][1][:, None] * R + jnp.arange(R)[None, :]]  # [SPLIT_CHUNK, R]
    hoisted = [latent(i) for i in range(min(len(rows), max(1, HOISTED_FLOATS // (SPLIT_CHUNK * R))))]
    ms = [jnp.where(ok, m_ref[b, at_s], -jnp.inf) for ok, at_s in rows]
    ls = [l_ref[b, at_s] for _, at_s in rows]
    top = functools.reduce(jnp.maximum, [jnp.max(mx) for mx in ms])
    num, den = jnp.zeros((R,), f32), jnp.zeros((), f32)
    for i, (mx, lx) in enumerate(zip(ms, ls)):  # a split that saw nothing (or past the last) weighs 0
        w = jnp.where(mx != -jnp.inf, jnp.exp(mx - top), 0.0)
        part = hoisted[i] if i < len(hoisted) else latent(i)
        num, den = num + jnp.sum(part * w[:, None], axis=0), den + jnp.sum(lx * w)
    o = jnp.sum((num / den)[:, None] * w_v, axis=0)  # [dv], W_v applied
    out_ref[r, pl.ds(h * dv, dv)] = (o * jax.nn.sigmoid(gate)).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("nope_dim", "interpret"))
def gated_output(o: Float[Array, "B n M R"], m: Float[Array, "B n M"], l: Float[Array, "B n M"],
                 w_kv_b: Float[Array, "R H Dkv"], gate: Float[Array, "B T H dv"], *, nope_dim: int,
                 interpret: bool = False) -> Float[Array, "B T H dv"]:
    """``sigmoid_gate((Σ_s o_s w_s / Σ_s l_s w_s) · W_v, gate)`` in ``gate``'s dtype, ``w_s = exp(m_s − max m)``,
    ``W_v = w_kv_b[..., nope_dim:]``: the split outputs of ``kernel_gpu_decode.split_outputs`` for the
    ``T`` new tokens of each of ``B`` sequences, merged, expanded and gated."""
    check_inputs(o, m, l, w_kv_b, gate, nope_dim=nope_dim)
    B, n, M, R = o.shape
    _, T, H, dv = gate.shape
    Dkv = w_kv_b.shape[2]
    # flattened so every load and store is a 2-D tile (free reshapes)
    args = (o.reshape(B, n * M * R), m.reshape(B, n * M), l.reshape(B, n * M), w_kv_b.reshape(R, H * Dkv),
            gate.reshape(B * T, H * dv))
    whole = lambda a: pl.BlockSpec(a.shape, lambda h, g: (0,) * a.ndim)
    out_shape = jax.ShapeDtypeStruct((B * T, H * dv), gate.dtype)
    few = B * T < GROUP
    out = pl.pallas_call(
        functools.partial(_few_kernel if few else _kernel, T=T, H=H, M=M, R=R, dv=dv, Dkv=Dkv, nope=nope_dim,
                          splits=n),
        grid=(H, B * T if few else pl.cdiv(B * T, GROUP)),
        in_specs=[whole(a) for a in args],
        out_specs=whole(out_shape),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret, name="mla_decode_output",
    )(*args)
    return out.reshape(B, T, H, dv)


__all__ = ["GROUP", "accepts", "check_inputs", "gated_output"]
