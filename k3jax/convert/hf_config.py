"""Hugging Face ``config.json`` <-> ``ModelConfig`` for the three Kimi families (SPEC §1, §12).

Forms read and written:

- Kimi K3: top-level ``model_type: kimi_k3`` wrapping a ``text_config`` (itself ``kimi_linear``-typed)
  with explicit 1-based ``linear_attn_config.{kda_layers, full_attn_layers}``, ``gate_lower_bound``,
  ``use_full_rank_gate``, ``attn_res_block_size``, ``routed_expert_hidden_size``, SiTU betas.
- Kimi-Linear: the same text fields, flat, ``model_type: kimi_linear`` (transformers'
  ``KimiLinearConfig``; its flat ``linear_*`` / ``layer_types`` spellings are read too).
- Kimi K2: DeepSeek-V3 fields (``model_type: kimi_k2`` or ``deepseek_v3``), RoPE + YaRN.

Settings with no Hugging Face field (kernel chunk sizes, implementations, balancing, dtypes) are
written, only where they differ from what the Hugging Face fields alone give, under
``k3jax_overrides`` as ``{"section.field": value}``, so every config round-trips exactly.
"""

from __future__ import annotations

import json
import os
from typing import Any

from k3jax.config import (AttnResConfig, KDAConfig, LayerKind, MLAConfig, MLPConfig, ModelConfig, MoEConfig,
                          MTPConfig, RopeConfig, hybrid_mla_layers)
from k3jax.convert.hf_overrides import OVERRIDES, apply_overrides, leaves, to_json

K3_TYPE, LINEAR_TYPE, K2_TYPES = "kimi_k3", "kimi_linear", ("kimi_k2", "deepseek_v3")
MODEL_TYPES = (K3_TYPE, LINEAR_TYPE, *K2_TYPES)
_ACTIVATIONS = {"situ": "situ", "silu": "swiglu"}


class _Fields:
    """Reads named fields of one config dict; errors name the field with its path."""

    def __init__(self, d: dict, where: str):
        if not isinstance(d, dict):
            raise ValueError(f"{where} must be a dict, got {type(d).__name__}")
        self.d, self.where = d, where

    def need(self, *names: str) -> Any:
        for name in names:
            if self.d.get(name) is not None:
                return self.d[name]
        raise ValueError(f"{self.where}.{names[0]} is required (missing from the config)")

    def opt(self, default: Any, *names: str) -> Any:
        for name in names:
            if self.d.get(name) is not None:
                return self.d[name]
        return default

    def expect(self, name: str, allowed: tuple, default: Any = None) -> Any:
        value = self.d.get(name, default)
        if value not in allowed:
            raise ValueError(f"{self.where}.{name}={value!r} must be one of {allowed} (unsupported otherwise)")
        return value


def _load_dict(config: dict | str | os.PathLike) -> dict:
    if isinstance(config, dict):
        return config
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"config={config!r} must be a dict, a config.json file or a folder holding one")
    with open(path) as f:
        return json.load(f)


def _token(value) -> int | None:
    return value[0] if isinstance(value, list) and value else value


def _mla_layers_from(f: _Fields, num_layers: int) -> tuple[int, ...] | None:
    """0-based MLA layers from ``linear_attn_config`` (1-based) or transformers' ``layer_types``."""
    lac = f.opt({}, "linear_attn_config")
    if "full_attn_layers" in lac or "kda_layers" in lac:
        full = [int(l) - 1 for l in lac.get("full_attn_layers", [])]
        kda = [int(l) - 1 for l in lac.get("kda_layers", [])]
        if sorted(full + kda) != list(range(num_layers)):
            raise ValueError(f"{f.where}.linear_attn_config.kda_layers={lac.get('kda_layers')} and full_attn_layers="
                             f"{lac.get('full_attn_layers')} must partition the 1-based layers 1..{num_layers}")
        mla = tuple(sorted(full))
    elif f.opt(None, "layer_types") is not None:
        types = f.need("layer_types")
        if len(types) != num_layers or set(types) - {"full_attention", "linear_attention"}:
            raise ValueError(f"{f.where}.layer_types={types} must hold {num_layers} of "
                             "'full_attention' / 'linear_attention'")
        mla = tuple(i for i, t in enumerate(types) if t == "full_attention")
    else:
        raise ValueError(f"{f.where}.linear_attn_config.full_attn_layers is required (the layer pattern)")
    return None if mla == hybrid_mla_layers(num_layers) else mla


