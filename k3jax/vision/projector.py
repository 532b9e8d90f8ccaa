"""Merged vision features ``[B, M, 4W]`` to the language model's width D.

- K3 ``patchmergerv2`` (SGLang ``KimiK3MultiModalProjector``): ``RMSNorm_D(W2 GELU(W1 x))``, both
  linears without bias (4096 -> 4096 -> D), exact erf GELU, no pre-norm.
- K2.5 ``patchmerger``: ``W2 GELU(W1 LayerNorm_W(x) + b1) + b2``, the LayerNorm per patch of the
  window (over W, before the four are concatenated).
HF keys: ``mm_projector.proj.0``, ``mm_projector.proj.2``, ``mm_projector.post_norm`` /
``mm_projector.pre_norm``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
from jaxtyping import Array, Float

from k3jax.layers.linear import constrain
from k3jax.vision.config import VisionConfig
from k3jax.vision.encoder import Dense, vision_norm


class Projector(nn.Module):
    cfg: VisionConfig
    text_hidden: int

    @nn.compact
    def __call__(self, x: Float[Array, "B M F"]) -> Float[Array, "B M D"]:
        cfg, D = self.cfg, self.text_hidden
        F, v2 = cfg.merged_width, cfg.projector == "patchmergerv2"
        if not v2:
            B, M, _ = x.shape
            x = vision_norm(cfg, "pre_norm", kind="layernorm", eps=cfg.projector_eps)(x.reshape(B, M, -1, cfg.hidden))
            x = x.reshape(B, M, F)
        h = Dense(cfg, "BMF,FG->BMG", (F, F), ("vision_merged", "vision_merged_out"), not v2, name="proj_0")(x)
        h = Dense(cfg, "BMG,GD->BMD", (F, D), ("vision_merged_out", "embed"), not v2, name="proj_2")(
            jax.nn.gelu(h, approximate=False))
        if v2:
            h = vision_norm(cfg, "post_norm", kind="rmsnorm", eps=cfg.projector_eps, axis="embed")(h)
        return constrain(h, ("batch", "length", "embed"))
