"""Context-parallel MLA attention (SPEC §3): the tokens of each row split over the ``sequence`` axis.

Each shard all-gathers only the compressed latent ``[c_kv, k_rope]`` (576 values/token for K3)
and the segment ids and attends with its own queries at their absolute positions, expanding
``[k_nope, v]`` for every head locally, a block of keys at a time. Backward, the all-gather
transposes into a reduce-scatter of the latent's gradient: per-head keys never cross devices.

Flash path (on a CUDA GPU for bf16/f16 latents, or under the interpreter): the Pallas flash
kernels over the gathered latent a key chunk at a time, combined by log-sum-exp
(:mod:`sharding.latent_flash`); chunks past the shard's last query are not visited, so shard ``r``
of ``R`` works on ``r + 1`` of ``R`` shards' keys. The zig-zag schedule
(``balanced``; Llama 3, arXiv:2407.21783 §3.3.2, which also all-gathers keys) evens that
out: the sequence is cut into ``2R`` chunks, shard ``r`` holds chunks ``2r, 2r+1`` and computes
chunks ``r`` and ``2R-1-r``, whose reach sums to the same ``2R+1`` chunks on every shard. Each
half of the local queries goes to its computing shard by one ``ppermute`` and its output comes
back by the inverse one; outputs are the unsharded attention's rows (to the rounding of the
kernel's bf16 probabilities, which are scaled per chunk).

XLA path (other dtypes or devices, TPU among them): the shard's queries over all keys key block by
key block, each block's per-head keys expanded from the gathered latent (:mod:`sharding.latent_attention`),
so neither the expanded keys nor the logits of all keys exist at once (K3 at a 1 M-token context:
100 GB and 3 TB per sequence, dense).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from pallas_kernels.mla_attention import BlockSizes, resolve_implementation
from sharding.context import ParallelConfig
from sharding.cp import _check_batch, _check_length, _require_ctx, _segments
from sharding.latent_attention import latent_attention
from sharding.latent_flash import latent_flash


def zigzag_routes(shards: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``ppermute`` pairs (source, destination) for the first and second half of every shard:
    half ``h`` of shard ``s`` is chunk ``c = 2s + h`` and goes to shard ``c`` if ``c < R``, else
    ``2R-1-c``. Within one half the destinations differ (low chunks land on shards of one parity,
    high chunks on the other), so each half is a permutation."""
    dest = lambda c: c if c < shards else 2 * shards - 1 - c
    return tuple([(s, dest(2 * s + h)) for s in range(shards)] for h in (0, 1))


def _gather(c, k_rope, seg, *, axis):
    """The row's whole latent, rope key and segment ids: the only activations that move."""
    gather = functools.partial(lax.all_gather, axis_name=axis, axis=1, tiled=True)
    return gather(c), gather(k_rope), gather(seg)


def _flash_body(q, c, k_rope, kv_b, seg, *, axis, shards, batch_axes, scale, nope_dim, balanced, interpret,
                blocks):
    Tl = q.shape[1]
    dt = c.dtype  # the kernels' operand dtype (bf16/f16)
    c_all, kr_all, seg_all = _gather(c, k_rope.astype(dt), seg, axis=axis)
    q = q.astype(dt)

    def attend(rows, start):
        q_seg = lax.dynamic_slice_in_dim(seg_all, start, rows.shape[1], axis=1)
        return latent_flash(rows, c_all, kr_all, kv_b.astype(dt), q_seg, seg_all, start, scale=scale,
                            nope_dim=nope_dim, blocks=blocks, interpret=interpret)

    r = lax.axis_index(axis)
    if not balanced:
        o, max_logit = attend(q, r * Tl)
    else:
        half = Tl // 2
        outs, maxima = [], []
        for h, route in enumerate(zigzag_routes(shards)):
            rows = lax.ppermute(q[:, h * half:(h + 1) * half], axis, route)
            # Received over route h: chunk r itself when r has parity h, else its mirror 2R-1-r.
            chunk = jnp.where(r % 2 == h, r, 2 * shards - 1 - r)
            o_h, m_h = attend(rows, chunk * half)
            outs.append(lax.ppermute(o_h, axis, [(d, s) for s, d in route]))  # back to the rows' owner
            maxima.append(m_h)
        o, max_logit = jnp.concatenate(outs, axis=1), jnp.maximum(*maxima)
    # A statistic (QK-Clip reads it): already under stop_gradient; pmax over every shard of tokens.
    return o, lax.pmax(max_logit, batch_axes + (axis,))


