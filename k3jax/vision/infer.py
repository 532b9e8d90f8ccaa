"""Decoding with images in the prompt: a multimodal prefill, then the text model's own decode.

The tower runs once, at prefill: ``prefill`` splices the features into the prompt embeddings and
feeds them through ``Transformer.decode(..., embeddings=...)`` on a ``k3jax.infer`` cache; every
later token is text, so ``k3jax.infer.decode_step`` continues on ``text_variables(variables)``.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from k3jax.infer.cache import Cache
from k3jax.model import Transformer
from k3jax.vision.batch import MediaBatch
from k3jax.vision.config import MultimodalConfig
from k3jax.vision.model import MultimodalTransformer, text_variables


def prefill(variables: dict, cfg: MultimodalConfig, tokens: Int[Array, "B T"], media: MediaBatch | None,
            cache: Cache, *, lengths: Int[Array, "B"] | None = None) -> tuple[Float[Array, "B T V"], Cache]:
    """Feed right-padded prompts (``lengths`` real tokens per row, default all) with their media into
    ``cache``: ``(logits [B, T, V], cache)``."""
    x = MultimodalTransformer(cfg).apply(variables, tokens, media, method=MultimodalTransformer.embed)
    logits, layers = Transformer(cfg.text).apply(text_variables(variables), tokens, cache.layers, num_new=lengths,
                                                 embeddings=x, method=Transformer.decode)
    consumed = tokens.shape[1] if lengths is None else jnp.asarray(lengths, jnp.int32)
    return logits, Cache(layers=layers, lengths=cache.lengths + consumed)
