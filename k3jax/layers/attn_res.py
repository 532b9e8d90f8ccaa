"""Block Attention Residuals (SPEC §5; the K3 technical report).

A layer's input is a softmax mix over the stored block sums and the running partial sum of the
current block, instead of a plain residual: with sources ``v_1..v_N``,
``k_n = v_n / sqrt(mean(v_n²) + eps)``, ``logit_n = Σ_d k_nd γ_d w_d`` (the RMSNorm weight γ and the
pseudo-query w fold into one vector; no 1/√D), ``h = Σ_n softmax(logit)_n v_n``, all in fp32.

Bookkeeping is static: ``ResidualStream`` holds the finished block sums as a tuple (their number
is known at trace time) and the ``partial`` sum of the current block. Separate arrays, not one
``[Nmax,B,T,D]`` buffer, so no zero buffer is written and a read of block n differentiates into
block n alone. The mix has an explicit backward (`_mix_bwd`) so that XLA's fusions of the blocks'
cotangents stay elementwise (`benchmarks/RESULTS.md`, stop 15).
Inside the scanned layer stack a layer's index is traced, so there the stream is a
``StackedStream``: the ``[Nmax,B,T,D]`` buffer, a traced count, and a mix that masks unused slots.
Plain pre-norm residual models use the same stream with no blocks.
"""

from __future__ import annotations

import functools
import typing
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from k3jax.layers.linear import constrain, param

HIDDEN_AXES = ("batch", "length", "embed")
# The [N, B, T, D] block buffer, split like the hidden states. Left to sharding propagation, the
# buffer restacked between scanned runs lost its split over the tokens: K3 at a 1 M-token context on
# sequence=256 held whole-length bf16[8,1,1048576,7168] buffers (120 GB) per device.
BLOCKS_AXES = (None,) + HIDDEN_AXES


# A pytree JAX rebuilds with other leaves (ShapeDtypeStructs under eval_shape, shardings), so the
# field annotations document and are not checked when one is built (as the decode caches).
@typing.no_type_check
@flax.struct.dataclass
class ResidualStream:
    """What flows between decoder layers."""

    partial: Float[Array, "B T D"]  # current block's running sum (plain residual: the hidden state)
    stored: tuple = ()  # finished block sums [B, T, D], oldest first
    max_blocks: int = flax.struct.field(pytree_node=False, default=0)
    # (partial before the last add, the terms it added) where ``add_kept`` made it: a decode kernel that
    # mixes the stream repeats the add instead of waiting for it (``k3jax.layers.mixed_input``)
    last: tuple = ()

    @classmethod
    def start(cls, embeddings: Float[Array, "B T D"], max_blocks: int) -> "ResidualStream":
        return cls(partial=constrain(embeddings, HIDDEN_AXES), max_blocks=max_blocks)

    @property
    def count(self) -> int:
        return len(self.stored)

    @property
    def blocks(self) -> Float[Array, "N B T D"] | None:
        """The block sums as one ``[max_blocks, B, T, D]`` array, zeros past ``count`` (None without AttnRes)."""
        if self.max_blocks == 0:
            return None
        unused = [jnp.zeros_like(self.partial)] * (self.max_blocks - self.count)
        return constrain(jnp.stack(list(self.stored) + unused), BLOCKS_AXES)

    def push(self) -> "ResidualStream":
        """Store the partial sum as a finished block and start a new, empty one."""
        if self.count >= self.max_blocks:
            raise ValueError(f"push: all max_blocks={self.max_blocks} AttnRes blocks are already stored")
        return self.replace(partial=jnp.zeros_like(self.partial), stored=self.stored + (self.partial,), last=())

    def push_if(self, flag: bool) -> "ResidualStream":
        """``push()`` when ``flag`` (a Python bool: the block bookkeeping here is static)."""
        if not isinstance(flag, bool):
            raise ValueError(f"push_if: flag must be a Python bool for a ResidualStream, got {flag!r}; "
                             "a traced flag needs the scanned StackedStream")
        return self.push() if flag else self

    def add(self, y: Float[Array, "B T D"]) -> "ResidualStream":
        return self.replace(partial=constrain(self.partial + y.astype(self.partial.dtype), HIDDEN_AXES), last=())

    def add_kept(self, *terms: Float[Array, "B T D"]) -> "ResidualStream":
        """``add(terms[0] + terms[1] + …)``, keeping the partial sum before it and the terms as ``last``. The
        add sits between optimization barriers: without them XLA fused it with the adds before and after
        it (the mixer's outputs, this layer's and the next's) into one kernel, which the kernels reading
        ``last`` or the next layer's sum then waited for (one more kernel on the decode step's chain)."""
        kept = jax.lax.optimization_barrier((self.partial,) + terms)
        added = self.replace(partial=kept[0]).add(functools.reduce(jnp.add, kept[1:]))
        return added.replace(partial=jax.lax.optimization_barrier(added.partial), last=(self.partial,) + terms)

    def mix(self, direction: Float[Array, "D"], eps: float, wide_dtype) -> Float[Array, "B T D"]:
        """The AttnRes mix of the stored blocks and the partial sum (the partial alone before any block)."""
        if self.count == 0:  # the only source is the partial sum: its mix is itself
            return self.partial
        return attn_res_mix(self.stored, self.count, self.partial, direction, eps, wide_dtype)


