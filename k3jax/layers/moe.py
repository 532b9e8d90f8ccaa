"""Sigmoid-routed mixture of experts with shared experts; LatentMoE for K3 (SPEC §4).

1. Route (fp32; ``k3jax.layers.routing.route``): ``s = sigmoid(x W_r)``; top-k of ``s + b`` (b: the
   balancing bias, selection only, no gradient); weights = the chosen unbiased ``s`` renormalised
   ``÷(Σ + 1e-20)``, × scaling factor. A decode step routes inside its expert kernels
   (``moe_decode.routed_experts``).
2. Routed experts (``pallas_kernels.moe.moe_ffn``: permute → grouped GLU FFN → weighted combine,
   the router weight applied after each expert's down projection). LatentMoE runs them in the
   latent: ``W_up RMSNorm(Σ_i w_i E_i(W_down x))``; Kimi-Linear / K2 at full width D, no norm.
3. Plus the shared experts, one fused GLU MLP on the full-width x.

The balancing bias is the variable ``balance/bias [E]``; the statistics Quantile Balancing needs
(``k3jax.balance.step_statistics``: loads, and histogram or margins) are sown into ``stats``.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from k3jax import balance
from k3jax.config import ModelConfig
from k3jax.layers import moe_decode, mxfp4
from k3jax.layers.linear import constrain, param, proj, wide_param_dtype
from k3jax.layers.mixed_input import MixedInput, kernel_runs, normed_input
from k3jax.layers.mlp import MLP
from k3jax.layers.norm import norm
from k3jax.layers.routing import route
from pallas_kernels.moe import moe_ffn
from sharding import current as parallel_context
from sharding.ep import moe_ffn_ep
from sharding.moonep import moe_ffn_moonep

def _route_and_stats(cfg: ModelConfig, scores, bias, with_stats: bool, token_axes=None):
    m = cfg.moe
    stats = {}
    if with_stats:
        stats = balance.step_statistics(cfg.balance, jax.lax.stop_gradient(scores), bias, m.top_k)
        if token_axes:  # counts add over the devices' tokens; margins stay per token
            stats = {n: v if n == "margins" else jax.lax.psum(v, token_axes) for n, v in stats.items()}
    ids, weights = route(scores, bias, m.top_k, renormalize=m.renormalize, scaling=m.routed_scaling_factor,
                         with_stats=with_stats)
    return ids, weights, stats


def _route_tokens(cfg: ModelConfig, scores: Float[Array, "T E"], bias: Float[Array, "E"], with_stats: bool):
    """``route`` and the QB statistics, on each device's own tokens when on a mesh.

    XLA's SPMD partitioner does not split the TopK custom call over a sharded token axis: under
    plain jit it all-gathers the ``[T, E]`` scores and routes every token of the mesh on every
    device. Inside ``shard_map`` each device routes its tokens; the counts are psum-ed.
    """
    ctx = parallel_context()
    if ctx is None:
        return _route_and_stats(cfg, scores, bias, with_stats)
    tok = P(ctx.token_axes or None, None)
    stat_specs = {}
    if with_stats:
        shapes = jax.eval_shape(lambda s, b: balance.step_statistics(cfg.balance, s, b, cfg.moe.top_k), scores, bias)
        stat_specs = {n: tok if n == "margins" else P() for n in shapes}
    body = functools.partial(_route_and_stats, cfg, with_stats=with_stats, token_axes=ctx.token_axes)
    fn = jax.shard_map(body, mesh=ctx.mesh, check_vma=False, in_specs=ctx.in_specs((tok, P()), scores, bias),
                       out_specs=(tok, tok, stat_specs))
    return fn(scores, bias)


def _decoded(w, dtype, on_mesh: bool) -> Float[Array, "E I O"]:
    """An expert stack in the kernels' ``[E, in, out]`` layout and ``dtype``; an MXFP4 one is decoded
    from its ``[E, out, in]`` matrices. On a mesh the expert-parallel kernels take each rank's
    experts whole (``sharding.ep``): the encoded bytes are gathered whole first (the serving rules
    split an expert's width over ``tensor``), 3.8× fewer than the decoded bf16 weights XLA gathered
    otherwise, and each rank decodes its own experts."""
    if not isinstance(w, mxfp4.Mxfp4):
        return w.astype(dtype)
    if on_mesh:
        whole = lambda a: constrain(a, ("experts",) + (None,) * (a.ndim - 1))
        w = mxfp4.Mxfp4(packed=whole(w.packed), scale=whole(w.scale))
    return jnp.swapaxes(w.dequantize(dtype), -1, -2)


class MoE(nn.Module):
    """Router + routed experts (latent or full width) + fused shared experts."""

    cfg: ModelConfig

    def _router(self, xt: Float[Array, "T D"] | MixedInput) -> tuple[Float[Array, "T E"], Float[Array, "E"]]:
        """The router's scores ``sigmoid(x W_r)`` and the balancing bias, in the wide dtype."""
        cfg, m = self.cfg, self.cfg.moe
        wide = cfg.fp32_dtype
        bias = self.variable("balance", "bias", nn.with_logical_partitioning(nn.initializers.zeros, ("experts",)),
                             None, (m.num_experts,), wide_param_dtype(cfg)).value
        bias = jax.lax.stop_gradient(bias.astype(wide))
        router = proj(cfg, "TD,DE->TE", (cfg.hidden, m.num_experts), ("embed", "experts"), "router", wide=True)
        if isinstance(xt, MixedInput) and router.has_variable("decode", "kernel_t"):
            scores = xt.project((router.get_variable("decode", "kernel_t"),), wide, epilogue="sigmoid")
            if scores is not None:  # the mix, the norm, the product and the sigmoid in one kernel
                return scores, bias
        return jax.nn.sigmoid(router(xt).astype(wide)), bias  # [T, E], [E]

    def _with_stats(self) -> bool:
        # variables hold params and balance only; sown into an immutable collection (decode), the
        # statistics would be computed and dropped
        return not self.is_initializing() and self.is_mutable_collection("stats")

    def _route(self, scores: Float[Array, "T E"], bias: Float[Array, "E"]) -> tuple[Int[Array, "T k"],
                                                                                    Float[Array, "T k"]]:
        """The top-k ids and weights (``routing.route``), the QB statistics sown beside them."""
        with jax.named_scope("moe_route"):
            ids, weights, stats = _route_tokens(self.cfg, scores, bias, self._with_stats())
        for name, value in stats.items():
            self.sow("stats", name, value)
        return ids, weights

    def _expert_weights(self) -> tuple:
        """``w1, w3, w2``: the params ``[E, in, out]``, or the ``mxfp4`` collection's encoded
        matrices where ``k3jax.layers.mxfp4.quantize_experts`` put them (inference)."""
        if self.has_variable(mxfp4.COLLECTION, "w1"):
            return tuple(self.get_variable(mxfp4.COLLECTION, n) for n in mxfp4.EXPERT_WEIGHTS)
        cfg, m = self.cfg, self.cfg.moe
        E, L, F = m.num_experts, cfg.moe_width, m.expert_intermediate
        init = nn.initializers.normal(cfg.initializer_range)
        w1 = param(self, "w1", init, (E, L, F), ("experts", "latent", "expert_mlp"), cfg.param_dtype)
        w3 = param(self, "w3", init, (E, L, F), ("experts", "latent", "expert_mlp"), cfg.param_dtype)
        w2 = param(self, "w2", init, (E, F, L), ("experts", "expert_mlp", "latent"), cfg.param_dtype)
        return w1, w3, w2

    def _normed_experts(self, u: Float[Array, "T L"], scores, bias, latent_norm: nn.Module) -> Array | MixedInput:
        """Decoding with the glue kernels: the routed experts' output normed by the bound ``latent_norm``, in
        the dense decode path's combine kernel where it runs (``moe_decode.routed_experts(norm_scale=)``),
        else lazily (``normed_input``: inside the kernel of ``up_proj``, which reads it)."""
        m = self.cfg.moe
        dense = moe_decode.decode_path(u.shape[0], m.top_k, m.num_experts) == "dense"
        if dense and parallel_context() is None and not self._with_stats():
            latent_norm(u[:0])  # creates or binds the scale
            scale = nn.meta.unbox(latent_norm.get_variable("params", "scale"))
            return self._experts(u, scores, bias, True, norm=(scale, latent_norm.eps))
        return normed_input(self._experts(u, scores, bias, True), latent_norm)

    def _experts(self, u: Float[Array, "T L"], scores, bias, decode: bool, norm: tuple | None = None) -> Array:
        """``norm``: ``(scale, eps)`` of the RMSNorm that the decode path applies to its output, where it
        routes the tokens itself (in the dense path's combine kernel where that runs)."""
        cfg, m = self.cfg, self.cfg.moe
        dt = cfg.compute_dtype
        ws = self._expert_weights()
        act = dict(activation=cfg.mlp.activation, situ_beta=cfg.mlp.situ_beta,
                   situ_linear_beta=cfg.mlp.situ_linear_beta)
        path = moe_decode.decode_path(u.shape[0], m.top_k, m.num_experts) if decode else "grouped"
        if parallel_context() is None and path != "grouped":
            ws = tuple(w if isinstance(w, mxfp4.Mxfp4) else w.astype(dt) for w in ws)
            # the decode kernels take plain weights; MXFP4 experts stay on XLA
            impl = m.decode_implementation if not any(isinstance(w, mxfp4.Mxfp4) for w in ws) else "xla"
            if not self._with_stats():  # routed inside the path's kernels where they run
                scale, eps = norm or (None, 1e-6)
                return moe_decode.routed_experts(u.astype(dt), scores, bias, *ws, path=path, top_k=m.top_k,
                                                 renormalize=m.renormalize, scaling=m.routed_scaling_factor, **act,
                                                 norm_scale=scale, norm_eps=eps, implementation=impl)
            experts = moe_decode.gathered_experts if path == "gather" else moe_decode.dense_experts
            return experts(u.astype(dt), *self._route(scores, bias), *ws, **act, implementation=impl)
        ids, weights = self._route(scores, bias)
        # stacks stored in the compute dtype (bf16 working copies, serving): nothing to fuse a
        # [W1 | W3] concatenation into, so the gate and up products run apart (moe_ffn's gate_up)
        stored_narrow = all(not isinstance(w, mxfp4.Mxfp4) and w.dtype == dt for w in ws)
        ws = tuple(_decoded(w, dt, parallel_context() is not None) for w in ws)
        args = (u.astype(dt), ids, weights, *ws)
        kwargs = dict(act, implementation=m.implementation)
        placement = self._placement() if m.redundant_experts else None
        if parallel_context() is None:
            return moe_ffn(*args, **kwargs, gate_up="split" if stored_narrow else "packed")
        # On a mesh: experts sharded over the expert axis, tokens travel by all-to-all (sharding/ep.py),
        # hot experts' tokens spread over their redundant copies (sharding/moonep.py).
        if placement is None:
            y, ep_stats = moe_ffn_ep(*args, **kwargs)
        else:
            y, ep_stats = moe_ffn_moonep(*args, *placement, **kwargs)
        for name, value in ep_stats.items():
            self.sow("stats", name, value)
        return y

    def _placement(self) -> tuple[Int[Array, "R"], Float[Array, "R"]]:
        """The MoonEP plan (``balance`` collection; the train step re-plans from ``placement_loads``)."""
        m = self.cfg.moe
        zeros = nn.initializers.zeros
        var = lambda name, shape, dtype, axes: self.variable(
            "balance", name, nn.with_logical_partitioning(zeros, axes), None, shape, dtype).value
        var("placement_loads", (m.num_experts,), jnp.float32, ("experts",))
        return (var("replica_expert", (m.redundant_experts,), jnp.int32, ("replicas",)),
                var("replica_share", (m.redundant_experts,), jnp.float32, ("replicas",)))

    @nn.compact
    def __call__(self, x: Float[Array, "B T D"] | MixedInput, *, decode: bool = False,
                 terms: bool = False) -> Float[Array, "B T D"] | tuple:
        """``decode``: a decode call (few tokens, no gradient), where the routed experts take the
        paths of ``k3jax.layers.moe_decode`` that read only the weights the tokens need; ``terms``: the
        routed and the shared experts' outputs apart, for a decode kernel that sums them itself."""
        cfg, m = self.cfg, self.cfg.moe
        B, T, D = x.shape
        xt = x.reshape(B * T, D)
        with jax.named_scope("moe_route"):
            scores, bias = self._router(xt)
        if m.latent_dim is None:
            y = self._experts(xt, scores, bias, decode)  # [T, D]
        else:
            L = m.latent_dim
            u = proj(cfg, "TD,DL->TL", (D, L), ("embed", "latent"), "down_proj")(xt)
            latent_norm = norm(cfg, "latent_norm", axis="latent") if m.latent_norm else None
            if latent_norm is not None and decode and kernel_runs(cfg.decode_glue_implementation):
                y = self._normed_experts(u, scores, bias, latent_norm)  # the norm inside a kernel
            else:
                y = self._experts(u, scores, bias, decode)  # [T, L]
                y = y if latent_norm is None else latent_norm(y)
            y = proj(cfg, "TL,LD->TD", (L, D), ("latent", "embed"), "up_proj")(y)
        y = y.reshape(B, T, D)
        if not m.num_shared_experts:
            return (y,) if terms else y
        shared = MLP(cfg, m.shared_width, name="shared")(x)
        return (y, shared) if terms else y + shared
