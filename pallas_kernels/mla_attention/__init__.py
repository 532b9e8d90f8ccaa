"""Causal MLA flash attention with document masks (SPEC §3): reference, Pallas kernels, op."""

from pallas_kernels.mla_attention.kernel_gpu import BlockSizes
from pallas_kernels.mla_attention.ops import mla_attention, resolve_implementation
from pallas_kernels.mla_attention.reference import mla_attention_reference

__all__ = ["BlockSizes", "mla_attention", "mla_attention_reference", "resolve_implementation"]
