"""Kimi Delta Attention layer (SPEC §2; Kimi Linear, arXiv:2510.26692).

On pre-normed ``x [B,T,D]``:

1. ``q, k, v = SiLU(conv(W_q x)), …`` — causal depthwise short convs in fp32 (tap W-1 = current).
2. ``q, k`` L2-normalised per head (``x / sqrt(Σx² + 1e-6)``); the kernel scales q by ``K^-1/2``.
3. ``β = sigmoid(W_b x)`` per head, fp32.
4. Log decay per channel from ``z = W_fb W_fa x + dt_bias`` (fp32):
   K3 ``g = lb · sigmoid(exp(A_log) · z)``; Kimi-Linear ``g = −exp(A_log) · softplus(z)``.
5. The gated delta rule, chunkwise (``pallas_kernels.kda.chunk_kda``), state reset per document.
6. ``W_o (RMSNorm_head(o) ⊙ sigmoid(gate))`` with gate ``W_g x`` (K3) or ``W_gb W_ga x`` (low rank).

Decode (SPEC §2): with ``cache`` (any pytree with ``state [B,H,K,V]`` fp32 and ``conv [3,B,W-1,H·K]``,
the last W-1 conv inputs of q, k, v; ``k3jax.infer.cache``) the layer continues the cached sequence
and returns ``(y, new_cache)``. ``valid [B,T]`` marks the real new tokens of a ragged batch (a prefix
of each row): the rest are made no-ops for the state (``β = 0``, ``g = 0``) and the conv tails end at
each row's last real token. With ``keep_steps`` the new cache is a ``KDASteps`` instead: the state
after every new token and the conv window of all of them, so a caller can roll back to any of those
tokens without running the layer again (speculative verification; ``k3jax.infer.cache.select_step``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from k3jax.config import ModelConfig
from k3jax.layers.linear import packed_product, param, proj, split_packed, wide_param_dtype
from k3jax.layers.mixed_input import MixedInput, kernel_runs, normed_input
from k3jax.layers.norm import l2_normalize, norm
from pallas_kernels.kda import causal_conv1d, chunk_kda, kernel_gpu_decode, recurrent_kda_step
from pallas_kernels.kda.conv import conv_tail, same_document_taps, short_convs
from pallas_kernels.kda.reference import decay_gate
from sharding import current as parallel_context
from sharding.cp import causal_conv1d_cp, chunk_kda_cp

# fla's l2norm_fwd: eps inside the square root.
QK_L2_EPS = 1e-6
# the fused decode step (tests run it in the CPU interpreter through this name)
fused_step = kernel_gpu_decode.fused_step_pallas


@functools.partial(jax.checkpoint, static_argnums=(3, 4))
def _biased_decay_gate(z: Float[Array, "B T H K"], dt_bias: Float[Array, "H K"], a_log: Float[Array, "H"],
                       lower_bound: float | None, wide_dtype) -> Float[Array, "B T H K"]:
    """``decay_gate(z + dt_bias)`` in ``wide_dtype``, recomputed in the backward from the projection's
    output ``z`` as it comes in (compute dtype): autodiff kept three wide ``[B, T, H, K]`` terms
    (1.1 GiB per K3 KDA layer at 8 K tokens, ``benchmarks/bench_layer.py --residuals``)."""
    return decay_gate(z.astype(wide_dtype) + dt_bias.astype(wide_dtype), a_log, lower_bound)


def _a_log_init(key, shape, dtype):
    """``A_log = log U(1, 16)`` (SPEC §2 init)."""
    return jnp.log(jax.random.uniform(key, shape, dtype, 1.0, 16.0))


def _conv_init(key, shape, dtype):
    """U(±1/√W): PyTorch Conv1d's default for a depthwise kernel of width W."""
    bound = 1.0 / np.sqrt(shape[0])
    return jax.random.uniform(key, shape, dtype, -bound, bound)


@flax.struct.dataclass
class KDASteps:
    """A KDA layer's decode cache after T new tokens, kept at every one of them (``keep_steps``)."""

    states: Float[Array, "*layers B T H K V"]  # fp32 state after each of the T new tokens
    window: Float[Array, "*layers 3 B WT C"]  # the W-1 cached conv inputs of q, k, v, then the T new ones


