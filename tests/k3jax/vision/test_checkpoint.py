"""HF checkpoints with a vision tower: save_hf -> load_hf is exact, and a folder written with
safetensors directly (independently of save_hf, from the key table in this file) loads exactly."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from k3jax.convert.save import save_hf as save_text
from k3jax.vision import checkpoint
from k3jax.vision.config import moonvit_k25, tiny_vision
from k3jax.vision.params import tower_params
from tests.k3jax.vision.conftest import make_cfg


def _random_like(tree, seed):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(rng.standard_normal(x.shape), x.dtype) for x in leaves])


def _variables(cfg, seed=0):
    from k3jax.vision.model import MultimodalTransformer
    from k3jax.vision.params import _probe
    import flax.linen as nn
    tokens = jnp.zeros((1, 4), jnp.int32)
    shapes = jax.eval_shape(MultimodalTransformer(cfg).init, jax.random.PRNGKey(0), tokens, _probe(cfg.vision))
    return _random_like(nn.meta.unbox(shapes), seed)


def _assert_equal(a, b):
    fa, fb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
    assert [p for p, _ in fa] == [p for p, _ in fb]
    for (p, x), (_, y) in zip(fa, fb):
        assert x.dtype == y.dtype and x.shape == y.shape, p
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(p))


@pytest.mark.parametrize("vision", [tiny_vision(), moonvit_k25(hidden=24, num_layers=1, num_heads=2, head_dim=8,
                                                                 mlp_dim=40, pos_grid=(3, 5))])
def test_save_load_roundtrip_is_exact(tmp_path, vision):
    cfg = dataclasses.replace(make_cfg(), vision=vision)
    variables = _variables(cfg)
    checkpoint.save_hf(cfg, variables, str(tmp_path))
    got_cfg, got = checkpoint.load_hf(str(tmp_path))
    assert got_cfg.vision == dataclasses.replace(vision, name="hf", dtype=got_cfg.text.dtype)
    assert got_cfg.media_token_id == cfg.media_token_id
    _assert_equal(got, variables)


def test_independently_written_checkpoint_loads_exactly(tmp_path):
    """Tower tensors written by hand in the PyTorch layouts; the text part by the text writer."""
    cfg = make_cfg()
    v, D = cfg.vision, cfg.text.hidden
    W, H, K, F, p = v.hidden, v.num_heads, v.head_dim, v.mlp_dim, v.patch_size
    rng = np.random.default_rng(1)
    t = {"vision_tower.patch_embed.proj.weight": rng.standard_normal((W, 3, p, p)),
         "vision_tower.patch_embed.pos_emb.weight": rng.standard_normal(v.pos_grid + (W,)),
         "vision_tower.encoder.final_layernorm.weight": rng.standard_normal(W),
         "mm_projector.proj.0.weight": rng.standard_normal((4 * W, 4 * W)),
         "mm_projector.proj.2.weight": rng.standard_normal((D, 4 * W)),
         "mm_projector.post_norm.weight": rng.standard_normal(D)}
    for i in range(v.num_layers):
        b = f"vision_tower.encoder.blocks.{i}."
        t |= {b + "norm0.weight": rng.standard_normal(W), b + "norm1.weight": rng.standard_normal(W),
              b + "wqkv.weight": rng.standard_normal((3 * H * K, W)), b + "wo.weight": rng.standard_normal((W, H * K)),
              b + "mlp.fc0.weight": rng.standard_normal((F, W)), b + "mlp.fc1.weight": rng.standard_normal((W, F))}
    t = {k: a.astype(np.float32) for k, a in t.items()}
    text_vars = _variables(cfg, 2)
    save_text(cfg.text, {"params": text_vars["params"]["language_model"],
                         "balance": text_vars["balance"]["language_model"]}, str(tmp_path))
    save_file(t, str(tmp_path / "vision.safetensors"))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"] |= {k: "vision.safetensors" for k in t}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((tmp_path / "config.json").read_text())
    config |= {"media_placeholder_token_id": cfg.media_token_id, "vision_config": {
        "patch_size": p, "vt_hidden_size": W, "vt_num_hidden_layers": v.num_layers, "vt_num_attention_heads": H,
        "qkv_hidden_size": H * K, "vt_intermediate_size": F, "norm_type": "rmsnorm", "linear_bias": False,
        "attn_bias": False, "patch_embed_proj_bias": False, "init_pos_emb_height": v.pos_grid[0],
        "init_pos_emb_width": v.pos_grid[1], "init_pos_emb_time": 4, "pos_emb_interpolation_mode": "bilinear",
        "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2",
        "mm_hidden_size": W, "projector_ln_eps": 1e-5, "text_hidden_size": D}}
    (tmp_path / "config.json").write_text(json.dumps(config))

    got_cfg, got = checkpoint.load_hf(str(tmp_path))
    P = got["params"]
    blk = P["vision_tower"]["encoder"]["blocks_1"]
    # Conv2d [W, C, p, p] -> kernel [C·p·p, W]: patch pixels flattened (C, py, px).
    np.testing.assert_array_equal(P["vision_tower"]["patch_embed"]["proj"]["kernel"],
                                  t["vision_tower.patch_embed.proj.weight"].reshape(W, -1).T)
    wqkv = t["vision_tower.encoder.blocks.1.wqkv.weight"]  # rows (q|k|v, head, dim)
    for s in range(3):
        for h in range(H):
            rows = wqkv[(s * H + h) * K:(s * H + h + 1) * K]
            np.testing.assert_array_equal(blk["wqkv"]["kernel"][:, s, h, :], rows.T)
    np.testing.assert_array_equal(blk["wo"]["kernel"].reshape(H * K, W), t["vision_tower.encoder.blocks.1.wo.weight"].T)
    np.testing.assert_array_equal(blk["fc0"]["kernel"], t["vision_tower.encoder.blocks.1.mlp.fc0.weight"].T)
    np.testing.assert_array_equal(P["vision_tower"]["patch_embed"]["pos_emb"],
                                  t["vision_tower.patch_embed.pos_emb.weight"])
    np.testing.assert_array_equal(P["mm_projector"]["proj_2"]["kernel"], t["mm_projector.proj.2.weight"].T)
    np.testing.assert_array_equal(P["mm_projector"]["post_norm"]["scale"], t["mm_projector.post_norm.weight"])
    _assert_equal(got["params"]["language_model"], text_vars["params"]["language_model"])
    _assert_equal(got["balance"], text_vars["balance"])

    # A missing or an unexpected vision tensor is refused, naming it.
    save_file({**t, "vision_tower.extra.weight": np.zeros(2, np.float32)}, str(tmp_path / "vision.safetensors"))
    index["weight_map"]["vision_tower.extra.weight"] = "vision.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="'vision_tower.extra.weight' is unexpected"):
        checkpoint.load_hf(str(tmp_path))


def test_tower_sizes():
    from k3jax.vision.config import moonvit_v2
    assert abs(tower_params(moonvit_v2()) - 0.401e9) < 0.001e9  # ~0.4 B (SPEC §9)
    assert tower_params(moonvit_k25()) > tower_params(moonvit_v2())


def test_orbax_round_trip_of_the_multimodal_tree(tmp_path):
    import orbax.checkpoint as ocp

    variables = _variables(make_cfg(), 3)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "state", variables)
        ckpt.wait_until_finished()
        _assert_equal(ckpt.restore(tmp_path / "state"), variables)