@flax.struct.dataclass
class StackedStream:
    """The stream inside the scanned layer stack (``k3jax.layers.stack``), where a layer's index and
    so the number of stored blocks are traced: the block sums live in one ``[N, B, T, D]`` buffer
    (SPEC §5's static form), zeros past ``count``, and the mix masks the unused slots out."""

    partial: Float[Array, "B T D"]
    buffer: Float[Array, "N B T D"]
    count: Int[Array, ""]

    @classmethod
    def of(cls, stream: ResidualStream) -> "StackedStream":
        return cls(partial=stream.partial, buffer=stream.blocks, count=jnp.int32(stream.count))

    def unstack(self, count: int) -> ResidualStream:
        """Back to the static form, ``count`` (known from the layer index) blocks stored."""
        stored = tuple(constrain(self.buffer[n], HIDDEN_AXES) for n in range(count))
        return ResidualStream(partial=self.partial, stored=stored, max_blocks=self.buffer.shape[0])

    @property
    def blocks(self) -> Float[Array, "N B T D"]:
        return self.buffer

    def push_if(self, flag) -> "StackedStream":
        """Store the partial sum as block ``count`` and restart it where ``flag`` (traced) holds."""
        if isinstance(flag, bool):
            flag = jnp.bool_(flag)
        slot = jnp.minimum(self.count, self.buffer.shape[0] - 1)  # the plan never pushes past N
        kept = jax.lax.dynamic_index_in_dim(self.buffer, slot, keepdims=False)
        buffer = jax.lax.dynamic_update_index_in_dim(self.buffer, jnp.where(flag, self.partial, kept), slot, 0)
        buffer = constrain(buffer, BLOCKS_AXES)
        partial = jnp.where(flag, jnp.zeros_like(self.partial), self.partial)
        return self.replace(partial=partial, buffer=buffer, count=self.count + flag.astype(jnp.int32))

    def add(self, y: Float[Array, "B T D"]) -> "StackedStream":
        return self.replace(partial=constrain(self.partial + y.astype(self.partial.dtype), HIDDEN_AXES))

    def mix(self, direction: Float[Array, "D"], eps: float, wide_dtype) -> Float[Array, "B T D"]:
        """The mix over the first ``count`` slots and the partial sum (unused slots weigh exactly 0)."""
        return _mix_stacked(self.buffer, self.count, self.partial, direction.astype(wide_dtype), eps,
                            jnp.dtype(wide_dtype))


def attn_res_mix(blocks, count: int, partial: Float[Array, "B T D"],
                 direction: Float[Array, "D"], eps: float, wide_dtype) -> Float[Array, "B T D"]:
    """Softmax mix of ``blocks[:count]`` and ``partial`` along ``direction`` (= γ ⊙ w), in ``wide_dtype``.

    ``blocks``: a ``[N, B, T, D]`` array or a sequence of ``[B, T, D]`` arrays; ``count`` is static,
    so entries past it are never read (they would get weight 0). Each source is widened where it
    is read, one at a time: a stacked ``[count+1, B, T, D]`` fp32 copy made XLA write and re-read
    it and reduce over its leading axis; here the logits are row reductions and the mix is one
    elementwise sum over the sources. The gradient is `_mix`'s explicit backward.
    """
    sources = tuple(blocks[n] for n in range(count)) + (partial,)
    return _mix(sources, direction.astype(wide_dtype), eps, jnp.dtype(wide_dtype))


