"""Kimi Delta Attention ops: chunked KDA (training/prefill), the decode step, and the short conv."""

from pallas_kernels.kda.conv import causal_conv1d, causal_conv1d_step
from pallas_kernels.kda.ops import chunk_kda, recurrent_kda_step
from pallas_kernels.kda.reference import (
    chunk_kda_reference,
    chunk_kda_state,
    kda_transition,
    naive_recurrent_kda,
)

__all__ = [
    "causal_conv1d",
    "causal_conv1d_step",
    "chunk_kda",
    "chunk_kda_reference",
    "chunk_kda_state",
    "kda_transition",
    "naive_recurrent_kda",
    "recurrent_kda_step",
]
