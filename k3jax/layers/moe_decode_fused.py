"""A LatentMoE decode step in three Pallas-Triton kernels (``MoEConfig.decode_implementation="pallas-fused"``).

At batch 1 a decode step is bound by its kernel launches (a few µs each). ``decode_implementation=
"pallas"`` runs the routed experts as one kernel and an XLA epilogue (13 kernels a LatentMoE layer in
``small()`` then: router 5, ``down_proj`` 1, experts 2, latent norm 2, ``up_proj`` 1, shared MLP 2);
``latent_moe`` runs the whole layer in three:

1. ``pallas_kernels/moe/kernel_gpu_decode_head.py``: router (ids, weights), ``u = x W_down`` and the
   shared experts' activation ``h``, side by side in one grid;
2. the routed experts' fp32 partial sums: ``kernel_gpu_decode.expert_blocks`` (as for "pallas");
3. ``pallas_kernels/moe/kernel_gpu_decode_tail.py``: combine, latent RMSNorm, ``up_proj``, the shared
   experts' down product and the sum.

The references are the XLA code they replace (``k3jax.layers.moe``'s router, ``Proj``, ``moe_decode.
gathered_experts``, ``norm.rms_norm``, ``MLP``), with the model code's rounding points. ``MoE`` takes
this path only on the gather path (``moe_decode.decode_path``), outside a mesh, with plain expert
weights and a normed latent; otherwise (MXFP4 experts, no latent) ``route`` alone replaces the router
(``pallas_kernels/moe/kernel_gpu_route.py``) and the experts take "pallas" (MXFP4: "xla").
"""

from __future__ import annotations

from jaxtyping import Array, Float, Int

from pallas_kernels.moe import kernel_gpu_decode, kernel_gpu_decode_head, kernel_gpu_decode_tail, kernel_gpu_route
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


def latent_moe(x: Float[Array, "T D"], w_router: Float[Array, "D E"], bias: Float[Array, "E"],
               w_down: Float[Array, "D L"], w1: Float[Array, "E L F"], w3: Float[Array, "E L F"],
               w2: Float[Array, "E F L"], scale: Float[Array, "L"], w_up: Float[Array, "D L"],
               shared: tuple[Array, Array, Array] | None, *, top_k: int, renormalize: bool, scaling: float,
               eps: float, activation: str, situ_beta: float = 4.0, situ_linear_beta: float = 25.0,
               tiles: tuple | None = None, interpret: bool = False) -> Float[Array, "T D"]:
    """A LatentMoE call on x (in the compute dtype) in three kernels: ``W_up RMSNorm(Σ_s w_s E_s(x W_down))``
    plus, with ``shared = (W_gate [D, Fs], W_up [D, Fs], W_down [D, Fs] output axis first)``, the shared
    experts' MLP. ``w_up`` output axis first too (the decode layout's ``kernel_t``). ``tiles``: the three
    kernels' ``(HeadTiles | None, DecodeTiles, TailTiles)`` (``benchmarks/bench_moe_decode_fused.py``);
    None: their defaults."""
    require_cuda(interpret)
    head_tiles, gather_tiles, tail_tiles = tiles or (None, kernel_gpu_decode.DecodeTiles(),
                                                     kernel_gpu_decode_tail.TailTiles())
    act = dict(activation=activation, situ_beta=situ_beta, situ_linear_beta=situ_linear_beta)
    gate_up = shared[:2] if shared is not None else (None, None)
    ids, weights, u, h = kernel_gpu_decode_head.decode_head_pallas(
        x, w_router, bias, w_down, *gate_up, top_k=top_k, renormalize=renormalize, scaling=scaling, **act,
        tiles=head_tiles, interpret=interpret)
    kernel_gpu_decode.check_inputs(u, ids, weights, w1, w3, w2, gather_tiles)
    parts = kernel_gpu_decode.expert_blocks(u, ids, w1, w3, w2, **act, tiles=gather_tiles, interpret=interpret)
    w_shared_down = shared[2] if shared is not None else None
    return kernel_gpu_decode_tail.decode_tail_pallas(parts, weights, scale, w_up, h, w_shared_down, eps=eps,
                                                     dtype=x.dtype, tiles=tail_tiles, interpret=interpret)


__all__ = ["latent_moe", "require_cuda", "route"]
