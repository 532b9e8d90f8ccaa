"""The multimodal model: MoonViT features replace the media placeholders of the text stream.

``MultimodalTransformer(cfg).apply(variables, tokens, media)``:

1. Embed the tokens with the language model's table.
2. Run the tower and projector on the packed patches (``MediaBatch``) -> ``[B, M, D]``.
3. Placeholder position ``t`` of row ``b`` (``tokens[b, t] == media_token_id``) takes merged token
   ``k`` of row ``b``, ``k`` = how many placeholders precede it in the row.
4. The unchanged ``k3jax.model.Transformer`` from its embeddings on.

``variables = {"params": {"vision_tower", "mm_projector", "language_model"}, "balance":
{"language_model"}}``: the text model's tree nests under ``language_model``, as the HF keys do.
Text-only rows carry an all-padding media row (or ``media=None`` for a text-only batch).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

from k3jax.model import Transformer, validate_inputs
from k3jax.vision.batch import MediaBatch
from k3jax.vision.config import MultimodalConfig
from k3jax.vision.encoder import VisionTower
from k3jax.vision.projector import Projector


def check_media(cfg: MultimodalConfig, tokens, media: MediaBatch | None) -> None:
    """Raise ``ValueError`` naming the sample whose placeholder count differs from its merged tokens
    (only on concrete inputs: before ``jit``, or eagerly)."""
    if isinstance(tokens, jax.core.Tracer) or (media is not None and isinstance(media.merged_valid, jax.core.Tracer)):
        return
    placeholders = (np.asarray(tokens) == cfg.media_token_id).sum(axis=1)
    merged = np.zeros_like(placeholders) if media is None else np.asarray(media.merged_valid).sum(axis=1)
    if media is not None and media.pixels.shape[0] != tokens.shape[0]:
        raise ValueError(f"media must have one row per sample ({tokens.shape[0]}), got {media.pixels.shape[0]}")
    for b, (p, m) in enumerate(zip(placeholders, merged)):
        if p != m:
            raise ValueError(f"sample {b}: {p} media placeholder positions (id {cfg.media_token_id}) but its "
                             f"images/clips yield {m} merged tokens (k3jax.vision.batch.build_inputs expands them)")


def splice(x: Float[Array, "B T D"], tokens: Int[Array, "B T"], features: Float[Array, "B M D"],
           media_token_id: int) -> Float[Array, "B T D"]:
    """``x`` with its placeholder positions replaced, in order, by the row's merged features."""
    is_media = tokens == media_token_id
    slot = jnp.clip(jnp.cumsum(is_media, axis=1) - 1, 0, features.shape[1] - 1)  # [B, T]
    picked = jnp.take_along_axis(features, slot[..., None], axis=1)  # [B, T, D]
    return jnp.where(is_media[..., None], picked.astype(x.dtype), x)


class MultimodalTransformer(nn.Module):
    cfg: MultimodalConfig
    remat: str = "none"

    def setup(self):
        cfg = self.cfg
        self.vision_tower = VisionTower(cfg.vision)
        self.mm_projector = Projector(cfg.vision, cfg.text.hidden)
        self.language_model = Transformer(cfg.text, self.remat)

    def encode(self, media: MediaBatch) -> Float[Array, "B M D"]:
        """Projected vision features per merged token."""
        return self.mm_projector(self.vision_tower(media))

    def embed(self, tokens: Int[ArrayLike, "B T"], media: MediaBatch | None = None) -> Float[Array, "B T D"]:
        """Token embeddings with the image / clip features spliced into the placeholders."""
        tokens, _ = validate_inputs(self.cfg.text, tokens, None)
        check_media(self.cfg, tokens, media)
        x = self.language_model.embed(tokens)
        if media is None:
            return x
        return splice(x, tokens, self.encode(media), self.cfg.media_token_id)

    def __call__(self, tokens: Int[ArrayLike, "B T"], media: MediaBatch | None = None, *,
                 segment_ids: Int[Array, "B T"] | None = None, return_hidden: bool = False):
        """Logits ``[B, T, V]`` (fp32), as ``Transformer.__call__``."""
        return self.language_model.from_embeddings(self.embed(tokens, media), segment_ids=segment_ids,
                                                   return_hidden=return_hidden)

    def features(self, tokens: Int[ArrayLike, "B T"], media: MediaBatch | None = None, *,
                 segment_ids: Int[Array, "B T"] | None = None):
        """As ``Transformer.features``: (final-norm output, final-norm input) for head-applying losses."""
        return self.language_model.from_embeddings(self.embed(tokens, media), segment_ids=segment_ids,
                                                   return_logits=False)


def text_variables(variables: dict) -> dict:
    """The language model's own variables (what ``k3jax.infer`` and ``Transformer`` take)."""
    return {name: tree["language_model"] for name, tree in variables.items() if "language_model" in tree}


def init(cfg: MultimodalConfig, key, tokens, media: MediaBatch | None = None) -> dict:
    """Initial ``{"params", "balance"}`` (float32 masters) from example inputs."""
    return MultimodalTransformer(cfg).init(key, tokens, media)
