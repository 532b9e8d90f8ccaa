"""Pure-JAX definitions of one chunk's output-head logits and their logsumexp.

1. ``chunk_logits_lse``: ``logits = f @ W`` (compute-dtype operands, fp32 accumulation, stored in
   ``logits_dtype``) and ``logsumexp`` over the vocabulary of the stored logits read as fp32: what
   ``k3jax.train.loss`` computed before the kernel existed, and its XLA path.
2. ``logits_partials`` + ``combine_partials``: the same logsumexp cut the way the kernel computes it.
   Each vocabulary tile of ``tile_n`` columns gives, per row, its max ``m_t`` and ``s_t = Σ exp(x − m_t)``;
   ``lse = M + log Σ_t s_t exp(m_t − M)`` with ``M = max_t m_t`` (the online-softmax rescaling of
   Milakov & Gimelshein 2018, "Online normalizer calculation for softmax").
3. ``shifted_exponentials``: what the training loss's gradient matmuls read instead of
   ``softmax − onehot``: ``exp(x − shift)`` per row, with ``shift`` the row's label logit, 0 at the
   label's column. The softmax is that times ``exp(shift − lse)`` (a per-row scale the matmuls'
   callers apply to their ``[C, D]`` sides), so no pass over the logits waits for the logsumexp.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


# exp(x − shift) is capped at exp(CLAMP): finite in bf16 (max ≈ e^88.7) with room for a row's sum
# in fp32, and its row scale exp(shift − lse) >= e^-(CLAMP + ln V) stays a normal bf16 number.
# A row whose max logit exceeds its shift by more (a token with a loss above CLAMP nats) is not
# represented: k3jax.train.loss then recomputes that chunk the plain way.
CLAMP = 64.0


def wide(dtype) -> jnp.dtype:
    """The accumulation dtype: fp32, or float64 for float64 inputs."""
    return jnp.promote_types(dtype, jnp.float32)


def chunk_logits(f: Float[Array, "C D"], w: Float[Array, "D V"], logits_dtype=None) -> Float[Array, "C V"]:
    """``f @ w`` with ``w`` cast to ``f``'s dtype, accumulated in fp32, stored in ``logits_dtype``
    (None: the accumulation dtype)."""
    return jnp.einsum("CD,DV->CV", f, w.astype(f.dtype), preferred_element_type=logits_dtype or wide(f.dtype))


def chunk_logits_lse(f: Float[Array, "C D"], w: Float[Array, "D V"], logits_dtype=None):
    """(logits ``[C, V]`` in ``logits_dtype``, logsumexp ``[C]`` of the stored logits in fp32)."""
    logits = chunk_logits(f, w, logits_dtype)
    return logits, jax.nn.logsumexp(logits.astype(wide(logits.dtype)), axis=-1)


def logits_partials(f: Float[Array, "C D"], w: Float[Array, "D V"], tile_n: int, logits_dtype=None):
    """(logits, ``pmax [V/tile_n, C]``, ``psum [V/tile_n, C]``): the kernel's outputs."""
    logits = chunk_logits(f, w, logits_dtype)
    c, v = logits.shape
    x = logits.astype(wide(logits.dtype)).reshape(c, v // tile_n, tile_n)  # [C, V/tn, tn]
    pmax = jnp.max(x, axis=-1)
    psum = jnp.sum(jnp.exp(x - pmax[..., None]), axis=-1)
    return logits, pmax.T, psum.T


def shifted_exponentials(x: Float[Array, "C V"], shift: Float[Array, "C"], labels: Int[Array, "C"],
                         dtype) -> Float[Array, "C V"]:
    """``exp(min(x − shift, CLAMP))`` in ``dtype``, 0 at each row's label column (``x`` and ``shift``
    in the accumulation dtype; a row with ``shift = +inf`` is all zeros)."""
    hit = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1) == labels[:, None]
    return jnp.where(hit, 0.0, jnp.exp(jnp.minimum(x - shift[:, None], CLAMP))).astype(dtype)


def combine_partials(pmax: Float[Array, "Vt C"], psum: Float[Array, "Vt C"]) -> Float[Array, "C"]:
    """The logsumexp per row from the per-tile maxima and sums of exponentials."""
    top = jnp.max(pmax, axis=0)  # [C]
    return top + jnp.log(jnp.sum(psum * jnp.exp(pmax - top), axis=0))


__all__ = ["CLAMP", "chunk_logits", "chunk_logits_lse", "combine_partials", "logits_partials",
           "shifted_exponentials", "wide"]