# The mix's math works on *groups* of sources: arrays whose leading axis holds one or more slots
# ([k, B, T, D]). The unrolled mix passes each source as a group of one; the scanned stream's passes
# its whole block buffer and the partial sum, so its program does not grow with the number of blocks.


def _rows(groups) -> list[slice]:
    """Each group's slots in the concatenated ``[K, …]`` terms."""
    rows, start = [], 0
    for v in groups:
        rows.append(slice(start, start + v.shape[0]))
        start += v.shape[0]
    return rows


def _mix_terms(groups, d, eps, wide, used=None):
    """Per slot ``[K, B, T]``: ``s = v·d``, ``r = 1/rms(v)``, and the softmax weights of ``s·r``
    (slots where ``used [K]`` is False get weight exactly 0)."""
    s = [jnp.sum(v.astype(wide) * d, axis=-1) for v in groups]
    r = [jax.lax.rsqrt(jnp.mean(jnp.square(v.astype(wide)), axis=-1) + eps) for v in groups]
    # the logits concatenated once (not s and r each): one small kernel less per mix at decode
    logits = jnp.concatenate([a * b for a, b in zip(s, r)])
    if used is not None:
        logits = jnp.where(used[:, None, None], logits, -jnp.inf)
    return jnp.concatenate(s), jnp.concatenate(r), jax.nn.softmax(logits, axis=0)


def _mix_sum(groups, p, wide):
    return sum(jnp.sum(p[k][..., None] * v.astype(wide), axis=0) for k, v in zip(_rows(groups), groups))


def _one(sources) -> tuple:
    return tuple(v[None] for v in sources)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _mix(sources: tuple, d: Float[Array, "D"], eps: float, wide) -> Float[Array, "B T D"]:
    """``Σ_n softmax_n(logit)·v_n`` with ``logit_n = (v_n·d)/rms(v_n)``, in ``wide``."""
    return _mix_fwd(sources, d, eps, wide)[0]


def _mix_fwd(sources, d, eps, wide):
    s, r, p = _mix_terms(_one(sources), d, eps, wide)
    return _mix_sum(_one(sources), p, wide), (sources, d, s, r, p)


def _mix_bwd(eps, wide, res, dh):
    """With ``g_n = dh·v_n`` and ``ℓ_n = p_n (g_n − Σ_m p_m g_m)`` (the softmax's backward):
    ``dv_n = p_n dh + ℓ_n (r_n d − s_n r_n³ v_n / D)`` and ``dd = Σ_n (ℓ_n r_n)ᵀ v_n``.

    Autodiff of the forward gives the same sums, but XLA fuses every later mix's share of a stored
    block's cotangent together with the ``dd`` column sums into one ~90-operand reduction fusion
    that ran at a fifth of the H200's bandwidth (9.3 ms per small() step in three such fusions).
    Here ``dd`` is a matrix product of its own, so the cotangents stay elementwise (loop fusions)."""
    sources, d, s, r, p = res
    dgroups, dd = _mix_grads(_one(sources), d, s, r, p, dh, wide)
    return tuple(g[0] for g in dgroups), dd


def _mix_grads(groups, d, s, r, p, dh, wide):
    """Each group's cotangent (in its dtype) and ``dd``, by `_mix_bwd`'s formulas."""
    dh = dh.astype(wide)
    D, rows = dh.shape[-1], _rows(groups)
    g = jnp.concatenate([jnp.sum(dh * v.astype(wide), axis=-1) for v in groups])
    dlogit = p * (g - jnp.sum(p * g, axis=0))
    on_d, on_v = dlogit * r, dlogit * s * r ** 3 / D
    dgroups = tuple((p[k][..., None] * dh + on_d[k][..., None] * d - on_v[k][..., None] * v.astype(wide)).astype(v.dtype)
                    for k, v in zip(rows, groups))
    # Contracted without flattening [k, B, T] into rows: a reshape that merges the token axis split
    # over `sequence` with the others made XLA gather whole-length fp32 copies of the buffer
    # (K3 at 1 M tokens: f32[8·1·1048576, 7168], 240 GB per device).
    dd = sum(_weighted_column_sum(on_d[k], v, wide) for k, v in zip(rows, groups))
    return dgroups, dd