def _check_quantization(f: _Fields) -> None:
    """Only the release's MXFP4 experts (compressed-tensors, group 32) are decoded on load."""
    q = f.opt(None, "quantization_config")
    if q is None:
        return
    fmt = q.get("format")
    groups = [g.get("weights", {}).get("group_size") for g in q.get("config_groups", {}).values()]
    if fmt != "mxfp4-pack-quantized" or any(g != 32 for g in groups):
        raise ValueError(f"{f.where}.quantization_config format={fmt!r}, group sizes {groups} must be "
                         "'mxfp4-pack-quantized' with group_size 32 (the K3 release format)")


def _first_dense(f: _Fields, num_layers: int) -> int:
    """Dense layers lead the stack: ``first_k_dense_replace``, checked against transformers' ``mlp_layer_types``."""
    first = f.opt(1, "first_k_dense_replace")
    types = f.opt(None, "mlp_layer_types")
    if types is not None and list(types) != ["dense"] * first + ["sparse"] * (num_layers - first):
        raise ValueError(f"{f.where}.mlp_layer_types={types} must be {first} 'dense' then 'sparse' "
                         f"(first_k_dense_replace={first})")
    return first


def _text_config(d: dict, where: str) -> ModelConfig:
    """The Kimi-Linear text fields (shared by Kimi-Linear and K3's ``text_config``)."""
    f = _Fields(d, where)
    num_layers = f.need("num_hidden_layers")
    lac = _Fields(f.opt({}, "linear_attn_config"), f"{where}.linear_attn_config")
    kda_heads = lac.opt(None, "num_heads") or f.opt(None, "linear_num_heads")
    head_dim = lac.opt(None, "head_dim") or f.opt(None, "linear_head_dim")
    if kda_heads is None or head_dim is None:
        raise ValueError(f"{where}.linear_attn_config.num_heads and .head_dim are required")
    kda = KDAConfig(num_heads=kda_heads, head_dim=head_dim,
                    conv_size=lac.opt(None, "short_conv_kernel_size") or f.opt(4, "linear_conv_kernel_dim"),
                    gate_lower_bound=lac.opt(None, "gate_lower_bound"),
                    output_gate_rank=None if lac.opt(False, "use_full_rank_gate") else head_dim)
    heads = f.need("num_attention_heads")
    if f.opt(heads, "num_key_value_heads") != heads:
        raise ValueError(f"{where}.num_key_value_heads={f.d['num_key_value_heads']} must equal "
                         f"num_attention_heads={heads} (MLA has no grouped KV)")
    f.expect("mla_use_nope", (True,), default=True)
    mla = MLAConfig(num_heads=heads, kv_lora_rank=f.need("kv_lora_rank"), q_lora_rank=f.opt(None, "q_lora_rank"),
                    qk_nope_head_dim=f.need("qk_nope_head_dim"), qk_rope_head_dim=f.need("qk_rope_head_dim"),
                    v_head_dim=f.need("v_head_dim"), output_gate=bool(f.opt(False, "mla_use_output_gate")))
    activation = _ACTIVATIONS[f.expect("hidden_act", tuple(_ACTIVATIONS))]
    mlp = MLPConfig(activation=activation, situ_beta=f.opt(4.0, "activation_situ_beta"),
                    situ_linear_beta=f.opt(25.0, "activation_situ_linear_beta"),
                    dense_intermediate=f.need("intermediate_size"), first_dense_layers=_first_dense(f, num_layers))
    moe = _moe(f, num_experts=f.need("num_experts", "num_local_experts"),
               top_k=f.need("num_experts_per_token", "num_experts_per_tok"),
               shared=f.opt(1, "num_shared_experts", "n_shared_experts"),
               latent=f.opt(None, "routed_expert_hidden_size"), latent_norm=bool(f.opt(False, "latent_moe_use_norm")),
               renorm=f.opt(True, "moe_renormalize", "norm_topk_prob"),
               groups=("num_expert_group", "n_group"), router_fn="moe_router_activation_func")
    _check_quantization(f)
    eps = f.need("rms_norm_eps")
    block = f.opt(None, "attn_res_block_size")
    return ModelConfig(
        name=where.split(".")[0], vocab_size=f.need("vocab_size"), hidden=f.need("hidden_size"),
        num_layers=num_layers, kda=kda, mla=mla, mlp=mlp, moe=moe,
        attn_res=None if block is None else AttnResConfig(block_size=block, eps=eps),
        mla_layers=_mla_layers_from(f, num_layers), **_common(f, eps))


