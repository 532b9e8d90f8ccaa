"""The dense gated MLP: K3's first layer and the fused shared experts (SPEC §4).

``y = W_down act(W_gate x, W_up x)`` with ``act`` SiTU-GLU (K3) or SwiGLU (Kimi-Linear, K2); the
activation runs in fp32 (``pallas_kernels.moe.activations``, shared with the routed experts), and
its backward keeps the gate and up products and recomputes the derivatives (``split_gated_activation``).
"""

from __future__ import annotations

import flax.linen as nn
from jaxtyping import Array, Float

from k3jax.config import ModelConfig
from k3jax.layers.linear import proj
from pallas_kernels.moe.activations import split_gated_activation


class MLP(nn.Module):
    """Gated MLP of intermediate width ``width`` on the hidden state."""

    cfg: ModelConfig
    width: int

    @nn.compact
    def __call__(self, x: Float[Array, "B T D"]) -> Float[Array, "B T D"]:
        D, F = self.cfg.hidden, self.width
        g = proj(self.cfg, "BTD,DF->BTF", (D, F), ("embed", "mlp"), "gate")(x)
        u = proj(self.cfg, "BTD,DF->BTF", (D, F), ("embed", "mlp"), "up")(x)
        m = self.cfg.mlp
        h = split_gated_activation(g, u, m.activation, m.situ_beta, m.situ_linear_beta,
                                   self.cfg.compute_dtype)  # [B, T, F]
        return proj(self.cfg, "BTF,FD->BTD", (F, D), ("mlp", "embed"), "down")(h)