def recurrent_steps(q: Float[Array, "B T H K"], k: Float[Array, "B T H K"], v: Float[Array, "B T H V"],
                    g: Float[Array, "B T H K"], beta: Float[Array, "B T H"], state: Float[Array, "B H K V"], *,
                    scale: float) -> tuple[Float[Array, "B T H V"], Float[Array, "B T H K V"]]:
    """``recurrent_kda_step`` one token at a time, keeping the state after each: ``(o, states)``."""
    def step(S, xs):
        o, S = recurrent_kda_step(*(x[:, None] for x in xs), S, scale=scale)
        S = S.astype(state.dtype)
        return S, (o[:, 0], S)

    _, (o, states) = jax.lax.scan(step, state, tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)))
    return jnp.moveaxis(o, 0, 1), jnp.moveaxis(states, 0, 1)


def short_conv_qkv(xs: Sequence[Float[Array, "B T H K"]], ws: Sequence[Float[Array, "W H K"]],
                   segment_ids: Int[Array, "B T"] | None, *, wide_dtype, out_dtype,
                   eps: float = QK_L2_EPS
                   ) -> tuple[Float[Array, "B T H K"], ...]:
    """Steps 1-2 of the layer for training: ``SiLU(conv(x))`` of the q, k, v projections ``xs`` with
    conv weights ``ws``, q and k L2-normalised per head; computed in ``wide_dtype`` (the weights are
    cast to it), returned in ``out_dtype`` (the kernel's input dtype).

    One ``pallas_kernels.kda.conv.short_convs`` (custom VJP, bandwidth-bound fusions) for all three,
    with the packed-document mask built once.
    """
    B, T, H, K = xs[0].shape
    W = ws[0].shape[0]
    keep = same_document_taps(segment_ids, W)  # [B, T, W-1]
    flat = tuple(x.reshape(B, T, H * K) for x in xs)
    ws = tuple(w.reshape(W, H * K).T.astype(wide_dtype) for w in ws)  # [C, W]
    ys = short_convs(flat, ws, keep, l2_groups=(K, K, None), eps=eps, out_dtype=out_dtype)
    return tuple(y.reshape(B, T, H, K) for y in ys)


def per_shard(run, q, k, v, g, beta, state: Float[Array, "B H K V"]):
    """``run(q, k, v, g, beta, state)`` of a KDA kernel; on a mesh each device runs its own rows and
    heads inside ``shard_map``: XLA cannot partition a Pallas kernel (a custom call: it would gather
    every row and head onto each device first), and the recurrence never mixes rows or heads (an axis
    that does not divide its dimension is left whole)."""
    ctx = parallel_context()
    if ctx is None:
        return run(q, k, v, g, beta, state)
    from sharding.init import _fit

    fit = lambda x, *names: _fit(ctx.spec(*names), x.shape, ctx.mesh)
    rows, s_spec = fit(q, "batch", None, "heads", None), fit(state, "batch", "heads", None, None)
    rows = jax.sharding.PartitionSpec(s_spec[0], None, s_spec[1], None)  # one split for q..g and the state
    args = (q, k, v, g, beta, state)
    specs = (rows, rows, rows, rows, jax.sharding.PartitionSpec(*rows[:3]), s_spec)
    fn = jax.shard_map(run, mesh=ctx.mesh, in_specs=ctx.in_specs(specs, *args), out_specs=(rows, s_spec),
                       check_vma=False)
    return fn(*args)


def chunk_from_state(q, k, v, g, beta, state: Float[Array, "B H K V"], **kwargs):
    """``chunk_kda`` from a cached state, returning ``(o, final state)``, per shard on a mesh (:func:`per_shard`)."""
    run = lambda q, k, v, g, beta, s: chunk_kda(q, k, v, g, beta, initial_state=s, output_final_state=True,
                                                 **kwargs)
    return per_shard(run, q, k, v, g, beta, state)


def input_projections(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], tuple[str, ...]]]:
    """``(name, output shape, output axes)`` of every projection of the KDA layer's input, in the
    order ``decode_layout`` packs them: q, k, v, β logits, the decay's first factor
    ``f_a`` and the output gate (``g_proj``, or its first factor ``g_a`` when low rank)."""
    c = cfg.kda
    H, K = c.num_heads, c.head_dim
    gate = (("g_proj", (H, K), ("heads", "head_dim")) if c.output_gate_rank is None
            else ("g_a", (c.output_gate_rank,), ("gate_rank",)))
    return [(f"{n}_proj", (H, K), ("heads", "head_dim")) for n in "qkv"] + [
        ("b_proj", (H,), ("heads",)), ("f_a", (c.decay_rank,), ("decay_rank",)), gate]


