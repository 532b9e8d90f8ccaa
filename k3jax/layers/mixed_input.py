"""A decode layer's normed input left for its projections to compute: ``x = RMSNorm(AttnRes mix)``.

At batch 1 XLA computes each layer input in three dependent kernels before the projection that
reads it (the sources' reductions, the mix's softmax weights, then the projection fused with the
mix and the norm; ``pallas_kernels/mix_matvec/kernel_gpu.py``); the routed experts' latent norm takes
two more before ``up_proj``. With ``ModelConfig.decode_glue_implementation`` ``"pallas"`` (or None on a
CUDA GPU) a decoding layer hands its mixer and its feed-forward a :class:`MixedInput` instead of
``x``: the mix's sources and weights and the norm's, not yet combined (and the MoE hands ``up_proj``
its latent output the same way, a lone source: the norm only). The projections that read it on
``decode_layout``'s tree — the packed inputs of KDA and MLA (``linear.packed_products``), the
output-first ``Proj`` kernels (``down_proj``, ``up_proj``, KDA's ``o_proj`` after its per-head output
norm and gate), the router (with its sigmoid), the MLP's gate and up (with the activation) — pass it
to the one kernel that computes the mix, the norm and the product; anything else that reads it gets
the array the model's own functions compute (``materialize``, also what ``jnp`` calls through
``__jax_array__``), so every path stays correct where the kernel does not apply. The head's input (the
output mix and the final norm) is one ``mixed_norm`` kernel at any token count (``Transformer.decode``).
Same sums, in another float32 order. The residual adds a kernel repeats (``ResidualStream.add_kept``,
the decode layer's) also run on their own, behind optimization barriers, for the stream itself.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from pallas_kernels.mix_matvec import kernel_gpu, kernel_gpu_tokens
from pallas_kernels.target import current_target
from sharding import current as parallel_context

IMPLEMENTATIONS = (None, "xla", "pallas")


def kernel_runs(implementation: str | None) -> bool:
    """Whether ``implementation`` (``ModelConfig.decode_glue_implementation``) asks for the kernels here:
    ``"pallas"`` (a CUDA GPU to compile for, else ``ValueError``), None on a CUDA GPU, never ``"xla"``;
    and only off a mesh (the kernels read whole weights; as the MoE's decode kernels, sharded decoding
    stays on XLA)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"decode_glue_implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    target = current_target()
    cuda = target.platform == "gpu" and target.cuda
    if implementation == "pallas" and not cuda:
        raise ValueError(f"decode_glue_implementation='pallas' needs a CUDA GPU to compile for (target "
                         f"{target.platform!r}); use 'xla'")
    return implementation != "xla" and cuda and parallel_context() is None


