"""The output head and the next-token cross-entropy as one op, token chunk by token chunk.

Computing ``logits = features @ W_head`` for a whole batch and then the softmax cross-entropy
materialises ``[B, T, V]`` fp32 logits (small(): 8 × 4096 × 163840 × 4 B = 21 GB) and, under
autodiff, fp32 cotangents whose two backward matmuls run in fp32 (TF32 on a GPU) instead of bf16.
`head_cross_entropy` instead walks ``chunk`` tokens at a time: each chunk's logits (bf16 operands,
fp32 accumulation, as in ``Transformer.logits``) give its loss *and*, in the same pass, its
gradients, because the gradient of a sum of cross-entropies is known before the backward pass
starts (``∂/∂logits = softmax − onehot``, times the mask). The gradient matmuls take that
difference in the compute dtype (bf16: SPEC §10 matmul operands) with fp32 accumulation; the
backward pass only scales the stored gradients by the incoming cotangent. Without differentiation
the forward computes the loss alone. Peak extra memory: one chunk of logits (fp32; bf16
exponentials on the gradient path).

The gradient matmuls do not read ``softmax − onehot`` (whose every entry needs the row's logsumexp,
known only after the whole row): they read ``exp(x − x_y)``, the logits shifted by each row's label
logit ``x_y`` (computed beforehand as ``f · W[:, y]``), which the head's matmul can write as it
forms each tile (``pallas_kernels.head_ce.chunk_exponentials_lse``: the Mosaic GPU kernel's epilogue
on Hopper; XLA's path keeps the plain form below, which is faster there). The softmax is that times
the per-row ``exp(x_y − lse)``, which scales the matmuls' ``[C, D]`` sides (the features' rows
before ``dW``, the product's rows after ``d_features``). The label's column, which the kernel leaves
zero, is set to ``1 − exp(lse − x_y)`` (``−expm1`` in fp32, so ``p_y`` never cancels against 1, then
rounded once to bf16, as the plain path rounds ``softmax − onehot``): times the row's scale it is
``m · (p_y − 1)``, so both products carry the label's term and no scatter-add runs over ``d_head``'s
``[D, V]`` columns (54.06 against 56.16 ms a micro-batch on the H200, stop 44). The exponentials
are capped at ``exp(CLAMP)`` (``pallas_kernels.head_ce.reference``): a chunk holding a real token whose
loss exceeds CLAMP = 64 nats takes the plain path instead (the stored logits, then ``softmax − onehot``
as one elementwise pass), so both are exact to bf16 rounding. On the H200 at small()'s 8 × 4096 tokens
this removed the softmax − onehot pass over fp32 logits: 61.62 → 56.17 ms for the loss and its
gradients, the kernel storing bf16 instead of fp32 (benchmarks/RESULTS.md, stop 41). With
``logits_dtype="bfloat16"`` the logits are rounded to bf16 before the softmax (as a PyTorch bf16
``lm_head`` followed by ``logits.float()``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from k3jax.train.config import LOSS_IMPLEMENTATIONS, LOSS_LOGITS_DTYPES
from pallas_kernels.head_ce import chunk_exponentials_lse, chunk_logits_lse
from pallas_kernels.head_ce.ops import resolve_implementation
from pallas_kernels.head_ce.reference import CLAMP


def _flat_chunks(features, labels, mask, chunk: int):
    """Tokens flattened and padded (mask 0) to whole chunks: ``[n, C, D]``, ``[n, C]``, ``[n, C]``."""
    D = features.shape[-1]
    f, y, m = features.reshape(-1, D), labels.reshape(-1), mask.reshape(-1).astype(jnp.float32)
    N = f.shape[0]
    C = min(chunk, N)
    pad = -N % C
    if pad:
        f, y, m = jnp.pad(f, ((0, pad), (0, 0))), jnp.pad(y, (0, pad)), jnp.pad(m, (0, pad))
    n = (N + pad) // C
    return f.reshape(n, C, D), y.reshape(n, C), m.reshape(n, C), N


def _logits_dtype(name):
    if name not in LOSS_LOGITS_DTYPES:
        raise ValueError(f"logits_dtype={name!r} must be one of {LOSS_LOGITS_DTYPES}")
    return None if name is None else jnp.dtype(name)


def _wide(dtype):
    """The accumulation dtype: fp32, or float64 for float64 inputs."""
    return jnp.promote_types(dtype, jnp.float32)


def _implementation(name):
    if name not in LOSS_IMPLEMENTATIONS:
        raise ValueError(f"implementation={name!r} must be one of {LOSS_IMPLEMENTATIONS}")
    return name


def _chunk_ce(f, head, y, m, logits_dtype, implementation, interpret):
    """One chunk's logits (compute-dtype operands, fp32 accumulation, stored in ``logits_dtype``,
    None: the accumulation dtype), ``Σ_c mask_c (logsumexp(logits_c) − logits_c[y_c])`` and the
    logsumexp per row (fp32, of the stored logits)."""
    logits, lse = chunk_logits_lse(f, head, logits_dtype, implementation=implementation, interpret=interpret)
    picked = jnp.take_along_axis(logits, y[:, None], axis=-1)[:, 0].astype(lse.dtype)
    return logits, jnp.sum((lse - picked) * m), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def head_cross_entropy(features: Float[Array, "B T D"], head: Float[Array, "D V"], labels: Int[Array, "B T"],
                       mask: Float[Array, "B T"], chunk: int = 4096, logits_dtype: str | None = None,
                       implementation: str | None = None, interpret: bool = False,
                       narrow_head: Float[Array, "D V"] | None = None) -> Float[Array, ""]:
    """``Σ_{b,t} mask · CE(softmax(features @ head), labels)`` in fp32, ``chunk`` tokens at a time.

    ``features`` are the final-norm outputs in the compute dtype; ``head`` is ``W_head [D, V]``
    (cast to the features' dtype). ``mask`` gets a zero gradient; ``labels`` none.
    ``logits_dtype``: the dtype the head's matmul stores its fp32-accumulated logits in before the
    fp32 softmax; None keeps the accumulation dtype, "bfloat16" halves the traffic of every pass
    over the logits (as a PyTorch bf16 ``lm_head`` followed by ``logits.float()`` does).
    ``implementation``: "xla" (XLA's matmul and logsumexp, then ``softmax − onehot``), "pallas" (the
    shifted exponentials and the logsumexp's partials from one Mosaic GPU kernel,
    ``pallas_kernels.head_ce``; Hopper only, or ``interpret=True`` on CPU) or None (default: the
    kernel where it runs, else XLA; on the H200 small()'s 8-micro-batch train step took 1.885 s with
    the kernel against 1.961 s in stop 36, and 1.757 s since stop 41's exponentials,
    benchmarks/RESULTS.md).
    ``narrow_head``: ``head`` already cast to the features' dtype (gets no gradient; ``head``'s
    gradient is the same): the trainer casts the fp32 head once per step instead of once per
    micro-batch (small(): 1.0 GB of traffic a micro-batch, ``benchmarks/layer_glue.py --train``).
    """
    logits_dtype, implementation = _logits_dtype(logits_dtype), _implementation(implementation)
    fs, ys, ms, _ = _flat_chunks(features, labels, mask, chunk)
    ms = ms.astype(_wide(features.dtype))
    w = _narrow(head, features.dtype, narrow_head)

    def one(args):
        f, y, m = args
        return _chunk_ce(f, w, y, m, logits_dtype, implementation, interpret)[1]

    return jnp.sum(jax.lax.map(one, (fs, ys, ms)))


def _narrow(head, dtype, narrow_head):
    """``head`` in ``dtype``: ``narrow_head`` when given (checked), else cast here."""
    if narrow_head is None:
        return head.astype(dtype)
    if narrow_head.shape != head.shape or narrow_head.dtype != dtype:
        raise ValueError(f"narrow_head must be head {head.shape} in the features' dtype {jnp.dtype(dtype)}, "
                         f"got {narrow_head.shape} {narrow_head.dtype}")
    return narrow_head


def _writes_exponentials(implementation, interpret, dtype, d: int, v: int) -> bool:
    """Whether the gradient takes the shifted exponentials (``_shifted_chunk``): where the head
    kernel's epilogue writes them. XLA's path forms ``softmax − onehot`` from its stored logits in
    one pass instead (``_plain_chunk``): on the H200 (small(), stop 41) the shifted form through XLA
    took 69.61 ms against 67.64, through the kernel 56.17 against 61.62 (the plain form)."""
    return resolve_implementation(implementation, interpret, dtype, d, v) == "pallas"


def _plain_chunk(d_head, f, w, y, m, logits_dtype, implementation, interpret):
    """``(d_head + this chunk's part, its loss, its d_features)`` (wide dtype) from ``softmax − onehot``."""
    wide = _wide(f.dtype)
    logits, ce, lse = _chunk_ce(f, w, y, m, logits_dtype, implementation, interpret)
    # one elementwise pass writing the compute dtype (a scatter of the onehot would materialise
    # the fp32 softmax first: two more passes over the logits)
    p = jnp.exp(logits.astype(wide) - lse[:, None])
    hit = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1) == y[:, None]
    d_logits = (jnp.where(hit, p - 1.0, p) * m[:, None]).astype(f.dtype)
    return (d_head + jnp.einsum("CD,CV->DV", f, d_logits, preferred_element_type=wide), ce,
            jnp.einsum("CV,DV->CD", d_logits, w, preferred_element_type=wide))


