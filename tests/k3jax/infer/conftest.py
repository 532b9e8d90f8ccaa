"""The decode tests' models: tiny() K3 (float32) and a tiny Kimi-Linear-shaped model, shared by the session."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from k3jax import config
from k3jax.model import Transformer


def kimi_linear_tiny() -> config.ModelConfig:
    """Kimi-Linear's features at tiny() sizes: softplus decay, low-rank gate, plain residual, SwiGLU,
    full-width experts, no q LoRA, no MLA output gate."""
    t = dataclasses.replace(config.tiny(), dtype=jnp.float32)
    return dataclasses.replace(
        t, name="kimi_linear_tiny", attn_res=None,
        kda=dataclasses.replace(t.kda, gate_lower_bound=None, output_gate_rank=8),
        mla=dataclasses.replace(t.mla, q_lora_rank=None, output_gate=False),
        mlp=dataclasses.replace(t.mlp, activation="swiglu"),
        moe=dataclasses.replace(t.moe, latent_dim=None, latent_norm=False, routed_scaling_factor=2.446))


@pytest.fixture(scope="session", params=["tiny", "kimi_linear_tiny"])
def model(request, tiny_model):
    if request.param == "tiny":
        return tiny_model.cfg, tiny_model.variables
    cfg = kimi_linear_tiny()
    variables = nn.meta.unbox(jax.jit(Transformer(cfg).init)(jax.random.key(1, impl="unsafe_rbg"),
                                                            jnp.zeros((1, 8), jnp.int32)))
    return cfg, variables
