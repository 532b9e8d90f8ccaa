"""load_hf / save_hf: the tree the model expects, layouts, MXFP4, bitwise round trips, errors."""

import dataclasses
import json
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import config as C
from k3jax.convert import load_hf, save_hf, to_hf_config
from k3jax.layout import to_per_layer, to_scanned
from k3jax.convert.hf_keys import entries
from k3jax.convert.safetensors_io import PendingTensor, SafetensorsReader, write_folder
from k3jax.model import Transformer

ORACLE = "/work/shared/oracle/tiny_a"
P = "language_model.model.layers."


def _tiny_linear() -> C.ModelConfig:
    """A Kimi-Linear-shaped config (softplus gate, low-rank output gate, no q LoRA, plain residual)."""
    k = C.kimi_linear_48b()
    return dataclasses.replace(
        k, vocab_size=64, hidden=32, num_layers=4, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        kda=dataclasses.replace(k.kda, num_heads=2, head_dim=8, output_gate_rank=8),
        mla=dataclasses.replace(k.mla, num_heads=2, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                v_head_dim=8),
        mlp=dataclasses.replace(k.mlp, dense_intermediate=16),
        moe=dataclasses.replace(k.moe, num_experts=4, top_k=2, expert_intermediate=8, shared_intermediate=8))


def _tiny_k2() -> C.ModelConfig:
    k = C.kimi_k2()
    return dataclasses.replace(
        k, vocab_size=64, hidden=32, num_layers=3, max_position=4096, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
        mla=dataclasses.replace(k.mla, num_heads=2, kv_lora_rank=8, q_lora_rank=12, qk_nope_head_dim=8,
                                qk_rope_head_dim=4, v_head_dim=8),
        mlp=dataclasses.replace(k.mlp, dense_intermediate=16),
        moe=dataclasses.replace(k.moe, num_experts=4, top_k=2, expert_intermediate=8, shared_intermediate=8))


CONFIGS = {"oracle": lambda: load_hf(ORACLE + "/hf_bf16")[0], "tiny": C.tiny, "linear": _tiny_linear,
           "k2": _tiny_k2}


def _init(cfg, seed=0):
    tokens = jnp.zeros((1, 4), jnp.int32)
    return nn.unbox(Transformer(cfg).init(jax.random.PRNGKey(seed), tokens))


def _random_variables(cfg, seed=0):
    """Random values in the tree of ``entries(cfg)`` (equal to the model's, checked below), fast."""
    rng = np.random.default_rng(seed)
    wide = jnp.promote_types(cfg.param_dtype, jnp.float32)
    out = {"params": {}, "balance": {}}
    for e in entries(cfg):
        node = out[e.collection]
        for name in e.path[:-1]:
            node = node.setdefault(name, {})
        node[e.path[-1]] = jnp.asarray(rng.normal(size=e.shape), wide if e.wide else cfg.param_dtype)
    return out


