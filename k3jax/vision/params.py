"""Parameter counts of the multimodal model: the text model (``k3jax.params``) plus tower and projector.

Shapes come from ``jax.eval_shape`` of the modules' init (nothing allocated). Every vision
parameter is active for an image token (the tower is dense).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import numpy as np

from k3jax.config import ParamCount
from k3jax.params import count_params as count_text_params
from k3jax.vision.batch import pack_media
from k3jax.vision.config import MultimodalConfig, VisionConfig
from k3jax.vision.encoder import VisionTower
from k3jax.vision.preprocess import Media
from k3jax.vision.projector import Projector


def _probe(cfg: VisionConfig):
    fh, fw = cfg.merge_pixels
    return pack_media([[Media(np.zeros((1, fh, fw, cfg.channels), np.float32), (fw, fh), "image")]], cfg)


class _Vision(nn.Module):
    cfg: VisionConfig
    text_hidden: int

    @nn.compact
    def __call__(self, media):
        features = VisionTower(self.cfg, name="vision_tower")(media)
        return Projector(self.cfg, self.text_hidden, name="mm_projector")(features)


@functools.lru_cache(maxsize=8)
def abstract_vision(cfg: VisionConfig, text_hidden: int) -> dict:
    """``{"params": {"vision_tower", "mm_projector"}}`` as ``ShapeDtypeStruct`` leaves, boxed with their
    logical axis names (nothing allocated)."""
    return jax.eval_shape(_Vision(cfg, text_hidden).init, jax.random.PRNGKey(0), _probe(cfg))


def vision_table(cfg: VisionConfig, text_hidden: int) -> dict[str, int]:
    """Parameters of ``vision_tower`` and ``mm_projector``."""
    shapes = nn.meta.unbox(abstract_vision(cfg, text_hidden))["params"]
    return {name: sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(tree)) for name, tree in shapes.items()}


def count_params(cfg: MultimodalConfig) -> ParamCount:
    """Text total/active (SPEC §11) plus every tower and projector parameter."""
    text = count_text_params(cfg.text)
    vision = sum(vision_table(cfg.vision, cfg.text.hidden).values())
    return ParamCount(total=text.total + vision, active=text.active + vision)


def tower_params(cfg: VisionConfig) -> int:
    """The tower alone (~0.40 B for ``moonvit_v2``)."""
    return vision_table(cfg, 8)["vision_tower"]


