"""Serving: a paged hybrid cache (MLA latent pages + KDA state snapshots), a radix prefix index,
a continuous-batching engine and an OpenAI-compatible HTTP server (docs/serve.md)."""

from k3jax.serve.config import EngineConfig
from k3jax.serve.engine import Engine, compilations
from k3jax.serve.params import SamplingParams

__all__ = ["Engine", "EngineConfig", "SamplingParams", "compilations"]
