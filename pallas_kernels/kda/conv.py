"""The KDA short convolution: causal depthwise Conv1d (width W, no bias), per channel.

Kimi Linear (arXiv:2510.26692) runs q, k and v through a width-4 causal depthwise conv followed by
SiLU (applied by the layer, not here). ``y[t, c] = sum_j weight[c, j] * x[t - (W-1) + j, c]``: tap
``W-1`` is the current token, history before the first token is zero (or ``initial_state``).
Computed in fp32 (float64 for float64 inputs); packed documents never see each other's history.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

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


def same_document_taps(segment_ids: Int[Array, "B T"] | None, width: int) -> Bool[Array, "B T Wm1"] | None:
    """``keep[b, t, j]``: conv input ``t-(W-1)+j`` (tap ``j < W-1``) is in token t's document.

    Computed once per layer and shared by the q, k and v convs; ``None`` without ``segment_ids``
    (nothing to mask: the zero history already ends each row). History before token 0 (an
    ``initial_state``) belongs to the first document, as in :func:`causal_conv1d`.
    """
    if segment_ids is None or width == 1:
        return None
    # cont[t]: token t continues t-1's document (positions <= 0 continue into the history).
    cont = jnp.pad(segment_ids[:, 1:] == segment_ids[:, :-1], ((0, 0), (width - 1, 0)), constant_values=True)
    T = segment_ids.shape[1]
    keep, run = [], jnp.ones(segment_ids.shape, bool)
    for lag in range(1, width):  # the input lag tokens back: no document start in (t-lag, t]
        run = run & cont[:, width - 1 - lag : width - 1 - lag + T]
        keep.append(run)
    return jnp.stack(keep[::-1], axis=-1)  # tap j = W-1-lag


def _taps(x_ext: Float[Array, "B WT C"], w: Float[Array, "C W"], keep) -> Float[Array, "B T C"]:
    """``sum_j w[:, j] x_ext[:, j : j+T]`` over the same-document taps (in tap order, so the sums
    round as :func:`causal_conv1d` always has). ``x_ext`` is the W-1 history then the T inputs."""
    W = w.shape[1]
    T = x_ext.shape[1] - (W - 1)
    y = None
    for j in range(W):  # W is tiny (4): one shifted multiply-add per tap
        term = x_ext[:, j : j + T] * w[:, j]
        if keep is not None and j < W - 1:
            term = jnp.where(keep[..., j : j + 1], term, 0.0)
        y = term if y is None else y + term
    return y


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
    y = _taps(x_ext, weight.astype(dt), same_document_taps(segment_ids, W))

    sidx = segment_index(segment_ids, B, T)
    sidx_ext = jnp.concatenate([jnp.zeros((B, W - 1), sidx.dtype), sidx], axis=1)
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


def short_conv(
    x: Float[Array, "B T C"],
    weight: Float[Array, "C W"],
    keep: Bool[Array, "B T Wm1"] | None = None,
    *,
    l2_group: int | None = None,
    eps: float = 1e-6,
) -> Float[Array, "B T C"]:
    """Training forward of the KDA short conv: ``SiLU(causal_conv1d(x))``, fp32 (f64 for f64 inputs),
    and with ``l2_group`` each run of ``l2_group`` channels (a head) scaled to unit norm,
    ``s / sqrt(sum s^2 + eps)`` (fla's ``l2norm_fwd``). ``keep`` is :func:`same_document_taps`.

    Same values as ``l2_normalize(silu(causal_conv1d(x, weight, segment_ids=...)[0]))``, computed
    so that XLA emits simple bandwidth-bound fusions (a ``custom_vjp``; the forward saves only the
    inputs and the per-head inverse norms, the backward recomputes the conv). The sums of squares
    of the norm, and of its backward, are fenced off with ``optimization_barrier``: fused with the
    convs and the normalisation they became one slow multi-output reduction on the H200.
    """
    if x.ndim != 3 or weight.ndim != 2 or weight.shape[0] != x.shape[2]:
        raise ValueError(f"x [B, T, C] and weight [C, W] must agree on C, got {x.shape} and {weight.shape}")
    B, T, C = x.shape
    if keep is not None and keep.shape != (B, T, weight.shape[1] - 1):
        raise ValueError(f"keep must have shape [B, T, W-1] = {(B, T, weight.shape[1] - 1)}, got {keep.shape}")
    if l2_group is not None and (l2_group < 1 or C % l2_group):
        raise ValueError(f"l2_group must divide C={C}, got {l2_group}")
    return _short_conv(x, weight, keep, l2_group, eps)


def _silu_conv(x, weight, keep):
    """``(z, sigmoid(z))`` of the conv pre-activation ``z``, in the compute dtype."""
    W = weight.shape[1]
    dt = compute_dtype(x, weight)
    x_ext = jnp.pad(x.astype(dt), ((0, 0), (W - 1, 0), (0, 0)))  # the zero history
    z = _taps(x_ext, weight.astype(dt), keep)
    return z, jax.nn.sigmoid(z)


def _group_sum(a, group):
    """``sum`` over each run of ``group`` channels: ``[B, T, C] -> [B, T, C/group, 1]``."""
    B, T, C = a.shape
    return jnp.sum(a.reshape(B, T, C // group, group), axis=-1, keepdims=True)


def _per_group(a, scale):
    """``a [B, T, C]`` times ``scale [B, T, G, 1]`` broadcast over each group of channels."""
    B, T, C = a.shape
    return (a.reshape(B, T, scale.shape[2], -1) * scale).reshape(B, T, C)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _short_conv(x, weight, keep, l2_group, eps):
    return _short_conv_fwd(x, weight, keep, l2_group, eps)[0]


def _short_conv_fwd(x, weight, keep, l2_group, eps):
    z, sig = _silu_conv(x, weight, keep)
    s = z * sig
    if l2_group is None:
        return s, (x, weight, keep, None)
    inv = jax.lax.rsqrt(_group_sum(jnp.square(s), l2_group) + eps)  # [B, T, H, 1]
    x_again, inv = jax.lax.optimization_barrier((x, inv))  # the norm's reduction is its own fusion
    z, sig = _silu_conv(x_again, weight, keep)  # recomputed in the output's loop fusion
    return _per_group(z * sig, inv), (x, weight, keep, inv)


def _short_conv_bwd(l2_group, eps, res, dy):
    x, weight, keep, inv = res
    W = weight.shape[1]
    T = x.shape[1]
    dy = dy.astype(compute_dtype(x, weight))
    if l2_group is not None:  # d(s·inv)/ds: inv·dy − s·inv³·Σ(dy·s) per head
        z, sig = _silu_conv(x, weight, keep)
        dot = _group_sum(dy * z * sig, l2_group)
        x, dot = jax.lax.optimization_barrier((x, dot))
        z, sig = _silu_conv(x, weight, keep)
        dy = _per_group(dy, inv) - _per_group(z * sig, dot * inv**3)
    else:
        z, sig = _silu_conv(x, weight, keep)
    dz = dy * sig * (1.0 + z * (1.0 - sig))  # SiLU'
    w = weight.astype(dz.dtype)
    x_ext = jnp.pad(x.astype(dz.dtype), ((0, 0), (W - 1, 0), (0, 0)))
    dx, dw = None, []
    for j in range(W):  # tap j carried input t-(W-1)+j into output t
        dzj = dz if keep is None or j == W - 1 else jnp.where(keep[..., j : j + 1], dz, 0.0)
        dw.append(jnp.sum(x_ext[:, j : j + T] * dzj, axis=(0, 1)))
        dzj = jnp.pad(dzj, ((0, 0), (0, W - 1), (0, 0)))  # no outputs after T
        term = dzj[:, W - 1 - j : W - 1 - j + T] * w[:, j]
        dx = term if dx is None else dx + term
    return dx.astype(x.dtype), jnp.stack(dw, axis=1).astype(weight.dtype), None


_short_conv.defvjp(_short_conv_fwd, _short_conv_bwd)
