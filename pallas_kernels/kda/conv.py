"""The KDA short convolution: causal depthwise Conv1d (width W, no bias), per channel.

Kimi Linear (arXiv:2510.26692) runs q, k and v through a width-4 causal depthwise conv followed by
SiLU (applied by the layer, not here). ``y[t, c] = sum_j weight[c, j] * x[t - (W-1) + j, c]``: tap
``W-1`` is the current token, history before the first token is zero (or ``initial_state``).
Computed in fp32 (float64 for float64 inputs); packed documents never see each other's history.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.kda.reference import compute_dtype, segment_index


def _validate(x, weight, initial_state, segment_ids) -> None:
    if x.ndim != 3:
        raise ValueError(f"x must have shape [B, T, C], got {x.shape}")
    B, T, C = x.shape
    if weight.ndim != 2 or weight.shape[0] != C or weight.shape[1] < 1:
        raise ValueError(f"weight must have shape [C, W] = [{C}, W] with W >= 1, got {weight.shape}")
    W = weight.shape[1]
    if initial_state is not None and initial_state.shape != (B, W - 1, C):
        raise ValueError(
            f"initial_state must have shape [B, W-1, C] = {(B, W - 1, C)}, got {initial_state.shape}"
        )
    if segment_ids is not None:
        if segment_ids.shape != (B, T):
            raise ValueError(f"segment_ids must have shape [B, T] = {(B, T)}, got {segment_ids.shape}")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"segment_ids must have an integer dtype, got {segment_ids.dtype}")


def causal_conv1d(
    x: Float[Array, "B T C"],
    weight: Float[Array, "C W"],
    *,
    initial_state: Float[Array, "B Wm1 C"] | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
) -> tuple[Float[Array, "B T C"], Float[Array, "B Wm1 C"]]:
    """Causal depthwise conv; returns ``(y, final_conv_state)``, both fp32 (f64 for f64 inputs).

    ``initial_state`` holds the ``W-1`` inputs before token 0 (oldest first) and belongs to the
    first document; a change of ``segment_ids`` at t drops all history before t. The final state
    is the last ``W-1`` inputs of the last document (zeros where they belong to an earlier one),
    i.e. exactly what :func:`causal_conv1d_step` needs to continue that document.
    """
    _validate(x, weight, initial_state, segment_ids)
    B, T, C = x.shape
    W = weight.shape[1]
    dt = compute_dtype(x, weight, initial_state)
    hist = jnp.zeros((B, W - 1, C), dt) if initial_state is None else initial_state.astype(dt)
    x_ext = jnp.concatenate([hist, x.astype(dt)], axis=1)  # [B, W-1+T, C]
    sidx = segment_index(segment_ids, B, T)
    sidx_ext = jnp.concatenate([jnp.zeros((B, W - 1), sidx.dtype), sidx], axis=1)
    w = weight.astype(dt)

    y = jnp.zeros((B, T, C), dt)
    for j in range(W):  # W is tiny (4): one shifted multiply-add per tap
        same_doc = (sidx_ext[:, j : j + T] == sidx)[..., None]  # [B, T, 1]
        y = y + jnp.where(same_doc, x_ext[:, j : j + T] * w[:, j], 0.0)

    tail_doc = (sidx_ext[:, T:] == sidx[:, -1:])[..., None]  # [B, W-1, 1]
    final_state = jnp.where(tail_doc, x_ext[:, T:], 0.0)
    return y, final_state


def causal_conv1d_step(
    x: Float[Array, "B Tn C"],
    weight: Float[Array, "C W"],
    conv_state: Float[Array, "B Wm1 C"],
) -> tuple[Float[Array, "B Tn C"], Float[Array, "B Wm1 C"]]:
    """Decode: a few new tokens continuing ``conv_state``; returns ``(y, new_conv_state)``."""
    if conv_state is None:
        raise ValueError("conv_state must be an array of shape [B, W-1, C], got None")
    return causal_conv1d(x, weight, initial_state=conv_state)
