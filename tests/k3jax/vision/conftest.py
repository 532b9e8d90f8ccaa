"""A tiny float32 multimodal model and a mixed batch (two images of different sizes, a clip, text only)."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.config import tiny
from k3jax.vision import MultimodalConfig, MultimodalTransformer, build_inputs, image_media, tiny_vision, video_media

MEDIA_ID = 5


def image(h, w, seed):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


@dataclasses.dataclass(frozen=True)
class MixedBatch:
    cfg: MultimodalConfig
    variables: dict
    tokens: np.ndarray
    lengths: np.ndarray
    media: object
    items: list  # row -> list of media items (each a list of Media chunks)


def make_cfg(dtype=jnp.float32) -> MultimodalConfig:
    # Two layers hold every K3 feature (KDA + MLA, dense + MoE, AttnRes) and compile in a third of tiny()'s time.
    text = dataclasses.replace(tiny(), num_layers=2, dtype=dtype, max_position=512)
    return MultimodalConfig(text=text, vision=tiny_vision(dtype=dtype), media_token_id=MEDIA_ID)


def mixed_items(cfg: MultimodalConfig) -> tuple[list, list]:
    v = cfg.vision
    full = image_media(image(84, 84, 0), v)  # 6 x 6 patches: every cell of the 6 x 6 position grid
    wide = image_media(image(27, 61, 1), v)
    clip = video_media([image(30, 30, 10 + i) for i in range(5)], v, cfg.frames_per_chunk)
    prompts = [[7, MEDIA_ID, 9, 11, 13], [MEDIA_ID, 20, MEDIA_ID, 21, 22], [30, 31, 32, 33]]
    return prompts, [[[full]], [[wide], clip], []]


@pytest.fixture(scope="session")
def mixed() -> MixedBatch:
    cfg = make_cfg()
    prompts, items = mixed_items(cfg)
    tokens, lengths, media = build_inputs(prompts, items, cfg)
    variables = jax.jit(MultimodalTransformer(cfg).init)(jax.random.key(0, impl="unsafe_rbg"), tokens, media)
    return MixedBatch(cfg, nn.meta.unbox(variables), tokens, lengths, media, items)
