"""Dense causal MLA attention with document masks: the definition the flash kernel must match.

SPEC §3: logits ``scale·(q_nope·k_nope + q_rope·k_rope)`` with ``k_rope`` shared by all heads,
softmax in fp32 over keys ``s <= t`` of the query's own document (``segment_ids``), and
``max_logit [H]``: the largest visible logit per head (QK-Clip, SPEC §7).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def visible(segment_ids: Int[Array, "B T"] | None, batch: int, length: int, *, q_start=0,
            key_length: int | None = None, key_segment_ids: Int[Array, "B S"] | None = None) -> jax.Array:
    """``[B, T, S]``: key ``s`` is visible from query ``t`` at position ``q_start + t`` (``q_start``: a
    scalar or one per row; causal, same document); keys default to the queries (``S = T``, ``key_segment_ids = segment_ids``)."""
    S = length if key_length is None else key_length
    q_pos = jnp.asarray(q_start)[..., None] + jnp.arange(length)  # [T], or [B, T] for per-row offsets
    causal = q_pos[..., :, None] >= jnp.arange(S)
    causal = causal if causal.ndim == 3 else causal[None]
    if segment_ids is None:
        return jnp.broadcast_to(causal, (batch, length, S))
    key_ids = segment_ids if key_segment_ids is None else key_segment_ids
    return causal & (segment_ids[:, :, None] == key_ids[:, None, :])


def mla_attention_reference(q_nope: Float[Array, "B T H N"], q_rope: Float[Array, "B T H R"],
                            k_nope: Float[Array, "B S H N"], k_rope: Float[Array, "B S R"],
                            v: Float[Array, "B S H V"], segment_ids: Int[Array, "B T"] | None, *,
                            scale: float, q_start=0, key_segment_ids: Int[Array, "B S"] | None = None
                            ) -> tuple[Float[Array, "B T H V"], Float[Array, "H"]]:
    """``(o, max_logit)`` in ``promote(dtype, float32)`` with full-precision matmuls; queries at
    positions ``q_start + t`` against keys at ``s`` (``ops.mla_attention`` states the contract)."""
    wide = jnp.promote_types(q_nope.dtype, jnp.float32)
    qn, qr, kn, kr, v = (x.astype(wide) for x in (q_nope, q_rope, k_nope, k_rope, v))
    B, T = qn.shape[:2]
    hi = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("BTHN,BSHN->BHTS", qn, kn, precision=hi) + jnp.einsum("BTHR,BSR->BHTS", qr, kr, precision=hi)
    mask = visible(segment_ids, B, T, q_start=q_start, key_length=kn.shape[1], key_segment_ids=key_segment_ids)
    logits = jnp.where(mask[:, None], logits * scale, -jnp.inf)  # [B, H, T, S]
    p = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("BHTS,BSHV->BTHV", p, v, precision=hi), jnp.max(logits, axis=(0, 2, 3))
