"""The token embedding: ``nn.Embed``'s table with the lookup before the cast.

Flax's ``nn.Embed`` casts the whole table to ``dtype`` and then takes the rows, so under ``jax.grad``
the table's gradient is a scatter-add in that dtype: in bf16 every repeat of a token adds its row's
cotangent to a bf16 running sum, which stops growing once a term is below half of its ulp. On the
CPU a token seen 4096 times with cotangents near 1 got 512 instead of 4094 (``tests/k3jax/
test_embed.py`` checks a 3510-fold repeat against the fp32 sum), and a frequent token in a 32 K-token
micro-batch is seen thousands of times. Taking the rows from the
stored (fp32) table and casting them after gives the same forward bit for bit and a scatter-add in
the table's dtype; it also reads only the taken rows where the cast read the whole table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


class TokenEmbed(nn.Module):
    """``nn.Embed``'s parameter (``embedding [num_embeddings, features]`` in ``param_dtype``) and
    lookup, rows taken in ``param_dtype`` and cast to ``dtype`` (None: kept)."""

    num_embeddings: int
    features: int
    dtype: Any = None
    param_dtype: Any = jnp.float32
    embedding_init: Callable = nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)

    def setup(self):
        self.embedding = self.param("embedding", self.embedding_init, (self.num_embeddings, self.features),
                                    self.param_dtype)

    def __call__(self, inputs: Int[Array, "..."]) -> Float[Array, "... D"]:
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError(f"inputs must be integer token ids, got {inputs.dtype}")
        rows = jnp.take(self.embedding, inputs, axis=0)
        return rows if self.dtype is None else rows.astype(self.dtype)


__all__ = ["TokenEmbed"]
