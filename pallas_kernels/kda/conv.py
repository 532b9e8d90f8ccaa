"""The KDA short convolution: causal depthwise Conv1d (width W, no bias), per channel.

Kimi Linear (arXiv:2510.26692) runs q, k and v through a width-4 causal depthwise conv followed by
SiLU. ``y[t, c] = sum_j weight[c, j] * x[t - (W-1) + j, c]``: tap ``W-1`` is the current token,
history before the first token is zero (or ``initial_state``). Computed in fp32 (float64 for
float64 inputs); packed documents never see each other's history.

:func:`causal_conv1d` is the conv alone (decode, context parallel); :func:`short_convs` is the
training op: the conv, SiLU and the q/k L2 norm of all three tensors with a custom VJP."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels.kda import kernel_gpu_conv
from pallas_kernels.kda.reference import compute_dtype, segment_index
from pallas_kernels.target import current_target

IMPLEMENTATIONS = (None, "xla", "pallas")


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


def conv_tail(window: Float[Array, "*L B WT C"], num_new: Int[Array, "B"], width: int) -> Float[Array, "*L B Wm1 C"]:
    """The ``width = W-1`` conv inputs ending at each row's new token ``num_new - 1``, from ``window``
    (the W-1 cached inputs, then the new ones): the conv state that continues each row."""
    idx = num_new[:, None] + jnp.arange(width)[None]  # [B, W-1]
    return jnp.take_along_axis(window, idx.reshape((1,) * (window.ndim - 3) + idx.shape + (1,)), axis=-2)


def causal_conv1d_step(
    x: Float[Array, "B Tn C"],
    weight: Float[Array, "C W"],
    conv_state: Float[Array, "B Wm1 C"],
) -> tuple[Float[Array, "B Tn C"], Float[Array, "B Wm1 C"]]:
    """Decode: a few new tokens continuing ``conv_state``; returns ``(y, new_conv_state)``."""
    if conv_state is None:
        raise ValueError("conv_state must be an array of shape [B, W-1, C], got None")
    return causal_conv1d(x, weight, initial_state=conv_state)


def short_convs(
    xs: tuple[Float[Array, "B T C"], ...],
    weights: tuple[Float[Array, "C W"], ...],
    keep: Bool[Array, "B T Wm1"] | None = None,
    *,
    l2_groups: tuple[int | None, ...],
    eps: float = 1e-6,
    out_dtype=None,
    implementation: str | None = None,
    interpret: bool = False,
) -> tuple[Float[Array, "B T C"], ...]:
    """Training forward of KDA's short convs (q, k and v at once): ``SiLU(causal_conv1d(x))`` for each
    ``x``, computed in fp32 (f64 for f64 inputs); where ``l2_groups`` gives a group size, each run of
    that many channels (a head) is scaled to unit norm, ``s / sqrt(sum s^2 + eps)`` (fla's
    ``l2norm_fwd``). ``keep`` is :func:`same_document_taps`, shared by all of them. Results are cast
    to ``out_dtype`` (default: the compute dtype) inside the op, so the cotangents stay that narrow.

    Same values as ``l2_normalize(silu(causal_conv1d(x, w, segment_ids=...)[0]))``, computed so that
    XLA emits only simple bandwidth-bound fusions: a ``custom_vjp`` whose forward saves the inputs
    and the per-head inverse norms and whose backward recomputes the conv, in stages fenced off by
    ``optimization_barrier`` (per-head sums; outputs | dz and dx; dw), so that no stage's reduction
    is fused with another stage's full-size outputs: such multi-output reductions (the convs, the
    norms and their gradients in one) ran ~12x slower than their bandwidth time on the H200.

    ``implementation``: ``"xla"`` those stages; ``"pallas"`` per tensor one Pallas-Triton pass
    forward and one to ``dz`` backward (``pallas_kernels.kda.kernel_gpu_conv``, these stages its
    reference; ``interpret=True`` runs it in the CPU interpreter); None: ``"pallas"`` when compiling
    for a CUDA GPU and the kernels take the shapes (T a multiple of 16, C of 128, each L2 group 128
    channels, W a power of two), else ``"xla"``. On the H200 (q, k and v fwd+bwd) the kernels take 1.20 against 1.47 ms at B 8,
    T 4096, C 1024 and 3.53 against 4.94 ms at K3's B 1, T 8192, C 12288 (stop 37); since stop 40's
    backward (``dz`` kernel, XLA transposed conv) 1.29 against 2.09 ms and 3.66 against 5.50 ms with
    packed documents of ~300 tokens, which had stayed on XLA before.
    """
    if not (len(xs) == len(weights) == len(l2_groups)) or not xs:
        raise ValueError(f"xs, weights and l2_groups must have one entry per conv, got "
                         f"{len(xs)}, {len(weights)} and {len(l2_groups)}")
    for x, w, group in zip(xs, weights, l2_groups):
        if x.ndim != 3 or x.shape != xs[0].shape:
            raise ValueError(f"each x must have shape [B, T, C] = {xs[0].shape}, got {x.shape}")
        if w.shape != (x.shape[2], weights[0].shape[-1]) or w.shape[1] < 1:
            want = (x.shape[2], weights[0].shape[-1])
            raise ValueError(f"each weight must have shape [C, W] = {want}, got {w.shape}")
        if group is not None and (group < 1 or x.shape[2] % group):
            raise ValueError(f"l2_groups entries must divide C={x.shape[2]} (or be None), got {group}")
    B, T, _ = xs[0].shape
    if keep is not None and keep.shape != (B, T, weights[0].shape[1] - 1):
        raise ValueError(f"keep must have shape [B, T, W-1] = {(B, T, weights[0].shape[1] - 1)}, got {keep.shape}")
    out_dtype = compute_dtype(*xs, *weights) if out_dtype is None else jnp.dtype(out_dtype)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    fits = all(kernel_gpu_conv.accepts(x, w, keep, g) for x, w, g in zip(xs, weights, l2_groups))
    if implementation == "pallas":
        target = current_target()
        if not (interpret or (target.platform == "gpu" and target.cuda)):
            raise ValueError(f"implementation='pallas' needs a CUDA GPU (target {target.platform!r}); "
                             "use implementation='xla' or interpret=True")
        for x, w, g in zip(xs, weights, l2_groups):
            kernel_gpu_conv.check_inputs(x, w, keep, g)
    elif implementation is None:
        target = current_target()
        cuda = target.platform == "gpu" and target.cuda
        implementation = "pallas" if fits and cuda else "xla"
    kernel = (implementation == "pallas", interpret)
    return _short_convs(tuple(xs), tuple(weights), keep, tuple(l2_groups), eps, out_dtype, kernel)


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


def _keep_tap(a, keep, j):
    """``a`` where tap ``j`` stays inside the document (the current tap ``W-1`` always does)."""
    return a if keep is None or j == keep.shape[-1] else jnp.where(keep[..., j : j + 1], a, 0.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _short_convs(xs, weights, keep, l2_groups, eps, out_dtype, kernel):
    return _short_convs_fwd(xs, weights, keep, l2_groups, eps, out_dtype, kernel)[0]


def _short_convs_fwd(xs, weights, keep, l2_groups, eps, out_dtype, kernel):
    """``kernel = (use the Pallas kernels, interpret)``."""
    if kernel[0]:
        outs, invs = zip(*(kernel_gpu_conv.conv_forward(x, w, keep, group=g, eps=eps, out_dtype=out_dtype,
                                                        interpret=kernel[1])
                           for x, w, g in zip(xs, weights, l2_groups)))
        return tuple(outs), (xs, weights, keep, list(invs))
    invs = []
    for x, w, group in zip(xs, weights, l2_groups):  # stage 1: the per-head sums of squares
        if group is not None:
            z, sig = _silu_conv(x, w, keep)
            invs.append(jax.lax.rsqrt(_group_sum(jnp.square(z * sig), group) + eps))  # [B, T, G, 1]
        else:
            invs.append(None)
    xs_, invs = jax.lax.optimization_barrier((xs, invs))
    outs = []
    for x, w, inv in zip(xs_, weights, invs):  # stage 2: the outputs, the conv recomputed
        z, sig = _silu_conv(x, w, keep)
        outs.append((z * sig if inv is None else _per_group(z * sig, inv)).astype(out_dtype))
    return tuple(outs), (xs, weights, keep, invs)


def _short_convs_bwd(l2_groups, eps, out_dtype, kernel, res, dys):
    xs, weights, keep, invs = res
    if kernel[0]:
        grads = [kernel_gpu_conv.conv_dz(x, w, keep, inv, dy, interpret=kernel[1])
                 for x, w, inv, dy in zip(xs, weights, invs, dys)]
        dxs = (_conv_transpose(dz, w.astype(dz.dtype), keep).astype(x.dtype)  # one XLA fusion per tensor
               for (dz, _), x, w in zip(grads, xs, weights))
        return tuple(dxs), tuple(dw.astype(w.dtype) for (_, dw), w in zip(grads, weights)), None
    wide = lambda dy, x, w: dy.astype(compute_dtype(x, w))  # inside each stage: never written wide
    dots = []
    for x, w, dy, group in zip(xs, weights, dys, l2_groups):  # stage 1: Σ(dy·s) per head
        if group is not None:
            z, sig = _silu_conv(x, w, keep)
            dots.append(_group_sum(wide(dy, x, w) * z * sig, group))
        else:
            dots.append(None)
    xs, dys, dots = jax.lax.optimization_barrier((xs, dys, dots))
    dzs, dxs = [], []
    for x, w, dy, inv, dot in zip(xs, weights, dys, invs, dots):  # stage 2: dz and dx
        z, sig = _silu_conv(x, w, keep)
        dy = wide(dy, x, w)
        if inv is not None:  # d(s·inv)/ds: inv·dy − s·inv³·Σ(dy·s)
            dy = _per_group(dy, inv) - _per_group(z * sig, dot * inv**3)
        dz = dy * sig * (1.0 + z * (1.0 - sig))  # SiLU'
        dzs.append(dz)
        dxs.append(_conv_transpose(dz, w.astype(dz.dtype), keep).astype(x.dtype))
    xs, dzs, dxs = jax.lax.optimization_barrier((xs, dzs, dxs))
    dws = [_conv_weight_grad(x, dz, keep, w.shape[1]).astype(w.dtype) for x, dz, w in zip(xs, dzs, weights)]
    return tuple(dxs), tuple(dws), None


def _conv_transpose(dz, w, keep):
    """``dx[u] = sum_j w[:, j] dz[u + (W-1) - j]`` over the taps that stayed in the document."""
    W, T = w.shape[1], dz.shape[1]
    dx = None
    for j in range(W):  # tap j carried input t-(W-1)+j into output t
        dzj = jnp.pad(_keep_tap(dz, keep, j), ((0, 0), (0, W - 1), (0, 0)))  # no outputs after T
        term = dzj[:, W - 1 - j : W - 1 - j + T] * w[:, j]
        dx = term if dx is None else dx + term
    return dx


def _conv_weight_grad(x, dz, keep, width):
    """``dw[:, j] = sum_{b,t} x[t-(W-1)+j] dz[t]`` over the taps that stayed in the document."""
    T = x.shape[1]
    x_ext = jnp.pad(x.astype(dz.dtype), ((0, 0), (width - 1, 0), (0, 0)))
    # Taps minor ([B, T, C, W]), one reduction reading x and dz once. Taps major ([W, B, T, C], a
    # column reduction per tap along the contiguous channels) was slower on the H200: the whole
    # short-conv fwd+bwd 1.760 against 1.463 ms (bench_kda_conv.py, stop 36, one call).
    taps = jnp.stack([x_ext[:, j : j + T] * _keep_tap(dz, keep, j) for j in range(width)], axis=-1)
    return jnp.sum(taps, axis=(0, 1))


_short_convs.defvjp(_short_convs_fwd, _short_convs_bwd)
