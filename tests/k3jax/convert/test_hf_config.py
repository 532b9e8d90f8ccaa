"""HF config.json <-> ModelConfig: every preset round-trips; the oracle's published form is reproduced."""

import copy
import dataclasses
import json

import jax.numpy as jnp
import pytest

from k3jax import config as C
from k3jax.convert.hf_config import family, from_hf_config, to_hf_config

ORACLE = "/work/shared/oracle/tiny_a"


@pytest.mark.parametrize("name", sorted(C.PRESETS))
def test_presets_round_trip(name):
    cfg = C.preset(name)
    d = json.loads(json.dumps(to_hf_config(cfg)))  # what config.json holds
    assert dataclasses.replace(from_hf_config(d), name=cfg.name) == cfg


@pytest.mark.parametrize("name, model_type", [("kimi_k3", "kimi_k3"), ("kimi_linear_48b", "kimi_linear"),
                                              ("kimi_k2", "kimi_k2"), ("tiny", "kimi_k3")])
def test_family_forms(name, model_type):
    d = to_hf_config(C.preset(name))
    assert d["model_type"] == model_type
    if model_type == "kimi_k3":
        assert d["text_config"]["model_type"] == "kimi_linear" and "text_config" in d


def test_float64_and_chunk_overrides_round_trip():
    cfg = dataclasses.replace(C.to_float64(C.tiny()), kda=dataclasses.replace(C.tiny().kda, chunk_size=8))
    d = to_hf_config(cfg)
    assert d["k3jax_overrides"] == {"kda.chunk_size": 8, "dtype": "float64", "param_dtype": "float64"}
    assert dataclasses.replace(from_hf_config(d), name=cfg.name) == cfg


def test_kimi_k3_preset_has_the_published_layer_lists():
    text = to_hf_config(C.kimi_k3())["text_config"]
    mla = text["linear_attn_config"]["full_attn_layers"]
    assert mla == list(range(4, 93, 4)) + [93] and len(text["linear_attn_config"]["kda_layers"]) == 69
    assert "k3jax_overrides" not in to_hf_config(C.kimi_k3())


@pytest.mark.parametrize("variant", ["hf_bf16", "hf_mxfp4"])
def test_oracle_text_config_reproduced(variant):
    with open(f"{ORACLE}/{variant}/config.json") as f:
        published = json.load(f)
    cfg = from_hf_config(f"{ORACLE}/{variant}")
    assert family(cfg) == "kimi_k3" and cfg.layer_kinds[9] is C.LayerKind.MLA and cfg.mla_layers is None
    assert (cfg.kda.gate_lower_bound, cfg.kda.output_gate_rank, cfg.moe.latent_dim) == (-5.0, None, 32)
    text = to_hf_config(cfg)["text_config"]
    published["text_config"].pop("quantization_config", None)
    assert text == published["text_config"]


def _k3_dict():
    with open(f"{ORACLE}/hf_bf16/config.json") as f:
        return json.load(f)


def _mutate(d, path, value):
    d = copy.deepcopy(d)
    node = d
    for name in path[:-1]:
        node = node[name]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return d


@pytest.mark.parametrize("path, value, match", [
    (("model_type",), "llama", "model_type='llama' must be one of"),
    (("text_config",), KeyError, "text_config is required"),
    (("text_config", "model_type"), "deepseek_v3", "text_config.model_type"),
    (("text_config", "hidden_size"), KeyError, "hidden_size is required"),
    (("text_config", "hidden_act"), "gelu", "hidden_act='gelu'"),
    (("text_config", "linear_attn_config", "kda_layers"), [1, 2], "kda_layers"),
    (("text_config", "num_expert_group"), 8, "num_expert_group=8"),
    (("text_config", "num_key_value_heads"), 2, "num_key_value_heads"),
    (("text_config", "attn_res_block_size"), KeyError, "attn_res_block_size is required"),
    (("k3jax_overrides",), {"kda.nope": 1}, "k3jax_overrides key 'kda.nope'"),
    (("text_config", "quantization_config"), {"format": "nvfp4-pack-quantized"}, "quantization_config format"),
])
def test_errors_name_the_field(path, value, match):
    with pytest.raises(ValueError, match=match):
        from_hf_config(_mutate(_k3_dict(), path, value))


def test_transformers_flat_kimi_linear_form():
    """transformers' KimiLinearConfig spellings (layer_types, model_max_length, mlp_layer_types)."""
    d = to_hf_config(C.kimi_linear_48b())
    kinds = C.kimi_linear_48b().layer_kinds
    flat = {k: v for k, v in d.items() if k not in ("linear_attn_config", "max_position_embeddings")}
    flat.update(linear_num_heads=32, linear_head_dim=128, linear_conv_kernel_dim=4, model_max_length=1048576,
                layer_types=["full_attention" if k is C.LayerKind.MLA else "linear_attention" for k in kinds],
                mlp_layer_types=["dense"] + ["sparse"] * 26)
    assert dataclasses.replace(from_hf_config(flat), name="kimi_linear_48b") == C.kimi_linear_48b()
    flat["mlp_layer_types"] = ["sparse"] * 27
    with pytest.raises(ValueError, match="mlp_layer_types"):
        from_hf_config(flat)


def test_to_hf_config_rejects_inexpressible():
    cfg = dataclasses.replace(C.kimi_linear_48b(), mla=dataclasses.replace(C.kimi_linear_48b().mla,
                                                                            rope=C.RopeConfig()))
    with pytest.raises(ValueError, match="mla.rope"):
        to_hf_config(cfg)


def test_from_file_and_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(C.tiny())))
    assert from_hf_config(str(tmp_path)) == from_hf_config(str(tmp_path / "config.json"))
    with pytest.raises(ValueError, match="config"):
        from_hf_config(str(tmp_path / "nowhere"))
    assert jnp.dtype(from_hf_config(str(tmp_path)).dtype) == jnp.bfloat16
