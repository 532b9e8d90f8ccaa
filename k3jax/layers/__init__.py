"""The layers of the Kimi-family models: norms, KDA, gated MLA, MoE, MLP, Block AttnRes."""

from k3jax.layers.attn_res import AttnResMix, ResidualStream, attn_res_mix
from k3jax.layers.block import DecoderLayer
from k3jax.layers.kda import KDA, decay_gate
from k3jax.layers.mla import MLA, causal_attention
from k3jax.layers.mlp import MLP
from k3jax.layers.moe import MoE, route
from k3jax.layers.norm import RMSNorm, l2_normalize, rms_norm

__all__ = [
    "KDA", "MLA", "MLP", "AttnResMix", "DecoderLayer", "MoE", "RMSNorm", "ResidualStream",
    "attn_res_mix", "causal_attention", "decay_gate", "l2_normalize", "rms_norm", "route",
]
