"""MoE dispatch kernels: grouped matmul, permute/combine and the routed expert FFN (SPEC §4)."""

from pallas_kernels.moe.activations import situ_glu, swiglu
from pallas_kernels.moe.dispatch import combine, permute
from pallas_kernels.moe.ops import gate_up_matmul, grouped_matmul, moe_ffn

__all__ = ["combine", "gate_up_matmul", "grouped_matmul", "moe_ffn", "permute", "situ_glu", "swiglu"]
