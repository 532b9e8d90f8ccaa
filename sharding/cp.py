"""Context parallelism: the tokens of each row split over the ``sequence`` mesh axis.

KDA (SPEC §2, "Context parallel"), exact and with communication independent of T:

1. each shard runs the chunked KDA from a zero state and, beside it, from the state ``I`` with
   values 0: the delta rule is linear in ``(S, v)``, so the first gives the local output and the
   increment ``N_r`` (``K×V``), the second the transition ``M_r`` (``K×K`` per head) and the
   read-out ``R_t = scale·q_tᵀ Φ_t`` of the state entering token t, with ``o = o_local + R S_r``.
   Both are ordinary ``chunk_kda`` calls (the Pallas kernel on GPU); with ``K = V`` they run as
   one call on the batch stacked twice;
2-3. prefix-scan ``S_{r+1} = M_r · reset_r(S_r) + N_r`` over the shards, where ``reset_r`` zeroes
   the state when shard r starts a new document: ``log2(R)`` exchanges of one composed
   ``(M, N)`` pair with a neighbour ``2^i`` shards away (``B·H·K·(K+V)`` values, whatever T is);
4. add the entering state's contribution ``R_t S_r`` to the local output (no second scan).

The short conv needs the ``W−1`` inputs before the shard: ``ppermute`` them from the previous
shard. MLA's context-parallel attention is in :mod:`sharding.cp_attention`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from pallas_kernels.kda import causal_conv1d, chunk_kda
from sharding.context import ParallelConfig, current


def _require_ctx(ctx: ParallelConfig | None, name: str) -> ParallelConfig:
    ctx = current() if ctx is None else ctx
    if ctx is None:
        raise ValueError(f"{name} needs a parallel context: use `with sharding.use_mesh(mesh):` or ctx=")
    return ctx


def _check_length(name: str, length: int, ctx: ParallelConfig, multiple: int = 1) -> None:
    shards = math.prod(ctx.axis_size(a) for a in ctx.length_axes)
    if length % (shards * multiple):
        raise ValueError(
            f"{name}: T={length} must be divisible by sequence shards × chunk = {shards} × {multiple} "
            f"= {shards * multiple} (mesh axes {ctx.length_axes})"
        )


def _check_batch(name: str, batch: int, ctx: ParallelConfig) -> None:
    shards = math.prod(ctx.axis_size(a) for a in ctx.batch_axes)
    if batch % shards:
        raise ValueError(f"{name}: batch B={batch} must be divisible by the {shards} batch shards {ctx.batch_axes}")


def _segments(segment_ids, batch: int, length: int):
    return jnp.zeros((batch, length), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)


def _entering_state(M, N, first, last, axis: str, shards: int):
    """This shard's entering state, by a prefix scan over the shards in ``log2(shards)`` exchanges.

    Shard ``r`` maps the state entering it to the one leaving it by ``S ↦ A_r S + N_r`` with
    ``A_r = M_r`` when it continues the previous shard's last document, else 0. Maps compose as
    ``(A₂, b₂) ∘ (A₁, b₁) = (A₂A₁, A₂b₁ + b₂)``; after round ``d = 1, 2, 4, …`` (Hillis–Steele) shard r
    holds the composition of shards ``r-2d+1 … r``, and the state leaving shard ``r-1`` is what
    enters ``r``. Each round sends one ``(A, b)`` (``B·H·K·(K+V)`` values): memory and traffic grow
    with ``log2(shards)``, where gathering every shard's pair grew with ``shards`` (K3 on 256
    sequence shards: 3.2 GB gathered per KDA layer and pass).
    """
    r = lax.axis_index(axis)
    to_next = lambda x, d=1: lax.ppermute(x, axis, [(i, i + d) for i in range(shards - d)])  # zeros below d
    keep = ((first == to_next(last)) & (r > 0))[:, None, None, None]  # same document continues
    mm = lambda a, b: jnp.einsum("BHKJ,BHJV->BHKV", a, b, precision=lax.Precision.HIGHEST)
    A, b = jnp.where(keep, M, 0.0), N
    d = 1
    while d < shards:
        A_prev, b_prev = to_next(A, d), to_next(b, d)  # shards below d receive zeros: the identity's b
        A, b = jnp.where(r >= d, mm(A, A_prev), A), mm(A, b_prev) + b
        d *= 2
    return jnp.where(keep, to_next(b), 0.0)


def _local_and_transition(q, k, v, g, beta, seg, **kw):
    """``(o_local, N, R, M)``: the shard's KDA from a zero state, and from ``I`` with values 0."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(K, dtype=jnp.float32), (B, H, K, K))
    run = functools.partial(chunk_kda, output_final_state=True, **kw)
    if K != V:
        o_local, N = run(q, k, v, g, beta, segment_ids=seg)
        R, M = run(q, k, jnp.zeros_like(k, v.dtype), g, beta, initial_state=eye, segment_ids=seg)
        return o_local, N, R, M
    # K = V (K3): one call on the batch stacked twice; also twice the kernel's parallel programs.
    two = lambda x: jnp.concatenate([x, x], axis=0)
    s0 = jnp.concatenate([jnp.zeros_like(eye), eye], axis=0)
    o, S = run(two(q), two(k), jnp.concatenate([v, jnp.zeros_like(v)], axis=0), two(g), two(beta),
               initial_state=s0, segment_ids=two(seg))
    return o[:B], S[:B], o[B:], S[B:]


