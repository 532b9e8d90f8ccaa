"""Causal MLA flash attention with document masks (SPEC §3) and decode over the compressed cache:
references, Pallas kernels, ops."""

from pallas_kernels.mla_attention.kernel_gpu import BlockSizes
from pallas_kernels.mla_attention.ops import cached_attention, mla_attention, resolve_implementation
from pallas_kernels.mla_attention.reference import mla_attention_reference
from pallas_kernels.mla_attention.reference_decode import KEY_BLOCK, cached_attention_reference

__all__ = ["KEY_BLOCK", "BlockSizes", "cached_attention", "cached_attention_reference", "mla_attention",
           "mla_attention_reference", "resolve_implementation"]