def _flat(tree):
    return {jax.tree_util.keystr(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_mapping_covers_the_model_tree(name):
    """Every leaf of ``Transformer(cfg).init`` has exactly one HF tensor, with its shape and dtype."""
    cfg = CONFIGS[name]()
    model = _flat(jax.eval_shape(lambda: to_per_layer(_init(cfg), cfg)))  # HF is per layer
    wide = jnp.promote_types(cfg.param_dtype, jnp.float32)
    mine = {}
    for e in entries(cfg):
        path = "".join(f"['{k}']" for k in (e.collection,) + e.path)
        mine[path] = (e.shape, jnp.dtype(wide if e.wide else cfg.param_dtype))
    assert sorted(mine) == sorted(model)
    for path, leaf in model.items():
        assert mine[path] == (leaf.shape, leaf.dtype), path


@pytest.fixture(scope="module")
def oracle():
    return load_hf(ORACLE + "/hf_bf16"), load_hf(ORACLE + "/hf_mxfp4")


def test_mxfp4_experts_bit_exact(oracle):
    (cfg, v), (cfg4, v4) = oracle
    assert cfg == cfg4
    a, b = _flat(v), _flat(v4)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(np.asarray(a[k]), np.asarray(b[k])), k
    assert v["params"]["stack_1"]["offset_0"]["moe"]["w2"].shape == (2, 16, 32, 32)  # layers 1 and 5
    assert to_per_layer(v, cfg)["params"]["layers_1"]["moe"]["w2"].shape == (16, 32, 32)


def test_layouts_against_raw_tensors(oracle):
    (cfg, v), _ = oracle
    v = to_per_layer(v, cfg)
    raw = SafetensorsReader(ORACLE + "/hf_bf16")
    hf = lambda k: raw.get(k).astype(np.float32)  # noqa: E731
    p = jax.tree.map(np.asarray, v["params"])
    kda, mla, moe = p["layers_0"]["kda"], p["layers_3"]["mla"], p["layers_1"]["moe"]
    H, K = 4, 16
    np.testing.assert_array_equal(kda["q_proj"]["kernel"][5, 2, 7], hf(P + "0.self_attn.q_proj.weight")[2 * K + 7, 5])
    np.testing.assert_array_equal(kda["k_conv"][3, 1, 4], hf(P + "0.self_attn.k_conv1d.weight")[K + 4, 0, 3])
    np.testing.assert_array_equal(kda["o_proj"]["kernel"][3, 9, 11], hf(P + "0.self_attn.o_proj.weight")[11, 3 * K + 9])
    np.testing.assert_array_equal(kda["A_log"], hf(P + "0.self_attn.A_log")[:H])
    np.testing.assert_array_equal(kda["dt_bias"].reshape(-1), hf(P + "0.self_attn.dt_bias"))
    np.testing.assert_array_equal(kda["f_b"]["kernel"][2, 1, 3], hf(P + "0.self_attn.f_b_proj.weight")[K + 3, 2])
    dn, dv = 16, 16
    np.testing.assert_array_equal(mla["kv_b"]["kernel"][4, 2, dn + 1],
                                  hf(P + "3.self_attn.kv_b_proj.weight")[2 * (dn + dv) + dn + 1, 4])
    np.testing.assert_array_equal(mla["q_b"]["kernel"][:, 1, :], hf(P + "3.self_attn.q_b_proj.weight")[24:48].T)
    np.testing.assert_array_equal(moe["w2"][7], hf(P + "1.block_sparse_moe.experts.7.w2.weight").T)
    np.testing.assert_array_equal(moe["router"]["kernel"], hf(P + "1.block_sparse_moe.gate.weight").T)
    np.testing.assert_array_equal(v["balance"]["layers_1"]["moe"]["bias"],
                                  hf(P + "1.block_sparse_moe.gate.e_score_correction_bias"))
    np.testing.assert_array_equal(p["layers_4"]["attn_res"]["query"],
                                  hf(P + "4.self_attention_res_proj.weight")[0])
    np.testing.assert_array_equal(p["head"]["kernel"], hf("language_model.lm_head.weight").T)


@pytest.mark.parametrize("variant, use_mxfp4", [("hf_bf16", False), ("hf_mxfp4", True)])
def test_release_layout_byte_exact(oracle, tmp_path, variant, use_mxfp4):
    """load -> save(bf16 release layout) reproduces every tensor of the oracle byte for byte."""
    (cfg, v), _ = oracle
    save_hf(cfg, v, str(tmp_path), dtype=jnp.bfloat16, mxfp4=use_mxfp4)
    want, got = SafetensorsReader(f"{ORACLE}/{variant}"), SafetensorsReader(str(tmp_path))
    assert got.keys() == want.keys()
    for k in want.keys():
        a, b = want.get(k), got.get(k)
        assert (a.dtype, a.shape) == (b.dtype, b.shape) and np.array_equal(a.view(np.uint8), b.view(np.uint8)), k
    published = json.load(open(f"{ORACLE}/{variant}/config.json"))["text_config"]
    assert json.load(open(tmp_path / "config.json"))["text_config"] == published


def _assert_bitwise(v1, v2):
    a, b = _flat(v1), _flat(v2)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(np.asarray(a[k]).view(np.uint8),
                                                           np.asarray(b[k]).view(np.uint8)), k


def test_oracle_round_trip_bitwise(oracle, tmp_path):
    (cfg, v), _ = oracle
    save_hf(cfg, v, str(tmp_path), max_shard_bytes=200_000)  # several shards
    assert len(set(json.load(open(tmp_path / "model.safetensors.index.json"))["weight_map"].values())) > 1
    cfg2, v2 = load_hf(str(tmp_path))
    assert cfg2 == cfg
    _assert_bitwise(v, v2)


@pytest.mark.parametrize("name", ["tiny", "linear", "k2"])
def test_family_round_trip_bitwise(tmp_path, name):
    """Random parameters of each family survive save -> load bit for bit (fp32 files), and again."""
    cfg = CONFIGS[name]()
    v = _random_variables(cfg, seed=1)
    save_hf(cfg, v, str(tmp_path / "a"))
    cfg2, v2 = load_hf(str(tmp_path / "a"))
    assert dataclasses.replace(cfg2, name=cfg.name) == cfg
    _assert_bitwise(to_scanned(v, cfg), v2)  # loaded in cfg's (scanned) layout
    save_hf(cfg2, v2, str(tmp_path / "b"))
    _assert_bitwise(v2, load_hf(str(tmp_path / "b"))[1])


def _rewrite(tmp_path, edit, config=None):
    """The oracle's bf16 checkpoint with its tensors edited by ``edit(dict)``."""
    raw = SafetensorsReader(ORACLE + "/hf_bf16")
    tensors = {k: np.array(raw.get(k)) for k in raw.keys()}
    edit(tensors)
    write_folder(str(tmp_path), [(k, PendingTensor(t.shape, t.dtype, lambda t=t: t)) for k, t in tensors.items()])
    if config is None:
        shutil.copy(ORACLE + "/hf_bf16/config.json", tmp_path / "config.json")
    else:
        (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


KV_B = P + "3.self_attn.kv_b_proj.weight"


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.pop(KV_B), f"tensor '{KV_B}' is missing"),
    (lambda t: t.update({P + "3.self_attn.extra.weight": np.zeros(2, np.float32)}), "extra.weight' is unexpected"),
    (lambda t: t.update({KV_B: np.zeros((64, 8), np.float32)}), f"'{KV_B}' has shape \\(64, 8\\), expected"),
    (lambda t: t.pop(P + "2.block_sparse_moe.experts.3.w1.weight"), "experts.3.w1.weight' is missing"),
])
def test_load_errors_name_the_key(tmp_path, edit, match):
    with pytest.raises(ValueError, match=match):
        load_hf(_rewrite(tmp_path, edit))


