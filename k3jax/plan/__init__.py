"""Ahead-of-time plans: compile train / prefill / decode for a TPU slice or H200 hosts from a CPU host
and read per-device memory, FLOPs and communication off the compiled program (``python -m k3jax.plan``)."""