def _moe(f: _Fields, *, num_experts, top_k, shared, latent, latent_norm, renorm, groups, router_fn) -> MoEConfig:
    f.expect("moe_layer_freq", (1,), default=1)
    for name in groups + ("topk_group",):
        f.expect(name, (None, 1))
    f.expect(router_fn, ("sigmoid",), default="sigmoid")
    width = f.need("moe_intermediate_size")
    return MoEConfig(num_experts=num_experts, top_k=top_k, expert_intermediate=width, num_shared_experts=shared,
                     shared_intermediate=width, latent_dim=latent, latent_norm=latent_norm,
                     routed_scaling_factor=float(f.opt(1.0, "routed_scaling_factor")), renormalize=bool(renorm))


def _common(f: _Fields, eps: float) -> dict:
    return dict(rms_norm_eps=eps, max_position=f.need("max_position_embeddings", "model_max_length"),
                mtp=MTPConfig(num_layers=f.opt(0, "num_nextn_predict_layers")),
                tie_embeddings=bool(f.opt(False, "tie_word_embeddings")),
                initializer_range=f.opt(0.02, "initializer_range"),
                bos_token_id=_token(f.opt(None, "bos_token_id")), eos_token_id=_token(f.opt(None, "eos_token_id")),
                pad_token_id=_token(f.opt(None, "pad_token_id")))


def _k2_config(d: dict, where: str) -> ModelConfig:
    f = _Fields(d, where)
    f.expect("scoring_func", ("sigmoid",), default="sigmoid")
    heads = f.need("num_attention_heads")
    scaling = _Fields(f.opt({}, "rope_scaling"), f"{where}.rope_scaling")
    if scaling.d:
        scaling.expect("type", ("yarn",), default=scaling.d.get("rope_type"))
    rope = RopeConfig(theta=f.need("rope_theta"), yarn_factor=scaling.opt(None, "factor"),
                      yarn_original_max_position=scaling.opt(4096, "original_max_position_embeddings"),
                      yarn_beta_fast=scaling.opt(1.0, "beta_fast"), yarn_beta_slow=scaling.opt(1.0, "beta_slow"),
                      yarn_mscale=scaling.opt(1.0, "mscale"), yarn_mscale_all_dim=scaling.opt(1.0, "mscale_all_dim"))
    mla = MLAConfig(num_heads=heads, kv_lora_rank=f.need("kv_lora_rank"), q_lora_rank=f.opt(None, "q_lora_rank"),
                    qk_nope_head_dim=f.need("qk_nope_head_dim"), qk_rope_head_dim=f.need("qk_rope_head_dim"),
                    v_head_dim=f.need("v_head_dim"), output_gate=False, rope=rope)
    f.expect("hidden_act", ("silu",), default="silu")
    mlp = MLPConfig(activation="swiglu", dense_intermediate=f.need("intermediate_size"),
                    first_dense_layers=f.opt(0, "first_k_dense_replace"))
    moe = _moe(f, num_experts=f.need("n_routed_experts"), top_k=f.need("num_experts_per_tok"),
               shared=f.opt(0, "n_shared_experts"), latent=None, latent_norm=False,
               renorm=f.opt(True, "norm_topk_prob"), groups=("n_group",), router_fn="scoring_func")
    eps = f.need("rms_norm_eps")
    return ModelConfig(name=f.opt("kimi_k2", "model_type"), vocab_size=f.need("vocab_size"),
                       hidden=f.need("hidden_size"), num_layers=f.need("num_hidden_layers"), kda=None, mla=mla,
                       mlp=mlp, moe=moe, attn_res=None, **_common(f, eps))


