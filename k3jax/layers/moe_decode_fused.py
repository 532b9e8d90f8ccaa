"""A LatentMoE decode step in three Pallas-Triton kernels (``MoEConfig.decode_implementation="pallas-fused"``).

At batch 1 a decode step is bound by its kernel launches (a few µs each). ``decode_implementation=
"pallas"`` runs the routed experts as one kernel and an XLA epilogue; this opt-in also replaces the
router (5 XLA kernels a layer in ``small()``: product with sigmoid, bias add, TopK, weight sum, id
slice) and the tail after the experts (epilogue, latent RMSNorm in 2 kernels, ``up_proj``):

1. ``route``: ``pallas_kernels/moe/kernel_gpu_route.py`` (ids and weights of each token);
2. the routed experts' fp32 partial sums: ``kernel_gpu_decode.expert_blocks`` (as for "pallas");
3. ``latent_tail``: ``pallas_kernels/moe/kernel_gpu_decode_tail.py`` (combine, norm, ``up_proj``).

The references are the XLA code they replace (``k3jax.layers.moe``'s router, ``moe_decode.
gathered_experts``, ``norm.rms_norm``, ``Proj``), with the same rounding points; ``MoE`` takes this
path only on the gather path (``moe_decode.decode_path``), outside a mesh, with plain expert weights
(MXFP4 experts: the router kernel, then ``"xla"``), and runs the tail only for a normed latent.
"""

from __future__ import annotations

from jaxtyping import Array, Float, Int

from pallas_kernels.moe import kernel_gpu_decode, kernel_gpu_decode_tail, kernel_gpu_route
from pallas_kernels.target import current_target


def require_cuda(interpret: bool) -> None:
    """Raise unless compiling for a CUDA GPU or interpreting (the Pallas-Triton kernels' targets)."""
    target = current_target()
    if not (interpret or (target.platform == "gpu" and target.cuda)):
        raise ValueError(f"decode_implementation='pallas-fused' needs a CUDA GPU (target {target.platform!r}); "
                         "use 'xla' or interpret=True")


def route(x: Float[Array, "T D"], w: Float[Array, "D E"], bias: Float[Array, "E"], *, top_k: int,
          renormalize: bool, scaling: float, interpret: bool = False) -> tuple[Int[Array, "T k"], Float[Array, "T k"]]:
    """``moe.route(sigmoid(x.astype(f32) @ w), bias, top_k, with_stats=False)`` in one kernel."""
    require_cuda(interpret)
    return kernel_gpu_route.route_pallas(x, w, bias, top_k=top_k, renormalize=renormalize, scaling=scaling,
                                         interpret=interpret)


def latent_tail(u: Float[Array, "T L"], ids: Int[Array, "T k"], weights: Float[Array, "T k"],
                w1: Float[Array, "E L F"], w3: Float[Array, "E L F"], w2: Float[Array, "E F L"],
                scale: Float[Array, "L"], w_up: Float[Array, "D L"], *, eps: float, activation: str,
                situ_beta: float = 4.0, situ_linear_beta: float = 25.0,
                interpret: bool = False) -> Float[Array, "T D"]:
    """``W_up RMSNorm(gathered_experts(u, ids, weights, w1, w3, w2))`` in ``u``'s dtype: the gather
    kernel and the tail kernel. ``w_up`` output axis first (the decode layout's ``kernel_t``)."""
    require_cuda(interpret)
    kernel_gpu_decode.check_inputs(u, ids, weights, w1, w3, w2)
    parts = kernel_gpu_decode.expert_blocks(u, ids, w1, w3, w2, activation=activation, situ_beta=situ_beta,
                                            situ_linear_beta=situ_linear_beta, interpret=interpret)
    return kernel_gpu_decode_tail.decode_tail_pallas(parts, weights, scale, w_up, eps=eps, dtype=u.dtype,
                                                     interpret=interpret)


__all__ = ["latent_tail", "require_cuda", "route"]
