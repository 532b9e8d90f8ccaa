"""Reference for the fused KDA decode step (``kernel_gpu_decode.fused_step_pallas``): the KDA layer's
decode from its packed input projections, as the layer computes it on XLA (``k3jax.layers.kda``).

From the packed projections ``y [B, T, N]`` (``decode_layout``'s one product of the layer input; the
columns of q, k, v, the β logits and the decay's first factor at ``offsets``):

1. ``q, k, v = SiLU(conv(x))``: each channel's causal depthwise conv over the cached ``W-1`` inputs and
   the ``T`` new ones, in float32; q and k L2-normalised per head; all three rounded to ``y.dtype``;
2. ``β = sigmoid(b)`` in float32;
3. ``g = decay_gate(z + dt_bias)`` with ``z = f_a · W_fb`` in ``y.dtype`` (the layer's ``f_b``
   projection; or ``z`` given), the gate in float32;
4. tokens at or after a row's ``num_new`` are no-ops for the state (``g = 0``, ``β = 0``);
5. the gated delta rule from ``state`` (:func:`naive_recurrent_kda`), and the conv inputs that continue
   each row (:func:`conv_tail`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.kda.conv import causal_conv1d, conv_tail
from pallas_kernels.kda.reference import decay_gate, naive_recurrent_kda


def l2_normalize(x: Float[Array, "*B K"], eps: float) -> Float[Array, "*B K"]:
    """``x / sqrt(Σx² + eps)`` over the last axis (fla's ``l2norm_fwd``; ``k3jax.layers.norm``'s)."""
    return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True) + eps)


def decay_product(y: Float[Array, "B T N"], f_b: Float[Array, "R H K"], at: int) -> Float[Array, "B T H K"]:
    """``z = f_a · W_fb`` in ``y.dtype`` (the layer's ``f_b`` projection), ``f_a`` the columns of ``y`` from ``at``."""
    return jnp.einsum("BTR,RHK->BTHK", y[..., at:at + f_b.shape[0]], f_b.astype(y.dtype))


def prepare(y: Float[Array, "B T N"], tails: Float[Array, "3 B Wm1 C"], conv_weights: tuple,
            decay: Float[Array, "R H K"] | Float[Array, "B T H K"], dt_bias: Float[Array, "H K"],
            a_log: Float[Array, "H"], num_new: Int[Array, "B"], *, offsets: tuple[int, ...],
            lower_bound: float | None, eps: float):
    """Steps 1-4 and the conv tails: ``(q, k, v, g, β, tails)`` as the delta rule takes them (q, k, v in
    ``y.dtype``, g and β float32, the tokens past ``num_new`` no-ops) and the conv inputs continuing each row."""
    B, T, _ = y.shape
    H, K = decay.shape[-2:]
    f32, dt = jnp.float32, y.dtype
    q_at, k_at, v_at, b_at, fa_at = offsets
    convs, windows = [], []
    for tail, w, at in zip(tails, conv_weights, (q_at, k_at, v_at)):
        x = y[..., at:at + H * K].astype(f32)
        wf = w.reshape(w.shape[0], H * K).T.astype(f32)  # [C, W]
        out, _ = causal_conv1d(x, wf, initial_state=tail)
        convs.append(jax.nn.silu(out).reshape(B, T, H, K))
        windows.append(jnp.concatenate([tail, x.astype(tail.dtype)], axis=1))
    q, k, v = l2_normalize(convs[0], eps), l2_normalize(convs[1], eps), convs[2]
    beta = jax.nn.sigmoid(y[..., b_at:b_at + H].astype(f32))
    z = decay_product(y, decay, fa_at) if decay.ndim == 3 else decay  # W_fb, or the product given
    g = decay_gate(z.astype(f32) + dt_bias.astype(f32), a_log, lower_bound)
    valid = jnp.arange(T)[None, :] < num_new[:, None]
    g = jnp.where(valid[:, :, None, None], g, 0.0)
    beta = jnp.where(valid[:, :, None], beta, 0.0)
    new_tails = conv_tail(jnp.stack(windows), num_new, tails.shape[2]).astype(tails.dtype)
    return q.astype(dt), k.astype(dt), v.astype(dt), g, beta, new_tails


def fused_step_reference(y: Float[Array, "B T N"], tails: Float[Array, "3 B Wm1 C"], conv_weights: tuple,
                         decay: Float[Array, "R H K"] | Float[Array, "B T H K"], dt_bias: Float[Array, "H K"],
                         a_log: Float[Array, "H"], state: Float[Array, "B H K V"], num_new: Int[Array, "B"], *,
                         offsets: tuple[int, ...], scale: float, lower_bound: float | None, eps: float):
    """``(o [B, T, H, V] in y.dtype, state [B, H, K, V] float32, tails [3, B, W-1, C] in tails.dtype)``.

    ``tails``: the cached conv inputs of q, k, v (oldest first); ``conv_weights``: q's, k's and v's,
    ``[W, H, K]`` each (tap ``W-1`` the current token); ``decay``: the decay's second factor ``W_fb
    [R, H, K]`` or the product ``z = f_a · W_fb [B, T, H, K]`` in ``y.dtype``; ``offsets``: the columns of
    y where q, k, v (``H·K`` each), the β logits (``H``) and ``f_a`` (``R``) start.
    """
    *qkvgb, tails = prepare(y, tails, conv_weights, decay, dt_bias, a_log, num_new, offsets=offsets,
                            lower_bound=lower_bound, eps=eps)
    o, state = naive_recurrent_kda(*qkvgb, scale=scale, initial_state=state.astype(jnp.float32))
    return o, state, tails


__all__ = ["decay_product", "fused_step_reference", "l2_normalize", "prepare"]
