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
from k3jax.layers.mixed_input import MixedInput
from pallas_kernels.moe.activations import split_gated_activation


class MLP(nn.Module):
    """Gated MLP of intermediate width ``width`` on the hidden state."""

    cfg: ModelConfig
    width: int

    @nn.compact
    def __call__(self, x: Float[Array, "B T D"] | MixedInput) -> Float[Array, "B T D"]:
        D, F = self.cfg.hidden, self.width
        m = self.cfg.mlp
        gate, up = (proj(self.cfg, "BTD,DF->BTF", (D, F), ("embed", "mlp"), name) for name in ("gate", "up"))
        h = self._mixed(x, gate, up) if isinstance(x, MixedInput) else None
        if h is None:
            h = split_gated_activation(gate(x), up(x), m.activation, m.situ_beta, m.situ_linear_beta,
                                       self.cfg.compute_dtype)  # [B, T, F]
        return proj(self.cfg, "BTF,FD->BTD", (F, D), ("mlp", "embed"), "down")(h)

    def _mixed(self, x, gate, up):
        """Decoding on ``decode_layout``'s tree (gate and up stored output axis first): the input's mix and
        norm, both products and the activation as one kernel (``MixedInput.project``); None where it
        does not apply."""
        if not (gate.has_variable("decode", "kernel_t") and up.has_variable("decode", "kernel_t")):
            return None
        m = self.cfg.mlp
        act = dict(activation=m.activation, situ_beta=m.situ_beta, situ_linear_beta=m.situ_linear_beta)
        return x.project(tuple(p.get_variable("decode", "kernel_t") for p in (gate, up)), self.cfg.compute_dtype,
                         activation=act)
