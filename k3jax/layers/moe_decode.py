"""Routed experts for the few tokens of a decode step: read only the weights the step needs.

A decode step is bound by the bytes it reads, and at small batch the grouped-matmul pipeline of
``moe_ffn`` (permute, two grouped matmuls over every expert's tile, combine) reads every expert.
Two paths replace it there (``decode_path`` picks by the static token count):

- ``"gather"`` (``T·k <= E/2``; batch 1): each token's k experts' matrices are gathered and applied
  as multiply-and-sum fusions, so the gather (and MXFP4's decode) happens inside the fusion that
  reads the weights: only the routed experts' bytes move.
- ``"dense"`` (``T·k >= 2E``, up to ``DENSE_MAX_TOKENS`` tokens): every expert on every token as one batched
  matmul per projection, whose weights are read exactly once; at T tokens it does T FLOPs per
  weight byte, below the GPU's ratio of compute to bandwidth, so it costs the weight read. The
  router's k experts per token are then picked from the products, as ``moe_ffn`` combines them.

On a CUDA GPU the gather path runs as one Pallas-Triton kernel and an epilogue wherever the kernel
takes the inputs (``gathered_experts(implementation=None)``, ``MoEConfig.decode_implementation``;
1.420 → 1.217 ms a ``small()`` decode step at batch 1 on the H200, benchmarks/RESULTS.md "Stop 37"):
``pallas_kernels/moe/kernel_gpu_decode.py``, with the XLA code here as its reference. The dense path
likewise runs as two Pallas-Triton kernels and an epilogue (``dense_experts(implementation=None)``:
the activation inside the gate/up kernel, so the gate and up products are never written;
``pallas_kernels/moe/kernel_gpu_decode_dense.py``; 432.4 → 421.4 kernels and 914 → 819 MB written a
``small()`` step at batch 64; on the H200 level with XLA's batched matmuls, both ~2.2 TB/s, RESULTS.md
"Stop 52").

A decode step calls :func:`routed_experts` with the router's scores: on either path the kernels then
route each token themselves (``pallas_kernels/moe/rank_routing.py``; RESULTS.md "Stop 51"), and the
reference is ``k3jax.layers.routing.route`` followed by the path's function here (on the H200: a
``small()`` step at batch 1 0.849 → 0.796 ms, at batch 64 1.738 → 1.702 ms; stop 52).

Both round where ``moe_ffn`` rounds (gate and up products, the activation, each expert's output,
in the compute dtype; the weighted sum over the k experts in float32), so decode matches the
forward. Weights are the model's ``[E, in, out]`` arrays or :class:`k3jax.layers.mxfp4.Mxfp4`.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from k3jax.layers.linear import einsum
from k3jax.layers.mxfp4 import Mxfp4
from k3jax.layers.norm import rms_norm
from k3jax.layers.routing import RENORM_EPS, route
from pallas_kernels.moe import kernel_gpu_decode, kernel_gpu_decode_dense
from pallas_kernels.moe.activations import gated_activation
from pallas_kernels.moe.rank_routing import Routing
from pallas_kernels.moe.reference import accum_dtype
from pallas_kernels.target import current_target

DENSE_MAX_TOKENS = 256
DECODE_IMPLEMENTATIONS = (None, "xla", "pallas")  # of the gather and dense paths; None: "pallas" where it runs
Weights = Float[Array, "E _ _"] | Mxfp4  # w1 / w3 [E, L, F], w2 [E, F, L]


def decode_path(tokens: int, top_k: int, num_experts: int) -> str:
    """``"gather"``, ``"dense"`` or ``"grouped"`` (``moe_ffn``) for ``tokens`` tokens of a decode call.

    Gather while the ``T·k`` routed matrices are at most half the experts; dense once ``T·k >= 2E``
    (uniform routing then touches >= 86 % of the experts, so reading all of them once costs little
    more); in between, and past ``DENSE_MAX_TOKENS``, the grouped matmul, which reads only the
    experts that received tokens.
    """
    slots = tokens * top_k
    if 2 * slots <= num_experts:
        return "gather"
    return "dense" if slots >= 2 * num_experts and tokens <= DENSE_MAX_TOKENS else "grouped"


def _routed_product(h: Float[Array, "T #k I"], w: Weights, ids: Int[Array, "T k"]) -> Float[Array, "T k O"]:
    """``h[t, s] · W[ids[t, s]]`` as a multiply-and-sum in ``h``'s (wide) dtype: the gathered
    matrices are an operand of the reduction, never written out."""
    if isinstance(w, Mxfp4):
        wg = w.take(ids).dequantize(h.dtype)  # [T, k, O, I]
        return jnp.sum(h[..., None, :] * wg, axis=-1)
    return jnp.sum(h[..., None] * w[ids].astype(h.dtype), axis=-2)  # w[ids]: [T, k, I, O]


def gathered_experts(x: Float[Array, "T L"], ids: Int[Array, "T k"], weights: Float[Array, "T k"],
                     w1: Weights, w3: Weights, w2: Weights, *, activation: str, situ_beta: float = 4.0,
                     situ_linear_beta: float = 25.0, implementation: str | None = None,
                     interpret: bool = False) -> Float[Array, "T L"]:
    """``Σ_s weights[t,s] · W2_e act(W1_e x_t, W3_e x_t)``, ``e = ids[t,s]``, reading k experts per token.

    ``implementation``: ``"xla"`` the multiply-and-sum fusions below; ``"pallas"`` the GPU kernel
    ``pallas_kernels.moe.kernel_gpu_decode`` (one kernel and an epilogue instead of 4 fusions a layer
    at ``small()``'s batch 1; plain weights only; ``interpret=True`` runs it in the CPU interpreter);
    None: ``"pallas"`` when compiling for a CUDA GPU and the kernel takes these inputs, else ``"xla"``.
    """
    args = (x, ids, weights, w1, w3, w2)
    if _implementation(implementation, kernel_gpu_decode.accepts, args, interpret) == "pallas":
        return kernel_gpu_decode.gathered_experts_pallas(*args, activation=activation, situ_beta=situ_beta,
                                                         situ_linear_beta=situ_linear_beta, interpret=interpret)
    dt, wide = x.dtype, accum_dtype(x.dtype)
    h = x.astype(wide)[:, None]  # [T, 1, L]
    g = _routed_product(h, w1, ids).astype(dt)  # [T, k, F]
    u = _routed_product(h, w3, ids).astype(dt)
    a = gated_activation(g, u, activation, situ_beta, situ_linear_beta).astype(dt)
    y = _routed_product(a.astype(wide), w2, ids).astype(dt)  # [T, k, L]
    return einsum("TkL,Tk->TL", y.astype(wide), weights.astype(wide)).astype(dt)


def routed_experts(x: Float[Array, "T L"], scores: Float[Array, "T E"], bias: Float[Array, "E"], w1: Weights,
                   w3: Weights, w2: Weights, *, path: str, top_k: int, renormalize: bool, scaling: float,
                   activation: str, situ_beta: float = 4.0, situ_linear_beta: float = 25.0,
                   norm_scale: Float[Array, "L"] | None = None, norm_eps: float = 1e-6,
                   implementation: str | None = None, interpret: bool = False) -> Float[Array, "T L"]:
    """The ``path`` (``"gather"`` or ``"dense"``) from the router's scores: :func:`k3jax.layers.routing.route`
    (no statistics), then :func:`gathered_experts` or :func:`dense_experts` — the reference. Where the
    path's kernels run and take these inputs (float32 scores, a power of two of at most 256 experts:
    ``small()``'s 64) they route each token themselves (``pallas_kernels/moe/rank_routing.py``): the
    gather kernel's programs before reading their expert's weights, the dense path in the kernel that
    combines every expert's outputs. XLA's bias add, top-k, weight sum and the ids' copy (4 kernels,
    6.1 µs of a batch-1 MoE layer's 8.6 µs router on the H200, RESULTS.md "Stop 49") are gone. Same
    experts in the same order; the weights equal up to the order of the fp32 sum of the chosen scores.

    ``norm_scale``: the output ``RMSNorm``-ed with this scale and ``norm_eps`` (the latent MoE's
    ``latent_norm``), by the dense path's combine kernel where it runs (no norm kernel on the step's
    chain), else after the path as ``RMSNorm`` does it."""
    if path not in ("gather", "dense"):
        raise ValueError(f"path must be 'gather' or 'dense', got {path!r}")
    args = (x, scores, bias, w1, w3, w2)
    act = dict(activation=activation, situ_beta=situ_beta, situ_linear_beta=situ_linear_beta)
    kernels = kernel_gpu_decode if path == "gather" else kernel_gpu_decode_dense
    routing = Routing(top_k, renormalize, scaling, RENORM_EPS)
    accepts = lambda *a: kernels.accepts_routing(*a, routing)
    if _implementation(implementation, accepts, args, interpret) == "pallas" and accepts(*args):
        if path == "dense":
            return kernels.routed_dense_experts_pallas(*args, routing=routing, **act, norm_scale=norm_scale,
                                                       norm_eps=norm_eps, interpret=interpret)
        y = kernels.routed_experts_pallas(*args, routing=routing, **act, interpret=interpret)
    else:
        ids, weights = route(scores, bias, top_k, renormalize=renormalize, scaling=scaling, with_stats=False)
        experts = gathered_experts if path == "gather" else dense_experts
        y = experts(x, ids, weights, w1, w3, w2, **act, implementation=implementation, interpret=interpret)
    if norm_scale is None:
        return y
    return rms_norm(y, norm_scale, norm_eps, accum_dtype(y.dtype)).astype(y.dtype)


def _implementation(implementation: str | None, accepts, args: tuple, interpret: bool) -> str:
    """``"pallas"`` or ``"xla"`` for a decode path whose kernels take ``args`` where ``accepts(*args)``:
    None picks the kernels when compiling for a CUDA GPU and they take the inputs; ``"pallas"`` raises
    ``ValueError`` for MXFP4 weights or without a CUDA GPU to compile for (unless ``interpret``)."""
    if implementation not in DECODE_IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {DECODE_IMPLEMENTATIONS}, got {implementation!r}")
    target = current_target()
    cuda = target.platform == "gpu" and target.cuda
    if implementation is None:
        return "pallas" if cuda and accepts(*args) else "xla"
    if implementation == "pallas":
        if any(isinstance(w, Mxfp4) for w in args[3:]):
            raise ValueError("implementation='pallas' takes plain [E, in, out] expert weights; MXFP4 weights "
                             "(k3jax.layers.mxfp4.Mxfp4) take implementation='xla'")
        if not (interpret or cuda):
            raise ValueError(f"implementation='pallas' needs a CUDA GPU (target {target.platform!r}); "
                             "use implementation='xla' or interpret=True")
    return implementation


def _expert_products(h: Float[Array, "E T I"], w: Weights) -> Float[Array, "E T O"]:
    """Every expert's product with its own rows in ``h``'s dtype: the matmul accumulates in float32 and
    rounds once as it writes (asking for a float32 result and converting let XLA write the gate/up
    products in float32 and read them back in the activation's fusion: 2× their bytes at batch 64)."""
    if isinstance(w, Mxfp4):
        return einsum("ETI,EOI->ETO", h, w.dequantize(h.dtype), preferred_element_type=h.dtype)
    return einsum("ETI,EIO->ETO", h, w.astype(h.dtype), preferred_element_type=h.dtype)


def dense_experts(x: Float[Array, "T L"], ids: Int[Array, "T k"], weights: Float[Array, "T k"],
                  w1: Weights, w3: Weights, w2: Weights, *, activation: str, situ_beta: float = 4.0,
                  situ_linear_beta: float = 25.0, implementation: str | None = None,
                  interpret: bool = False) -> Float[Array, "T L"]:
    """The same sum with every expert applied to every token (each weight read once), then each
    token's k products picked and weighted.

    ``implementation``: ``"xla"`` the batched matmuls below; ``"pallas"`` the GPU kernels
    ``pallas_kernels.moe.kernel_gpu_decode_dense`` (the activation inside the gate/up kernel: two
    kernels and an epilogue instead of three kernels and the pick; 16-bit plain weights only;
    ``interpret=True`` runs them in the CPU interpreter); None: ``"pallas"`` when compiling for a
    CUDA GPU and the kernels take these inputs, else ``"xla"``.
    """
    args = (x, ids, weights, w1, w3, w2)
    if _implementation(implementation, kernel_gpu_decode_dense.accepts, args, interpret) == "pallas":
        return kernel_gpu_decode_dense.dense_experts_pallas(*args, activation=activation, situ_beta=situ_beta,
                                                            situ_linear_beta=situ_linear_beta, interpret=interpret)
    dt, wide = x.dtype, accum_dtype(x.dtype)
    E = (w1.packed if isinstance(w1, Mxfp4) else w1).shape[0]
    xe = jnp.broadcast_to(x, (E,) + x.shape)  # [E, T, L]: a batched matmul reads each W_e as stored
    g, u = _expert_products(xe, w1), _expert_products(xe, w3)  # [E, T, F]
    a = gated_activation(g, u, activation, situ_beta, situ_linear_beta).astype(dt)
    y = _expert_products(a, w2)  # [E, T, L]
    picked = y[ids, jnp.arange(x.shape[0])[:, None]]  # [T, k, L]
    return einsum("TkL,Tk->TL", picked.astype(wide), weights.astype(wide)).astype(dt)
