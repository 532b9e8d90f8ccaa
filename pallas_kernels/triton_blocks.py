"""What Pallas-Triton accepts as a block dimension, shared by the Triton kernels' input checks."""


def is_block_dim(n: int) -> bool:
    """A power of two of at least 16: Triton's tensors have power-of-two shapes, and its dot
    needs 16 or more along each dimension."""
    return n >= 16 and n & (n - 1) == 0


__all__ = ["is_block_dim"]