def _shifted_chunk(d_head, f, w, y, m, logits_dtype, implementation, interpret):
    """``_plain_chunk``'s results from the shifted exponentials (the module docstring), or from
    ``_plain_chunk`` itself when a real token's loss exceeds CLAMP."""
    wide = _wide(f.dtype)
    w_y = jnp.take(w, y, axis=1, mode="clip").T.astype(wide)  # [C, D]: each row's label column
    picked = jnp.sum(f.astype(wide) * w_y, axis=-1)  # the label's logit (exact products, fp32 sum)
    if logits_dtype is not None:
        picked = picked.astype(logits_dtype).astype(wide)
    shift = jnp.where(m > 0, picked, jnp.inf)  # masked rows: no exponentials at all
    exps, lse, top = chunk_exponentials_lse(f, w, shift, y, logits_dtype, implementation=implementation,
                                            interpret=interpret)

    def shifted(d_head):
        # softmax = exps · scale off the label; the label's column, zero in exps, becomes 1 − exp(lse −
        # picked), which times scale is m (p_y − 1) (the module docstring)
        scale = m * jnp.exp(picked - lse)
        at_label = jnp.where(m > 0, -jnp.expm1(lse - picked), 0.0).astype(exps.dtype)
        grad_exps = exps.at[jnp.arange(exps.shape[0]), y].set(at_label, mode="clip")
        d_f = scale[:, None] * jnp.einsum("CV,DV->CD", grad_exps, w, preferred_element_type=wide)
        rows = (f.astype(wide) * scale[:, None]).astype(f.dtype)
        return d_head + jnp.einsum("CD,CV->DV", rows, grad_exps, preferred_element_type=wide), d_f

    def plain(d_head):
        d_head, _, d_f = _plain_chunk(d_head, f, w, y, m, logits_dtype, implementation, interpret)
        return d_head, d_f

    d_head, d_f = jax.lax.cond(jnp.all(top - shift <= CLAMP), shifted, plain, d_head)
    return d_head, jnp.sum((lse - picked) * m), d_f


