"""Inference: decode caches, chunked prefill, the decode step and sampling, batched generation, and
speculative decoding with the K3 draft (SPEC §2, §3, §8; DESIGN "One decode step")."""

from k3jax.infer.cache import Cache, KDACache, MLACache, StepCache, bytes_per_token, init_cache, select_step
from k3jax.infer.decode import decode_step, forward_cached, prefill, sample, warp
from k3jax.infer.draft import Draft, init_draft, train_draft
from k3jax.infer.generate import generate
from k3jax.infer.speculative import speculative_generate, verify

__all__ = ["Cache", "Draft", "KDACache", "MLACache", "bytes_per_token", "decode_step", "forward_cached", "generate",
           "init_cache", "init_draft", "prefill", "sample", "select_step", "speculative_generate", "StepCache",
           "train_draft", "verify", "warp"]
