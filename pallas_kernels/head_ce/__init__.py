"""The output head's logits and their logsumexp, one token chunk at a time (``k3jax.train.loss``)."""

from pallas_kernels.head_ce.ops import chunk_exponentials_lse, chunk_logits_lse

__all__ = ["chunk_exponentials_lse", "chunk_logits_lse"]