def _fwd(features, head, labels, mask, chunk, logits_dtype, implementation, interpret, narrow_head=None):
    logits_dtype, implementation = _logits_dtype(logits_dtype), _implementation(implementation)
    fs, ys, ms, N = _flat_chunks(features, labels, mask, chunk)
    ms = ms.astype(_wide(features.dtype))
    # The barrier makes the cast happen once: XLA otherwise re-casts the [D, V] head inside every
    # chunk of the loop (8 times per small() step on the H200).
    w = jax.lax.optimization_barrier(_narrow(head, features.dtype, narrow_head))
    chunk_grads = _shifted_chunk if _writes_exponentials(implementation, interpret, features.dtype, *w.shape) \
        else _plain_chunk

    def one(d_head, args):
        f, y, m = args
        d_head, ce, d_f = chunk_grads(d_head, f, w, y, m, logits_dtype, implementation, interpret)
        return d_head, (ce, d_f.astype(features.dtype))

    d_head, (ces, d_fs) = jax.lax.scan(one, jnp.zeros(head.shape, _wide(features.dtype)), (fs, ys, ms))
    d_features = d_fs.reshape(-1, features.shape[-1])[:N].reshape(features.shape)
    return jnp.sum(ces), (d_features, d_head, mask, jnp.zeros((0,), head.dtype))


def _bwd(chunk, logits_dtype, implementation, interpret, res, ct):
    d_features, d_head, mask, head_like = res
    return ((ct * d_features).astype(d_features.dtype), (ct * d_head).astype(head_like.dtype), None,
            jnp.zeros_like(mask), None)


head_cross_entropy.defvjp(_fwd, _bwd)

__all__ = ["head_cross_entropy"]