def packed_inputs(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """What ``decode_layout`` packs into one kernel (``linear.packed_products``): every input projection."""
    return [(name, out) for name, out, _ in input_projections(cfg)]


class KDA(nn.Module):
    """One KDA token mixer; ``segment_ids`` resets the state and the conv history per document."""

    cfg: ModelConfig

    def _conv_weight(self, name: str) -> Float[Array, "W H K"]:
        c = self.cfg.kda
        return param(self, name, _conv_init, (c.conv_size, c.num_heads, c.head_dim), ("conv", "heads", "head_dim"),
                     wide_param_dtype(self.cfg))

    def _short_conv(self, name: str, x: Float[Array, "B T H K"], segment_ids, tail=None):
        """SiLU(causal depthwise conv) in the wide dtype (decode and context parallel; training on one
        sequence shard takes :func:`short_conv_qkv`). With a cached ``tail`` ``[B, W-1, H·K]`` returns
        ``(y, window)``: the tail followed by the new inputs ``[B, W-1+T, H·K]``."""
        B, T, H, K = x.shape
        w = self._conv_weight(name)
        w = w.reshape(w.shape[0], H * K).T  # [C, W]
        xf, wf = x.reshape(B, T, H * K).astype(self.cfg.fp32_dtype), w.astype(self.cfg.fp32_dtype)
        if tail is not None:
            y, _ = causal_conv1d(xf, wf, initial_state=tail)
            return jax.nn.silu(y).reshape(B, T, H, K), jnp.concatenate([tail, xf.astype(tail.dtype)], axis=1)
        # the previous sequence shard's last W-1 inputs come by ppermute (sharding/cp.py)
        y = causal_conv1d_cp(xf, wf, segment_ids=segment_ids)
        return jax.nn.silu(y).reshape(B, T, H, K)

    def _input_projections(self, x: Float[Array, "B T D"] | MixedInput) -> tuple[dict[str, Array], Array | None]:
        """Every projection of the layer input ``x`` by parameter name (``input_projections``), and their
        packed output ``[B, T, N]`` where there is one.

        On ``decode_layout``'s tree (the kernels packed once, ``linear.packed_product``) they are one
        product: at batch 1 one matrix-vector kernel instead of one per projection, each recomputing
        the AttnRes mix and the norm of ``x``.
        """
        cfg = self.cfg
        packed = packed_product(self, x, cfg.compute_dtype)
        if packed is not None:
            return split_packed(packed, packed_inputs(cfg)), packed
        letters = lambda out: "HK" if len(out) == 2 else "R"
        return {name: proj(cfg, f"BTD,D{letters(out)}->BT{letters(out)}", (cfg.hidden,) + out, ("embed",) + axes,
                           name)(x) for name, out, axes in input_projections(cfg)}, None

    def _gate_params(self) -> tuple[Float[Array, "H K"], Float[Array, "H"]]:
        """The decay gate's ``dt_bias`` and ``A_log``."""
        cfg, c = self.cfg, self.cfg.kda
        dt_bias = param(self, "dt_bias", nn.initializers.zeros, (c.num_heads, c.head_dim), ("heads", "head_dim"),
                        wide_param_dtype(cfg))
        return dt_bias, param(self, "A_log", _a_log_init, (c.num_heads,), ("heads",), wide_param_dtype(cfg))

    def _decay_product(self, f_a: Float[Array, "B T R"]) -> Float[Array, "B T H K"]:
        """``z = f_a · W_fb``, the decay gate's input before its bias, in the compute dtype."""
        cfg, c = self.cfg, self.cfg.kda
        H, K, R = c.num_heads, c.head_dim, c.decay_rank
        return proj(cfg, "BTR,RHK->BTHK", (R, H, K), ("decay_rank", "heads", "head_dim"), "f_b")(f_a)

    def _log_decay(self, f_a: Float[Array, "B T R"]) -> Float[Array, "B T H K"]:
        cfg, c = self.cfg, self.cfg.kda
        return _biased_decay_gate(self._decay_product(f_a), *self._gate_params(), c.gate_lower_bound, cfg.fp32_dtype)

    def _output_gate(self, xs: dict[str, Array]) -> Float[Array, "B T H K"]:
        c = self.cfg.kda
        H, K, R = c.num_heads, c.head_dim, c.output_gate_rank
        if R is None:
            return xs["g_proj"]
        return proj(self.cfg, "BTR,RHK->BTHK", (R, H, K), ("gate_rank", "heads", "head_dim"), "g_b")(xs["g_a"])

    @nn.compact
    def __call__(self, x: Float[Array, "B T D"] | MixedInput, segment_ids: Int[Array, "B T"] | None = None, *,
                 cache=None, valid: Bool[Array, "B T"] | None = None, keep_steps: bool = False):
        cfg, c = self.cfg, self.cfg.kda
        B, T, D = x.shape
        H, K = c.num_heads, c.head_dim
        projected, packed = self._input_projections(x)
        fused = None if cache is None or keep_steps else self._fused_step(projected, packed, cache, valid)
        if fused is not None:
            o, cache = fused
        else:
            o, cache = self._delta_rule(projected, segment_ids, cache, valid, keep_steps)
        dt = cfg.compute_dtype
        # per-head RMSNorm and the output gate, one checkpointed region: [B, T, H, K] in dt
        o_norm, gate = norm(cfg, "o_norm", axis="head_dim", wide_param=True, out_dtype=dt), self._output_gate(projected)
        # decoding, the norm and the gate may run inside o_proj's kernel (k3jax.layers.mixed_input)
        lazy = cache is not None and kernel_runs(cfg.decode_glue_implementation)
        o = normed_input(o, o_norm, gate) if lazy else o_norm(o, gate=gate)
        y = proj(cfg, "BTHK,HKD->BTD", (H, K, D), ("heads", "head_dim", "embed"), "o_proj")(o)
        return y if cache is None else (y, cache)

    def _delta_rule(self, projected: dict[str, Array], segment_ids, cache, valid, keep_steps):
        """Steps 1-5 of the layer from its input projections: ``(o, cache)`` (``cache`` None in training)."""
        cfg, c = self.cfg, self.cfg.kda
        K = c.head_dim
        xs = [projected[f"{n}_proj"] for n in "qkv"]
        # training without a split sequence, on a mesh or not: the custom VJP that saves only the bf16 inputs
        # (autodiff of the conv path keeps fp32 shifted inputs and SiLU terms: stacked per repetition when scanned)
        if cache is None and (parallel_context() is None or not parallel_context().sequence_parallel):
            ws = [self._conv_weight(f"{n}_conv") for n in "qkv"]
            q, k, v = short_conv_qkv(xs, ws, segment_ids, wide_dtype=cfg.fp32_dtype,
                                     out_dtype=cfg.compute_dtype)
        else:  # decode, or context parallel
            ys = [self._short_conv(f"{n}_conv", xs[i], segment_ids, None if cache is None else cache.conv[i])
                  for i, n in enumerate("qkv")]
            if cache is not None:
                ys, windows = zip(*ys)
            q, k, v = l2_normalize(ys[0], QK_L2_EPS), l2_normalize(ys[1], QK_L2_EPS), ys[2]
        beta = jax.nn.sigmoid(projected["b_proj"].astype(cfg.fp32_dtype))  # [B, T, H]
        g = self._log_decay(projected["f_a"])  # [B, T, H, K]
        dt = cfg.compute_dtype
        kda_args = (q.astype(dt), k.astype(dt), v.astype(dt), g, beta)
        kda_kwargs = dict(scale=K ** -0.5, segment_ids=segment_ids, implementation=c.scan_implementation,
                          chunk_size=c.chunk_size)
        if cache is not None:
            o, cache = self._continue(kda_args, cache, valid, jnp.stack(windows), keep_steps)
        elif parallel_context() is None:
            o, _ = chunk_kda(*kda_args, **kda_kwargs, gpu_prep_backward=c.gpu_prep_backward)
        else:  # exact context parallel over the sequence axis (SPEC §2; sharding/cp.py)
            o = chunk_kda_cp(*kda_args, **kda_kwargs, gpu_prep_backward=c.gpu_prep_backward)
        return o, cache

    def _fused_step(self, projected: dict[str, Array], packed: Array | None, cache, valid) -> tuple[Array, Any] | None:
        """Decoding a few tokens on one device: steps 1-5 from the packed input projections as one kernel
        (``kernel_gpu_decode.fused_step_pallas``: the convs, q and k's norms, β, the decay gate and the
        delta rule), where XLA's path runs three kernels on the step's critical path (batch 1 of
        ``small()``) and, from ``MIN_STATES`` (sequence, head) states, six around the unfused kernel. Below
        ``FUSED_PRODUCT_STATES`` each program also multiplies its head's ``f_a`` by ``W_fb``; from there
        XLA's matmul makes ``z`` first. ``(o, cache)``, or None where it does not apply (no packed kernel,
        ``ModelConfig.decode_glue_implementation``, more than ``MAX_FUSED_TOKENS`` new tokens)."""
        cfg, c = self.cfg, self.cfg.kda
        if packed is None or not kernel_runs(cfg.decode_glue_implementation):
            return None
        B, T = packed.shape[:2]
        if T > kernel_gpu_decode.MAX_FUSED_TOKENS:
            return None
        num_new = jnp.full((B,), T, jnp.int32) if valid is None else jnp.sum(valid, axis=1, dtype=jnp.int32)
        # read, not declared: where the kernel does not take them, the XLA path declares the same parameters
        stored = lambda name: nn.meta.unbox(self.get_variable("params", name))
        ws = tuple(stored(f"{n}_conv") for n in "qkv")
        args = [packed, cache.conv, ws, stored("f_b")["kernel"], stored("dt_bias"), stored("A_log"), cache.state,
                num_new]
        offsets = tuple(int(a) for a in np.cumsum([0] + [int(np.prod(out)) for _, out in packed_inputs(cfg)])[:5])
        if not kernel_gpu_decode.fused_accepts(*args, offsets):
            return None
        if B * c.num_heads >= kernel_gpu_decode.FUSED_PRODUCT_STATES:
            args[3] = self._decay_product(projected["f_a"])
        o, state, tails = fused_step(*args, offsets=offsets, scale=c.head_dim ** -0.5,
                                     lower_bound=c.gate_lower_bound, eps=QK_L2_EPS)
        return o, cache.replace(state=state.astype(cache.state.dtype), conv=tails)

    def _continue(self, kda_args, cache, valid, windows, keep_steps):
        """The gated delta rule from the cached state; padding tokens leave the state unchanged."""
        c = self.cfg.kda
        q, k, v, g, beta = kda_args
        B, T = q.shape[:2]
        if valid is not None:
            g = jnp.where(valid[:, :, None, None], g, 0.0)
            beta = jnp.where(valid[:, :, None], beta, 0.0)
        scale = c.head_dim ** -0.5
        if keep_steps:  # every step's state, so no chunked path: this is for a few tokens
            o, states = recurrent_steps(q, k, v, g, beta, cache.state, scale=scale)
            return o, KDASteps(states=states, window=windows.astype(cache.conv.dtype))
        num_new = jnp.full((B,), T, jnp.int32) if valid is None else jnp.sum(valid, axis=1, dtype=jnp.int32)
        tails = conv_tail(windows, num_new, c.conv_size - 1)
        if T < c.chunk_size:  # decode: a few tokens, the plain recurrence
            step = lambda q, k, v, g, beta, s: recurrent_kda_step(q, k, v, g, beta, s, scale=scale)
            o, state = per_shard(step, q, k, v, g, beta, cache.state)
            # Where the step runs as XLA ops (few states: batch 1), XLA fused it whole into the output
            # norm's Triton fusion, one program per head: 14.6 µs a layer of small() on the H200, where
            # its reductions over the same state take ~2 µs each (benchmarks/RESULTS.md, stop 48). The
            # barrier keeps o a buffer of its own, so the state update is a reduction fusion of its own.
            o = jax.lax.optimization_barrier(o)
        else:  # prefill: the chunked kernel from the cached state
            o, state = chunk_from_state(q, k, v, g, beta, cache.state, scale=scale,
                                        implementation=c.scan_implementation, chunk_size=c.chunk_size)
        return o, cache.replace(state=state.astype(cache.state.dtype), conv=tails.astype(cache.conv.dtype))