def from_hf_config(config: dict | str | os.PathLike) -> ModelConfig:
    """A ``ModelConfig`` from a Hugging Face ``config.json`` (dict, file or folder) of any Kimi family."""
    d = _load_dict(config)
    model_type = d.get("model_type")
    if model_type == K3_TYPE:
        text = d.get("text_config")
        if not isinstance(text, dict):
            raise ValueError("text_config is required for model_type='kimi_k3' (the K3 text model lives there)")
        if text.get("model_type", LINEAR_TYPE) != LINEAR_TYPE:
            raise ValueError(f"text_config.model_type={text.get('model_type')!r} must be {LINEAR_TYPE!r}")
        cfg = _text_config(text, "kimi_k3.text_config")
        if cfg.attn_res is None:
            raise ValueError("text_config.attn_res_block_size is required for model_type='kimi_k3'")
    elif model_type == LINEAR_TYPE:
        cfg = _text_config(d, LINEAR_TYPE)
    elif model_type in K2_TYPES:
        cfg = _k2_config(d, model_type)
    else:
        raise ValueError(f"model_type={model_type!r} must be one of {MODEL_TYPES}")
    return apply_overrides(cfg, d.get(OVERRIDES, {}))


# --- overrides: settings without a Hugging Face field (k3jax.convert.hf_overrides) --------------------


def overrides_of(cfg: ModelConfig, base: ModelConfig) -> dict[str, Any]:
    """Fields where ``cfg`` differs from ``base`` (the config its HF fields alone give), name aside."""
    mine, theirs = leaves(cfg), leaves(base)
    if set(mine) != set(theirs):
        odd = sorted(set(mine) ^ set(theirs))[0]
        raise ValueError(f"{odd.rsplit('.', 1)[0]}: this section cannot be expressed in the "
                         f"{family(cfg)!r} Hugging Face form")
    return {p: to_json(p, v) for p, v in mine.items() if p != "name" and theirs[p] != v}


def family(cfg: ModelConfig) -> str:
    """The Hugging Face form a config is written in: ``kimi_k3``, ``kimi_linear`` or ``kimi_k2``."""
    if cfg.kda is None:
        return "kimi_k2"
    return K3_TYPE if cfg.attn_res is not None else LINEAR_TYPE


def _linear_text(cfg: ModelConfig) -> dict:
    """The Kimi-Linear text fields of ``cfg`` (K3's ``text_config`` adds its own on top)."""
    kda, mla, mlp, moe = cfg.kda, cfg.mla, cfg.mlp, cfg.moe
    if mla.rope is not None:
        raise ValueError("mla.rope must be None (NoPE) in the Kimi-Linear / K3 forms")
    if moe.shared_intermediate != moe.expert_intermediate and moe.num_shared_experts:
        raise ValueError(f"moe.shared_intermediate={moe.shared_intermediate} must equal expert_intermediate="
                         f"{moe.expert_intermediate}: HF sizes shared experts by moe_intermediate_size")
    kinds = cfg.layer_kinds
    return {
        "architectures": ["KimiLinearForCausalLM"], "model_type": LINEAR_TYPE, "dtype": "bfloat16",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden, "num_hidden_layers": cfg.num_layers,
        "hidden_act": {v: k for k, v in _ACTIVATIONS.items()}[mlp.activation],
        "intermediate_size": mlp.dense_intermediate, "first_k_dense_replace": mlp.first_dense_layers,
        "linear_attn_config": {
            "full_attn_layers": [i + 1 for i, k in enumerate(kinds) if k is LayerKind.MLA],
            "kda_layers": [i + 1 for i, k in enumerate(kinds) if k is LayerKind.KDA],
            "head_dim": kda.head_dim, "num_heads": kda.num_heads, "short_conv_kernel_size": kda.conv_size},
        "num_attention_heads": mla.num_heads, "num_key_value_heads": mla.num_heads,
        "q_lora_rank": mla.q_lora_rank, "kv_lora_rank": mla.kv_lora_rank, "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim, "v_head_dim": mla.v_head_dim, "mla_use_nope": True,
        "num_experts": moe.num_experts, "num_experts_per_token": moe.top_k,
        "moe_intermediate_size": moe.expert_intermediate, "num_shared_experts": moe.num_shared_experts,
        "moe_layer_freq": 1, "moe_renormalize": moe.renormalize, "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": moe.routed_scaling_factor, "num_expert_group": 1, "topk_group": 1,
        "topk_method": "noaux_tc", "use_grouped_topk": True,
        **_common_dict(cfg),
    }


