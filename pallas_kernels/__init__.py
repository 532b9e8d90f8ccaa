"""Kernels for k3jax: each op has a pure-JAX reference, Pallas kernels and a dispatching public op."""
