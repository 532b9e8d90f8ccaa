"""Hugging Face checkpoints and configs <-> k3jax (SPEC §12, docs/params.md)."""

from k3jax.convert.hf_config import family, from_hf_config, to_hf_config
from k3jax.convert.load import load_hf
from k3jax.convert.save import save_hf

__all__ = ["family", "from_hf_config", "load_hf", "save_hf", "to_hf_config"]