def _weighted_column_sum(w: Float[Array, "k B T"], v: Float[Array, "k B T D"], wide) -> Float[Array, "D"]:
    """``Σ_{k,b,t} w·v`` in ``wide``, reading ``v`` in its own dtype.

    For a source narrower than ``wide`` the weights are split into three terms of ``v``'s dtype
    (``w = w₁ + w₂ + w₃`` to about 24 bits, exact for float32 weights and bf16 terms) and all three
    contract with ``v`` in one product (``[3, k·B·T] × [k·B·T, D]``, float32 accumulation). The plain
    ``einsum`` with ``v.astype(wide)`` made XLA write every source widened to float32 for the GEMM
    and read it back (per K3 layer at 8 K tokens, five ``f32[8192, 7168]`` copies, each read twice)."""
    if jnp.finfo(v.dtype).bits >= jnp.finfo(wide).bits:
        return jnp.einsum("kbt,kbtd->d", w, v.astype(wide))
    terms, rest = [], w.astype(wide)
    for _ in range(3):
        terms.append(rest.astype(v.dtype))
        rest = rest - terms[-1].astype(wide)
    split = jnp.einsum("jkbt,kbtd->jd", jnp.stack(terms), v, preferred_element_type=wide)
    return jnp.sum(split, axis=0)


_mix.defvjp(_mix_fwd, _mix_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _mix_stacked(buffer, count, partial, d, eps: float, wide) -> Float[Array, "B T D"]:
    """`_mix` of the first ``count`` slots of ``buffer [N, B, T, D]`` and ``partial``; the unused
    slots are masked out. The backward saves the buffer itself, once per mix (a scanned stack saves
    a layer's residuals per repetition: N slices saved separately would be N copies of it). The
    buffer is one group of the mix's math: one operation per term on the whole buffer."""
    return _mix_stacked_fwd(buffer, count, partial, d, eps, wide)[0]


def _mix_stacked_fwd(buffer, count, partial, d, eps, wide):
    groups = (buffer, partial[None])
    used = (jnp.arange(buffer.shape[0] + 1) < count).at[-1].set(True)
    s, r, p = _mix_terms(groups, d, eps, wide, used)
    return _mix_sum(groups, p, wide), (buffer, count, partial, d, s, r, p)


def _mix_stacked_bwd(eps, wide, res, dh):
    buffer, _, partial, d, s, r, p = res
    (dbuffer, dpartial), dd = _mix_grads((buffer, partial[None]), d, s, r, p, dh, wide)
    return dbuffer, None, dpartial[0], dd


_mix_stacked.defvjp(_mix_stacked_fwd, _mix_stacked_bwd)


class AttnResMix(nn.Module):
    """One mixing point: its pseudo-query ``query`` (init 0: uniform mixing) and key-norm weight ``norm``."""

    eps: float
    dtype: Any
    wide_dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, stream: "ResidualStream | StackedStream") -> Float[Array, "B T D"]:
        D = stream.partial.shape[-1]
        query = param(self, "query", nn.initializers.zeros, (D,), ("embed",), self.param_dtype)
        norm = param(self, "norm", nn.initializers.ones, (D,), ("embed",), self.param_dtype)
        direction = norm.astype(self.wide_dtype) * query.astype(self.wide_dtype)
        return stream.mix(direction, self.eps, self.wide_dtype).astype(self.dtype)

    def weights(self) -> tuple[Float[Array, "D"], Float[Array, "D"]]:
        """The stored ``(query, norm)`` (``k3jax.layers.mixed_input``, whose kernel mixes along ``norm ⊙ query``)."""
        return tuple(nn.meta.unbox(self.get_variable("params", n)) for n in ("query", "norm"))


def attn_res(cfg, name: str | None) -> AttnResMix:
    """An ``AttnResMix`` with the config's eps and dtypes."""
    return AttnResMix(cfg.attn_res.eps, cfg.compute_dtype, cfg.fp32_dtype, cfg.param_dtype, name=name)
