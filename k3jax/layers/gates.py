"""The output gate of KDA and gated MLA, ``o · sigmoid(W_g x)`` (SPEC §2, §3), recomputed in the backward.

The product runs in the wide dtype; under autodiff XLA kept the wide ``sigmoid`` and the product's
operands for the backward: two fp32 ``[B, T, H, 128]`` arrays per layer (768 MiB per 96-head K3
layer at 8 K tokens, ``benchmarks/bench_layer.py --residuals``). Under ``jax.checkpoint`` the
backward keeps only ``o`` and the gate logits as they come in (compute dtype for the logits) and
recomputes the sigmoid, an elementwise op that fuses into the backward's own pass. Gated MLA uses
it; KDA, whose gate follows a per-head RMSNorm, checkpoints both together (``norm.gated_rms_norm``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


@functools.partial(jax.checkpoint, static_argnums=(2, 3))
def sigmoid_gate(o: Float[Array, "*B"], logits: Float[Array, "*B"], wide_dtype, out_dtype) -> Float[Array, "*B"]:
    """``(o · sigmoid(logits))`` in ``wide_dtype``, cast to ``out_dtype``."""
    return (o.astype(wide_dtype) * jax.nn.sigmoid(logits.astype(wide_dtype))).astype(out_dtype)
