"""The tower alone: logical axis names, bf16 against float32, jit == eager, gradients reach every parameter."""

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
from tests.tolerances import BF16_MODEL_RTOL, F32_RTOL


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


def test_tower_jit_equals_eager_and_every_parameter_learns():
    cfg = make_cfg(jnp.float32).vision
    media = pack_media([[image_media(image(84, 84, 5), cfg)], [image_media(image(30, 50, 6), cfg)]], cfg)
    model = _Vision(cfg, 64)
    variables = nn.meta.unbox(jax.jit(model.init)(jax.random.PRNGKey(2), media))
    eager = model.apply(variables, media)
    jitted = jax.jit(model.apply)(variables, media)
    assert float(jnp.linalg.norm(jitted - eager) / jnp.linalg.norm(eager)) < F32_RTOL
    target = jax.random.normal(jax.random.PRNGKey(3), eager.shape)
    valid = jnp.asarray(media.merged_valid)[..., None]
    loss = lambda p: jnp.sum(jnp.where(valid, model.apply({"params": p}, media) * target, 0.0))
    grads = jax.jit(jax.grad(loss))(variables["params"])
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        assert float(jnp.abs(g).max()) > 0, jax.tree_util.keystr(path)
    assert bool(jnp.all(jnp.abs(grads["vision_tower"]["patch_embed"]["pos_emb"]).max(-1) > 0))
