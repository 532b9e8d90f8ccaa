"""The two model families the experiments compare, at any width, built from ``k3jax.config`` switches.

K2-style: MLA (RoPE) on every layer, SwiGLU, plain pre-norm residual, full-width routed experts,
E/k = 48, one shared expert, sign-update balancing (DeepSeek-V3, γ = 1e-3).
K3-style: 3 KDA : 1 gated NoPE MLA, SiTU-GLU, Block AttnRes, LatentMoE (latent L = D/2 with the
latent RMSNorm), E/k = 56, two shared experts, Quantile Balancing (histogram).

Everything else is shared, so a difference in loss belongs to these switches: depth (4 layers, one
period of the 3:1 pattern, layer 0 dense), head dims (32, rope 16 in MLA), expert width F = D/2
(each shared expert F too), k = 2 routed experts per token (4 in the ablations' baseline), vocabulary 256 (bytes), sequence 512.
The published ratios (K3: F ≈ 0.43·D, L = D/2; K2: F ≈ 0.29·D) are not copied: a small model with
F = 3D/7 would make the two families differ in one more way than the report's list of changes.
Every mixer, MoE and attention call takes the pure-XLA path: these widths are far below the
kernels' tiles, and the XLA path is the one the CPU tests check.
"""

from __future__ import annotations

import dataclasses

from k3jax.balance import BalanceConfig
from k3jax.config import (AttnResConfig, KDAConfig, MLAConfig, MLPConfig, ModelConfig, MoEConfig, RopeConfig)

FAMILIES = ("k2", "k3")
LAYERS, HEAD_DIM, ROPE_DIM, TOP_K, SEQ_LEN = 4, 32, 16, 2, 512
SPARSITY = {"k2": 48, "k3": 56}  # E / k


def _check_width(width: int) -> None:
    if width < 2 * HEAD_DIM or width % HEAD_DIM:
        raise ValueError(f"width={width} must be a multiple of {HEAD_DIM} and >= {2 * HEAD_DIM}")


def family_model(family: str, width: int, top_k: int = TOP_K) -> ModelConfig:
    """The ``family`` ("k2" or "k3") model of hidden size ``width`` with ``E = (E/k)·top_k`` experts."""
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} must be one of {FAMILIES}")
    _check_width(width)
    k3 = family == "k3"
    heads, expert = width // HEAD_DIM, width // 2
    mla = MLAConfig(num_heads=heads, kv_lora_rank=width // 2, q_lora_rank=width // 2, qk_nope_head_dim=HEAD_DIM,
                    qk_rope_head_dim=ROPE_DIM, v_head_dim=HEAD_DIM, output_gate=k3,
                    rope=None if k3 else RopeConfig(theta=50000.0), attention_implementation="xla")
    kda = KDAConfig(num_heads=heads, head_dim=HEAD_DIM, gate_lower_bound=-5.0, chunk_size=64,
                    implementation="xla") if k3 else None
    moe = MoEConfig(num_experts=SPARSITY[family] * top_k, top_k=top_k, expert_intermediate=expert,
                    num_shared_experts=2 if k3 else 1, shared_intermediate=expert,
                    latent_dim=width // 2 if k3 else None, latent_norm=k3, routed_scaling_factor=1.0,
                    implementation="xla")
    return ModelConfig(
        name=f"{family}_style_d{width}", vocab_size=256, hidden=width, num_layers=LAYERS, kda=kda, mla=mla,
        mlp=MLPConfig(activation="situ" if k3 else "swiglu", dense_intermediate=4 * width, first_dense_layers=1),
        moe=moe, attn_res=AttnResConfig(block_size=2) if k3 else None, max_position=SEQ_LEN,
        balance=BalanceConfig(method="qb_hist" if k3 else "sign"))


def k3_baseline(width: int, top_k: int = 2 * TOP_K) -> ModelConfig:
    """The K3-style model the ablations start from: k = 4 by default, so that its full-width twin
    (`full_width_experts`) still routes k = 2 (with k = 1 the renormalised weight is always 1 and
    the router would get no gradient)."""
    return family_model("k3", width, top_k)


def without_attn_res(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, name=f"{cfg.name}_plain_residual", attn_res=None)


def with_activation(cfg: ModelConfig, activation: str) -> ModelConfig:
    return dataclasses.replace(cfg, name=f"{cfg.name}_{activation}",
                               mlp=dataclasses.replace(cfg.mlp, activation=activation))


def with_softplus_gate(cfg: ModelConfig) -> ModelConfig:
    """Kimi-Linear's unbounded ``g = −exp(A_log)·softplus(z)`` in place of K3's lower-bounded gate."""
    return dataclasses.replace(cfg, name=f"{cfg.name}_softplus_gate",
                               kda=dataclasses.replace(cfg.kda, gate_lower_bound=None))


def full_width_experts(cfg: ModelConfig) -> ModelConfig:
    """LatentMoE's twin at equal active expert FLOPs and equal expert parameters: experts at D
    instead of L = D/2, so half as many of them, half as many per token (E/k and F unchanged).
    Per token the latent model also spends ``2·D·L`` on its down/up projections (reported)."""
    m = cfg.moe
    if m.latent_dim is None or 2 * m.latent_dim != cfg.hidden or m.top_k % 2:
        raise ValueError(f"full_width_experts needs latent_dim = hidden/2 and an even top_k, got {m}")
    moe = dataclasses.replace(m, latent_dim=None, latent_norm=False, num_experts=m.num_experts // 2,
                              top_k=m.top_k // 2)
    return dataclasses.replace(cfg, name=f"{cfg.name}_full_width_experts", moe=moe)


def with_balance(cfg: ModelConfig, method: str) -> ModelConfig:
    return dataclasses.replace(cfg, name=f"{cfg.name}_{method}", balance=BalanceConfig(method=method))