@dataclasses.dataclass(frozen=True)
class MixedInput:
    """``RMSNorm(mix(sources))`` in ``dtype``, uncomputed. ``sources``: ``[..., D]`` each, the stored block
    sums then the partial sum (alone: the norm only); ``mix``: the mix's pseudo-query and key-norm
    weight (``()`` for one source); ``scale`` / ``norm_eps``: the norm's, over the last axis; ``addends``:
    summed and added to the partial sum first (``ResidualStream.add``'s, which the kernel then need not
    wait for); ``gate``: the norm's output gate logits (``gated_rms_norm``); ``fused``: ``materialize`` by
    the one kernel ``kernel_gpu.mixed_norm`` (where the projections' kernel does not take the tokens:
    batch 64), else by the model's functions; ``interpret``: run the kernels in the CPU interpreter."""

    sources: tuple
    mix: tuple
    mix_eps: float
    scale: jax.Array
    norm_eps: float
    dtype: Any
    wide: Any
    addends: tuple = ()
    gate: jax.Array | None = None
    fused: bool = False
    interpret: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        return self.sources[-1].shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def reshape(self, *shape) -> "MixedInput":
        """The token axes reshaped (the last, ``D``, kept)."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if shape[-1] != self.shape[-1]:
            raise ValueError(f"reshape keeps the last axis D={self.shape[-1]}, got shape {shape}")
        like = lambda a: None if a is None else a.reshape(shape)
        return dataclasses.replace(self, sources=tuple(v.reshape(shape) for v in self.sources),
                                   addends=tuple(map(like, self.addends)), gate=like(self.gate))

    def _rows(self, contracted: int) -> tuple:
        """``(sources, addends, gate)`` as the kernels take them: ``[tokens, features]``, the last
        ``contracted`` axes the features."""
        rows = math.prod(self.shape[:-contracted])
        flat = lambda a: None if a is None else a.reshape(rows, -1)
        return tuple(map(flat, self.sources)), tuple(map(flat, self.addends)), flat(self.gate)

    def materialize(self, kernel: bool = False) -> jax.Array:
        """The array: by ``kernel_gpu.mixed_norm`` where ``fused``, it takes the inputs and the matvec kernel
        does not take the tokens (batch 64) or ``kernel`` asks for it at any count (the head's input, read by
        XLA's product alone), else by the model's functions (what the layer computes without this class)."""
        if self.fused and (kernel or not kernel_gpu.takes_tokens(math.prod(self.shape[:-1]))):
            # (at a few tokens the readers the matvec kernel leaves, MLA's g_proj, chain shorter on XLA's
            # fusions: 120 against 135 kernels on small()'s batch-1 chain, device-less)
            sources, addends, gate = self._rows(1)
            if kernel_gpu.norm_accepts(sources, self.mix, self.scale, addends, gate):
                x = kernel_gpu.mixed_norm(sources, self.mix, self.scale, mix_eps=self.mix_eps, norm_eps=self.norm_eps,
                                          dtype=jnp.dtype(self.dtype), addends=addends, gate=gate,
                                          interpret=self.interpret)
                return x.reshape(self.shape)
        # imported here: the projections (``linear``) import this module, and ``attn_res`` imports them
        from k3jax.layers.attn_res import attn_res_mix
        from k3jax.layers.norm import gated_rms_norm, rms_norm

        *stored, partial = self.sources
        if self.addends:  # as the layers add them: the MoE's routed + shared, then into the stream
            partial = partial + functools.reduce(jnp.add, self.addends).astype(partial.dtype)
        h = partial
        if stored:
            query, key_norm = self.mix
            direction = key_norm.astype(self.wide) * query.astype(self.wide)  # as ``AttnResMix``
            h = attn_res_mix(stored, len(stored), partial, direction, self.mix_eps, self.wide).astype(self.dtype)
        if self.gate is not None:
            return gated_rms_norm(h, self.scale, self.gate, self.norm_eps, self.wide, self.dtype)
        return rms_norm(h, self.scale, self.norm_eps, self.wide).astype(self.dtype)

    def __jax_array__(self) -> jax.Array:
        return self.materialize()

    def project(self, weights: tuple, proj_dtype, out_dtype=None, activation: dict | None = None,
                epilogue: str | None = None, contracted: int = 1) -> jax.Array | None:
        """``x · W`` for ``weights = (W,)`` (``[N, F]``, output axis first, contracting ``x``'s last
        ``contracted`` axes flattened to ``F``; ``epilogue="sigmoid"``: its sigmoid) or
        ``act(x · W_gate, x · W_up)`` (``activation``: ``gated_activation``'s keywords) as one kernel,
        ``[..., N]``; at 5-64 tokens the input by ``mixed_norm``, then ``kernel_gpu_tokens.token_matmul``
        (16-bit weights, no epilogue); None where neither kernel takes these
        inputs or the matvec would lose to XLA's kernels (``kernel_gpu.pays``: wide inputs over many sources;
        the caller then computes on ``materialize()``)."""
        lead = self.shape[:-contracted]
        sources, addends, gate = self._rows(contracted)
        weights = tuple(w.astype(proj_dtype) if w.dtype != jnp.dtype(proj_dtype) else w for w in weights)
        act = tuple(sorted((activation or {}).items())) or None
        rows = jax.ShapeDtypeStruct((sources[0].shape[0], weights[0].shape[-1]), jnp.dtype(proj_dtype))
        if (self.fused and epilogue is None and kernel_gpu_tokens.accepts(rows, weights, act)
                and (act is None or jnp.dtype(self.dtype) == jnp.dtype(proj_dtype))):
            # 5-64 tokens: the input by ``mixed_norm``, the product on the tensor cores (batch 64)
            x = self.materialize().reshape(rows.shape).astype(proj_dtype)
            out = None if out_dtype is None else jnp.dtype(out_dtype)
            y = kernel_gpu_tokens.token_matmul(x, weights, out_dtype=out, activation=act, interpret=self.interpret)
            return y.reshape(lead + (y.shape[-1],))
        if not (kernel_gpu.accepts(sources, self.mix, self.scale, weights, epilogue=epilogue, addends=addends,
                                   gate=gate) and kernel_gpu.pays(sources, addends, gate)):
            return None
        y = kernel_gpu.mixed_matvec(sources, self.mix, self.scale, weights, mix_eps=self.mix_eps,
                                    norm_eps=self.norm_eps, dtype=jnp.dtype(self.dtype),
                                    proj_dtype=jnp.dtype(proj_dtype),
                                    out_dtype=None if out_dtype is None else jnp.dtype(out_dtype),
                                    activation=act,
                                    epilogue=epilogue, addends=addends, gate=gate, interpret=self.interpret)
        return y.reshape(lead + (y.shape[-1],))


def mixed_input(mix, norm, stream, addends: tuple = (), interpret: bool = False) -> MixedInput:
    """The input ``norm(mix(stream.add(sum(addends))))`` of a decoding layer as a :class:`MixedInput`, from
    the bound ``AttnResMix`` ``mix`` and ``RMSNorm`` ``norm`` modules' parameters and the ``ResidualStream``
    (whose last add, where it kept its terms, the kernel repeats: ``ResidualStream.last``)."""
    partial, addends = stream.partial, tuple(addends)
    if not addends and stream.last:  # the stream's last add, repeated in the kernel
        partial, addends = stream.last[0], stream.last[1:]
    sources = tuple(stream.stored) + (partial,)
    weights = mix.weights() if len(sources) > 1 else ()
    return MixedInput(sources=sources, mix=weights, mix_eps=mix.eps, scale=_scale(norm), norm_eps=norm.eps,
                      dtype=mix.dtype, wide=mix.wide_dtype, addends=addends, fused=True, interpret=interpret)


def normed_input(x: jax.Array, norm, gate: jax.Array | None = None, interpret: bool = False) -> MixedInput:
    """``norm(x, gate=gate)`` (a bound ``RMSNorm``) as a :class:`MixedInput` of one source: the norm inside the
    kernel of the projection that reads it (the MoE's latent norm before ``up_proj``; KDA's per-head
    output norm and gate before ``o_proj``)."""
    return MixedInput(sources=(x,), mix=(), mix_eps=0.0, scale=_scale(norm), norm_eps=norm.eps, dtype=norm.dtype,
                      wide=norm.wide_dtype, gate=gate, fused=True, interpret=interpret)


def _scale(norm) -> jax.Array:
    return nn.meta.unbox(norm.get_variable("params", "scale"))


__all__ = ["IMPLEMENTATIONS", "MixedInput", "kernel_runs", "mixed_input", "normed_input"]