def _xla_body(q, c, k_rope, kv_b, seg, *, axis, batch_axes, scale, nope_dim):
    c_all, kr_all, seg_all = _gather(c, k_rope, seg, axis=axis)
    start = lax.axis_index(axis) * q.shape[1]
    o, max_logit = latent_attention(q, c_all, kr_all, kv_b, seg, seg_all, start, scale=scale, nope_dim=nope_dim)
    # pmax has no differentiation rule, and the statistic takes no gradient anyway.
    return o, lax.pmax(max_logit, batch_axes + (axis,))


def _use_balanced(balanced: bool | None, length: int, shards: int) -> bool:
    if shards == 1 or balanced is False:
        return False
    divisible = length % (2 * shards) == 0  # two equal query halves per shard
    if balanced and not divisible:
        raise ValueError(f"mla_attention_cp: balanced=True needs T={length} divisible by 2 × sequence shards "
                         f"= {2 * shards}")
    return divisible


def mla_attention_cp(
    q: Float[Array, "B T H Dq"],
    c_kv: Float[Array, "B T R"],
    k_rope: Float[Array, "B T Dr"],
    kv_b: Float[Array, "R H Dkv"],
    *,
    scale: float,
    nope_dim: int,
    segment_ids: Int[Array, "B T"] | None = None,
    implementation: str | None = None,
    balanced: bool | None = None,
    interpret: bool = False,
    blocks: BlockSizes | None = None,
    ctx: ParallelConfig | None = None,
) -> tuple[Float[Array, "B T H V"], Float[Array, "H"]]:
    """MLA attention with T split over the sequence axis; returns ``(o [B,T,H,V], max_logit [H])``.

    ``q = [q_nope, q_rope]`` (positions already applied, in the wide dtype), ``c_kv`` the
    normalised latent and ``k_rope`` the shared rope key; ``kv_b`` the up-projection
    ``[R, H, dn+dv]``. Only ``[c_kv, k_rope]`` and the segment ids cross shards (and, balanced,
    half of the queries and of the outputs). ``implementation`` as in
    ``pallas_kernels.mla_attention`` for ``c_kv``'s dtype: ``None`` runs the flash kernel on a CUDA
    GPU for bf16/f16 (``interpret=True``: under the CPU interpreter), ``"xla"`` the key-blocked path of
    :mod:`sharding.latent_attention` in ``q``'s dtype. ``balanced``:
    the flash path's zig-zag schedule; ``None`` runs it whenever T divides by 2 × shards.
    """
    ctx = _require_ctx(ctx, "mla_attention_cp")
    B, T, H, _ = q.shape
    _check_length("mla_attention_cp", T, ctx)
    _check_batch("mla_attention_cp", B, ctx)
    seq3 = ctx.spec("batch", "length", None)
    # Heads stay whole inside: the shared latent expands to every head on every shard.
    heads = ctx.spec("batch", "length", None, None)
    common = dict(axis=ctx.sequence_axis, batch_axes=ctx.batch_axes, scale=float(scale), nope_dim=nope_dim)
    if resolve_implementation(implementation, c_kv.dtype, interpret) == "pallas":
        body = functools.partial(_flash_body, **common, shards=ctx.sequence_size, interpret=interpret,
                                 blocks=blocks, balanced=_use_balanced(balanced, T, ctx.sequence_size))
    else:
        body = functools.partial(_xla_body, **common)
    args = (q, c_kv, k_rope, kv_b, _segments(segment_ids, B, T))
    fn = jax.shard_map(body, mesh=ctx.mesh, check_vma=False, out_specs=(heads, P()),
                       in_specs=ctx.in_specs((heads, seq3, seq3, P(), ctx.spec("batch", "length")), *args))
    return fn(*args)
