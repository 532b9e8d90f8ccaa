"""k3jax: Kimi K3 (hybrid KDA + gated MLA, LatentMoE, Block AttnRes, Quantile Balancing) in JAX/Flax."""

__version__ = "0.1.0"