def _common_dict(cfg: ModelConfig) -> dict:
    return {"rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": cfg.max_position,
            "num_nextn_predict_layers": cfg.mtp.num_layers, "tie_word_embeddings": cfg.tie_embeddings,
            "initializer_range": cfg.initializer_range, "bos_token_id": cfg.bos_token_id,
            "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id, "use_cache": True}


def _k3_dict(cfg: ModelConfig) -> dict:
    text = _linear_text(cfg)
    text["linear_attn_config"].update(gate_lower_bound=cfg.kda.gate_lower_bound,
                                      use_full_rank_gate=cfg.kda.output_gate_rank is None)
    text.update(attn_res_block_size=cfg.attn_res.block_size, mla_use_output_gate=cfg.mla.output_gate,
                activation_situ_beta=cfg.mlp.situ_beta, activation_situ_linear_beta=cfg.mlp.situ_linear_beta,
                routed_expert_hidden_size=cfg.moe.latent_dim, latent_moe_use_norm=cfg.moe.latent_norm)
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": K3_TYPE, "dtype": "bfloat16",
            "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
            "tie_word_embeddings": cfg.tie_embeddings, "text_config": dict(sorted(text.items()))}


def _flat_linear_dict(cfg: ModelConfig) -> dict:
    text = _linear_text(cfg)
    kda = cfg.kda
    # K3-only switches appear in the flat form only when set, so plain Kimi-Linear configs stay plain.
    if kda.gate_lower_bound is not None:
        text["linear_attn_config"]["gate_lower_bound"] = kda.gate_lower_bound
    if kda.output_gate_rank is None:
        text["linear_attn_config"]["use_full_rank_gate"] = True
    elif kda.output_gate_rank != kda.head_dim:
        raise ValueError(f"kda.output_gate_rank={kda.output_gate_rank} must be None or head_dim={kda.head_dim}")
    if cfg.mla.output_gate:
        text["mla_use_output_gate"] = True
    if cfg.moe.latent_dim is not None:
        text.update(routed_expert_hidden_size=cfg.moe.latent_dim, latent_moe_use_norm=cfg.moe.latent_norm)
    if cfg.mlp.activation == "situ":
        text.update(activation_situ_beta=cfg.mlp.situ_beta, activation_situ_linear_beta=cfg.mlp.situ_linear_beta)
    return dict(sorted(text.items()))


def _k2_dict(cfg: ModelConfig) -> dict:
    mla, mlp, moe, rope = cfg.mla, cfg.mlp, cfg.moe, cfg.mla.rope
    if rope is None or mla.output_gate or mlp.activation != "swiglu" or moe.latent_dim is not None:
        raise ValueError("the kimi_k2 form needs mla.rope set, mla.output_gate=False, mlp.activation='swiglu' "
                         "and moe.latent_dim=None")
    scaling = None if rope.yarn_factor is None else {
        "type": "yarn", "factor": rope.yarn_factor, "original_max_position_embeddings": rope.yarn_original_max_position,
        "beta_fast": rope.yarn_beta_fast, "beta_slow": rope.yarn_beta_slow, "mscale": rope.yarn_mscale,
        "mscale_all_dim": rope.yarn_mscale_all_dim}
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "dtype": "bfloat16",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden, "num_hidden_layers": cfg.num_layers,
        "hidden_act": "silu", "intermediate_size": mlp.dense_intermediate,
        "first_k_dense_replace": mlp.first_dense_layers, "moe_layer_freq": 1,
        "num_attention_heads": mla.num_heads, "num_key_value_heads": mla.num_heads, "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank, "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim, "v_head_dim": mla.v_head_dim,
        "rope_theta": rope.theta, "rope_scaling": scaling, "attention_bias": False,
        "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.expert_intermediate, "n_shared_experts": moe.num_shared_experts,
        "norm_topk_prob": moe.renormalize, "scoring_func": "sigmoid", "routed_scaling_factor": moe.routed_scaling_factor,
        "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", **_common_dict(cfg),
    }


def to_hf_config(cfg: ModelConfig) -> dict:
    """The Hugging Face ``config.json`` dict of ``cfg`` in its family's own form (the inverse of
    ``from_hf_config``)."""
    write = {K3_TYPE: _k3_dict, LINEAR_TYPE: _flat_linear_dict, "kimi_k2": _k2_dict}[family(cfg)]
    d = write(cfg)
    extra = overrides_of(cfg, from_hf_config(d))
    if extra:
        d[OVERRIDES] = extra
    return d


__all__ = ["from_hf_config", "to_hf_config", "family"]
