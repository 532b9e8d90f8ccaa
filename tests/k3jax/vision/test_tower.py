"""The tower alone: logical axis names on every parameter, bf16 compute against float32."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from k3jax.vision.config import moonvit_v2
from k3jax.vision.params import _probe, _Vision
from k3jax.vision.batch import pack_media
from k3jax.vision.preprocess import image_media
from tests.k3jax.vision.conftest import image, make_cfg
from tests.tolerances import BF16_MODEL_RTOL


def test_every_parameter_has_logical_axis_names():
    cfg = moonvit_v2()
    shapes = jax.eval_shape(_Vision(cfg, 7168).init, jax.random.PRNGKey(0), _probe(cfg))["params"]
    leaves = jax.tree_util.tree_leaves(shapes, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    assert leaves and all(isinstance(x, nn.Partitioned) and len(x.names) == x.value.ndim for x in leaves)
    wqkv = shapes["vision_tower"]["encoder"]["blocks_0"]["wqkv"]["kernel"]
    assert wqkv.value.shape == (1024, 3, 12, 128) and wqkv.names == ("vision_embed", None, "heads", "head_dim")
    assert shapes["mm_projector"]["proj_2"]["kernel"].names[-1] == "embed"  # D shards like the text model's


def test_bf16_compute_tracks_float32():
    f32 = make_cfg(jnp.float32)
    bf16 = dataclasses.replace(f32.vision, dtype=jnp.bfloat16)
    media = pack_media([[image_media(image(60, 90, 3), f32.vision)], [image_media(image(40, 30, 4), f32.vision)]],
                       f32.vision)
    variables = nn.meta.unbox(jax.jit(_Vision(f32.vision, 64).init)(jax.random.PRNGKey(1), media))
    run = lambda cfg: jax.jit(_Vision(cfg, 64).apply)(variables, media)
    want, got = run(f32.vision), run(bf16)
    assert got.dtype == jnp.bfloat16 and want.dtype == jnp.float32
    valid = np.asarray(media.merged_valid)
    err = jnp.linalg.norm((got.astype(jnp.float32) - want)[valid]) / jnp.linalg.norm(want[valid])
    assert float(err) < BF16_MODEL_RTOL
