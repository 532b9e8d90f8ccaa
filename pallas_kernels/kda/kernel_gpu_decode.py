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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float

from pallas_kernels.triton_blocks import is_block_dim

BLOCK_V = 32  # state columns per program: [128, 32] fp32 is 32 registers a thread at 4 warps
# Below this many (sequence, head) states XLA's path wins: it fuses the whole step, the q/k norms and
# the gates into one kernel, while the kernel needs its inputs materialised (device-less compile of
# small() decode at batch 1, B·H = 8: 354.7 → 370.7 kernels a step for 0.4 MB less written).
MIN_STATES = 64


def supports(q, k, v, g, beta, state) -> bool:
    """The kernel's inputs: fp32 state, no float64, power-of-two head widths of at least 16."""
    floats = (q, k, v, g, beta, state)
    return (state.dtype == jnp.float32 and all(x.dtype != jnp.float64 for x in floats)
            and is_block_dim(q.shape[-1]) and is_block_dim(v.shape[-1]))


def _kernel(q_ref, k_ref, v_ref, g_ref, b_ref, s_ref, o_ref, s_out_ref, *, scale: float, tokens: int):
    f32 = jnp.float32
    S = s_ref[...].astype(f32)  # [K, block_v]
    for t in range(tokens):  # a few tokens: unrolled, the state stays in registers
        q, k, g = (r[t, :].astype(f32) for r in (q_ref, k_ref, g_ref))
        v, b = v_ref[t, :].astype(f32), b_ref[t].astype(f32)
        S = S * jnp.exp(g)[:, None]
        err = v - jnp.sum(k[:, None] * S, axis=0)
        S = S + (b * k)[:, None] * err[None, :]
        o_ref[t, :] = jnp.sum((scale * q)[:, None] * S, axis=0).astype(o_ref.dtype)
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


__all__ = ["BLOCK_V", "MIN_STATES", "recurrent_step_pallas", "supports"]