def test_load_wrong_family(tmp_path):
    """K3 tensors under a Kimi-Linear config.json: the K3-only tensors are named as unexpected."""
    cfg = dataclasses.replace(CONFIGS["oracle"](), attn_res=None)
    with pytest.raises(ValueError, match="'kimi_linear' checkpoint"):
        load_hf(_rewrite(tmp_path, lambda t: None, to_hf_config(cfg)))


def test_vision_tensors_are_skipped(tmp_path):
    path = _rewrite(tmp_path, lambda t: t.update({"vision_tower.patch_embed.weight": np.zeros(3, np.float32)}))
    assert load_hf(path)[0].num_layers == 10


def test_float64_needs_x64():
    with pytest.raises(ValueError, match="jax_enable_x64"):
        load_hf(ORACLE + "/hf_bf16", param_dtype=jnp.float64)
    with jax.enable_x64(True):
        cfg, v = load_hf(ORACLE + "/hf_bf16", param_dtype=jnp.float64, dtype=jnp.float64)
        assert v["params"]["embed"]["embedding"].dtype == jnp.float64 and cfg.dtype == jnp.float64


def test_save_errors(oracle, tmp_path):
    (cfg, v), _ = oracle
    v = to_per_layer(v, cfg)  # save_hf takes either layout
    broken = jax.tree.map(lambda x: x, v)
    del broken["params"]["layers_2"]["kda"]["g_proj"]
    with pytest.raises(ValueError, match="layers_2/kda/g_proj"):
        save_hf(cfg, broken, str(tmp_path))
    broken = jax.tree.map(lambda x: x, v)
    broken["params"]["layers_2"]["kda"]["A_log"] = jnp.zeros(5)
    with pytest.raises(ValueError, match="'layers_2/kda/A_log' has shape \\(5,\\)"):
        save_hf(cfg, broken, str(tmp_path))
    broken = jax.tree.map(lambda x: x, v)
    broken["params"]["layers_2"]["kda"]["extra"] = jnp.zeros(5)
    with pytest.raises(ValueError, match="params/layers_2/kda/extra"):
        save_hf(cfg, broken, str(tmp_path))
    with pytest.raises(ValueError, match="mxfp4=True"):
        save_hf(_tiny_linear(), _random_variables(_tiny_linear()), str(tmp_path), mxfp4=True)


def test_load_names_the_missing_folder_the_truncated_file_and_the_index(tmp_path):
    """Issue 27 item 6: each error names the path, the file and tensor, or the index."""
    with pytest.raises(ValueError, match="does not exist"):
        load_hf(str(tmp_path / "nope"))
    cut, gone = tmp_path / "cut", tmp_path / "gone"
    shutil.copytree(ORACLE + "/hf_bf16", cut)
    shutil.copytree(ORACLE + "/hf_bf16", gone)
    with open(cut / "model.safetensors", "r+b") as f:
        f.truncate(100_000)
    with pytest.raises(ValueError, match=r"model.safetensors: tensor '.*' ends at byte \d+, past the end"):
        load_hf(str(cut))
    (gone / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="model.safetensors is missing: model.safetensors.index.json names it"):
        load_hf(str(gone))