def _kda_body(q, k, v, g, beta, seg, *, axis, shards, scale, chunk_size, implementation, gpu_prep_backward):
    kw = dict(scale=scale, chunk_size=chunk_size, implementation=implementation,
              gpu_prep_backward=gpu_prep_backward)
    if shards == 1:  # rows whole on this device: no state crosses devices
        return chunk_kda(q, k, v, g, beta, segment_ids=seg, **kw)[0]
    o_local, N, R, M = _local_and_transition(q, k, v, g, beta, seg, **kw)
    S0 = _entering_state(M, N, seg[:, 0], seg[:, -1], axis, shards)  # [B, H, K, V] fp32
    dt = jnp.promote_types(R.dtype, jnp.float32)
    entering = jnp.einsum("BTHK,BHKV->BTHV", R.astype(dt), S0.astype(dt), precision=lax.Precision.HIGHEST)
    return (o_local.astype(dt) + entering).astype(v.dtype)


def chunk_kda_cp(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T H V"],
    g: Float[Array, "B T H K"],
    beta: Float[Array, "B T H"],
    *,
    scale: float | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
    chunk_size: int = 64,
    implementation: str | None = None,
    gpu_prep_backward: str = "split",
    ctx: ParallelConfig | None = None,
) -> Float[Array, "B T H V"]:
    """``pallas_kernels.kda.chunk_kda`` (from a zero state) with T split over the sequence axis.

    ``implementation`` and ``gpu_prep_backward`` are passed to every ``chunk_kda`` call.
    """
    ctx = _require_ctx(ctx, "chunk_kda_cp")
    B, T, H, K = q.shape
    # Shards must hold whole chunks, so each shard's chunking equals the unsplit one's.
    _check_length("chunk_kda_cp", T, ctx, chunk_size if ctx.sequence_parallel else 1)
    _check_batch("chunk_kda_cp", B, ctx)
    scale = K**-0.5 if scale is None else float(scale)
    head = ctx.spec("batch", "length", "heads", "head_dim")
    body = functools.partial(_kda_body, axis=ctx.sequence_axis, shards=ctx.sequence_size, scale=scale,
                             chunk_size=chunk_size, implementation=implementation,
                             gpu_prep_backward=gpu_prep_backward)
    args = (q, k, v, g, beta, _segments(segment_ids, B, T))
    specs = (head,) * 4 + (ctx.spec("batch", "length", "heads"), ctx.spec("batch", "length"))
    fn = jax.shard_map(body, mesh=ctx.mesh, check_vma=False, out_specs=head, in_specs=ctx.in_specs(specs, *args))
    return fn(*args)


def _conv_body(x, weight, seg, *, axis, shards):
    W = weight.shape[1]
    if shards == 1 or W == 1:
        return causal_conv1d(x, weight, segment_ids=seg)[0]
    # The last W-1 inputs of this shard's last document (zeros where an earlier one).
    _, tail = causal_conv1d(x[:, -(W - 1):], weight, segment_ids=seg[:, -(W - 1):])
    to_next = [(r, r + 1) for r in range(shards - 1)]
    prev_tail = lax.ppermute(tail, axis, to_next)  # shard 0 receives zeros
    prev_last = lax.ppermute(seg[:, -1], axis, to_next)
    same_doc = (seg[:, 0] == prev_last) & (lax.axis_index(axis) > 0)
    history = jnp.where(same_doc[:, None, None], prev_tail, 0.0)
    y, _ = causal_conv1d(x, weight, initial_state=history, segment_ids=seg)
    return y


def causal_conv1d_cp(
    x: Float[Array, "B T C"],
    weight: Float[Array, "C W"],
    *,
    segment_ids: Int[Array, "B T"] | None = None,
    ctx: ParallelConfig | None = None,
) -> Float[Array, "B T C"]:
    """``pallas_kernels.kda.causal_conv1d`` (no initial state) with T split over the sequence axis.

    The channel axis ``C`` is the flattened ``H·K`` of the KDA projections (logical ``heads``).
    """
    ctx = _require_ctx(ctx, "causal_conv1d_cp")
    B, T, C = x.shape
    W = weight.shape[1]
    _check_length("causal_conv1d_cp", T, ctx)
    _check_batch("causal_conv1d_cp", B, ctx)
    if W > 1 and T // ctx.sequence_size < W - 1:
        raise ValueError(f"causal_conv1d_cp: each shard's T={T // ctx.sequence_size} must be >= W-1={W - 1}")
    act = ctx.spec("batch", "length", "heads")
    body = functools.partial(_conv_body, axis=ctx.sequence_axis, shards=ctx.sequence_size)
    args = (x, weight, _segments(segment_ids, B, T))
    specs = (act, ctx.spec("heads", None), ctx.spec("batch", "length"))
    fn = jax.shard_map(body, mesh=ctx.mesh, check_vma=False, out_specs=act, in_specs=ctx.in_specs(specs, *args))
    return fn(*args)
