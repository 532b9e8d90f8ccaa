"""The router's choice: top-k experts by the biased scores, weights from the unbiased ones (SPEC §4).

DeepSeek-V3's noaux_tc routing, which K3 keeps: the balancing bias moves which experts are chosen,
never how much they weigh. ``route_weights`` turns chosen ids into weights (the gathered sigmoid
scores, renormalised ``÷(Σ + RENORM_EPS)``, times the scaling factor); ``topk_route`` chooses and
weighs in one op for a step that needs no balance statistics (decode, inference): ``"xla"`` is the
reference (``lax.top_k`` + ``route_weights``), ``"pallas"`` the GPU kernel of
:mod:`pallas_kernels.moe.kernel_gpu_route` (one kernel instead of four), None the kernel when
compiling for a CUDA GPU and it takes the shapes. A training step takes its ids from the balance
statistics' own top-(k+1) (``k3jax.balance.biased_topk``) and weighs them with ``route_weights``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.target import current_target

# Guards the renormalisation of the top-k weights against an all-zero row (the references' value).
RENORM_EPS = 1e-20
IMPLEMENTATIONS = (None, "xla", "pallas")


def route_weights(scores: Float[Array, "T E"], ids: Int[Array, "T k"], *, renormalize: bool,
                  scaling: float) -> Float[Array, "T k"]:
    """The chosen experts' unbiased scores, renormalised over the k if asked, times ``scaling``."""
    weights = jnp.take_along_axis(scores, ids, axis=-1)  # [T, k]
    if renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + RENORM_EPS)
    return weights * scaling


def topk_route(scores: Float[Array, "T E"], bias: Float[Array, "E"], top_k: int, *, renormalize: bool,
               scaling: float, implementation: str | None = None, interpret: bool = False
               ) -> tuple[Int[Array, "T k"], Float[Array, "T k"]]:
    """``(ids, weights)``: the ``top_k`` experts of ``scores + bias`` per row (ties to the lower
    index) and :func:`route_weights` of them. ``bias`` selects only: no gradient flows through it."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    bias = jax.lax.stop_gradient(bias)
    if implementation is None:
        from pallas_kernels.moe import kernel_gpu_route

        target = current_target()
        cuda = target.platform == "gpu" and target.cuda
        implementation = "pallas" if cuda and kernel_gpu_route.accepts(scores, bias, top_k) else "xla"
    if implementation == "pallas":
        target = current_target()
        if not (interpret or (target.platform == "gpu" and target.cuda)):
            raise ValueError(f"implementation='pallas' needs a CUDA GPU or interpret=True (target "
                             f"{target.platform!r}); use implementation='xla'")
        return _route_pallas(scores, bias, top_k, renormalize, float(scaling), interpret)
    ids = jax.lax.top_k(scores + bias, top_k)[1]
    return ids, route_weights(scores, ids, renormalize=renormalize, scaling=scaling)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _route_pallas(scores, bias, top_k, renormalize, scaling, interpret):
    from pallas_kernels.moe import kernel_gpu_route

    return kernel_gpu_route.topk_route_pallas(scores, bias, top_k=top_k, renormalize=renormalize,
                                              scaling=scaling, eps=RENORM_EPS, interpret=interpret)


def _route_pallas_fwd(scores, bias, top_k, renormalize, scaling, interpret):
    ids, weights = _route_pallas(scores, bias, top_k, renormalize, scaling, interpret)
    return (ids, weights), (scores, ids, bias)


def _route_pallas_bwd(top_k, renormalize, scaling, interpret, res, ct):
    """The weights' gradient is the reference's, given the chosen ids; the bias gets none."""
    scores, ids, bias = res
    _, vjp = jax.vjp(lambda s: route_weights(s, ids, renormalize=renormalize, scaling=scaling), scores)
    return vjp(ct[1])[0], jnp.zeros_like(bias)


_route_pallas.defvjp(_route_pallas_fwd, _route_pallas_bwd)


__all__ = ["IMPLEMENTATIONS", "RENORM_EPS", "route_weights", "topk_route"]
