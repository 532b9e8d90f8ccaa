"""Public ops: ``mla_attention`` (causal MLA attention with document masks, SPEC §3) and its switch;
``cached_attention`` (decode over the compressed cache, at the end of this file).

``implementation``: ``None`` runs the flash kernels (the forward in Mosaic GPU, :mod:`kernel_gpu_fwd`,
where it takes the call; the backward and the other forwards in Pallas-Triton, :mod:`kernel_gpu`) when
compiling for a CUDA GPU
(:func:`pallas_kernels.target.current_target`) for
bf16/f16 inputs and the dense reference otherwise; ``"xla"`` is always the reference;
``"pallas"`` needs a CUDA GPU and bf16/f16 inputs, or ``interpret=True`` (the CPU
interpreter runs the same kernels). Gradients of the kernel path go through ``jax.custom_vjp``
(FlashAttention-2 backward kernels); ``max_logit`` is a statistic, returned under
``stop_gradient`` on every path.

The kernel path zero-pads head widths to powers of two (>= 16; exact for ``q·k`` and ``p·v``)
and the sequences to multiples of the blocks: padded rows come after every real row, so the
causal mask already hides them from real queries, and their outputs and row maxima are dropped.

``q_start`` (context parallel, chunked prefill): queries at positions ``q_start + t`` against a longer
key sequence, the offset traced (a scalar, or one per row; one int32 read by every kernel program), so
every shard runs the same compiled kernels; the key blocks a shard's queries cannot reach are skipped,
not masked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.mla_attention.kernel_gpu import BlockSizes
from pallas_kernels.mla_attention.reference import mla_attention_reference
from pallas_kernels.mla_attention.reference_decode import cached_attention_reference
from pallas_kernels.target import current_target

_KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
IMPLEMENTATIONS = (None, "xla", "pallas")


def _cuda_gpu() -> bool:
    """Compiling for an NVIDIA GPU (the target of :mod:`pallas_kernels.target`, not the host)."""
    return current_target().cuda


def resolve_implementation(implementation: str | None, dtype, interpret: bool = False) -> str:
    """``"xla"`` or ``"pallas"``: which path runs; ValueError when ``"pallas"`` cannot."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "xla":
        return "xla"
    if jnp.dtype(dtype) not in _KERNEL_DTYPES:
        if implementation == "pallas":
            raise ValueError(f"implementation='pallas' needs bfloat16 or float16 inputs, got {jnp.dtype(dtype)}")
        return "xla"
    if interpret or _cuda_gpu():
        return "pallas"
    if implementation == "pallas":
        raise ValueError("implementation='pallas' needs a CUDA GPU (or interpret=True); "
                         f"compiling for {current_target().platform!r}")
    return "xla"


def pow2_width(d: int) -> int:
    """The kernels' head width for ``d``: a power of two, at least 16."""
    return max(16, 1 << max(d - 1, 0).bit_length())


def padded_length(blocks: BlockSizes, n: int, *, keys: bool) -> int:
    """``n`` query (or key) rows rounded up to a multiple of every kernel's query (key) block."""
    step = max(blocks.key_blocks if keys else blocks.query_blocks)
    return -(-n // step) * step


def pad_axis(x, axis: int, size: int):
    """``x`` zero-padded at the end of ``axis`` to ``size``."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def flash_forward(qn, qr, kn, kr, v, q_seg, k_seg, q_start, *, scale, blocks, interpret, out_dtype=None):
    """``(o in out_dtype (default the inputs'), lse, row max)``: the Mosaic GPU forward
    (:mod:`kernel_gpu_fwd`) where ``blocks.mosaic_forward`` asks for it and it takes the call, the
    Triton one (:mod:`kernel_gpu`) otherwise."""
    from pallas_kernels.mla_attention import kernel_gpu, kernel_gpu_fwd
    out_dtype = out_dtype or qn.dtype
    widths = (qn.shape[-1], qr.shape[-1], v.shape[-1])
    if blocks.mosaic_forward and kernel_gpu_fwd.accepts(qn.shape[1], kn.shape[1], *widths, qn.dtype, out_dtype):
        return kernel_gpu_fwd.flash_forward(qn, qr, kn, kr, v, q_seg, k_seg, q_start, scale=scale,
                                            interpret=interpret, out_dtype=out_dtype)
    return kernel_gpu.flash_forward(qn, qr, kn, kr, v, q_seg, k_seg, q_start, scale=scale, blocks=blocks,
                                    interpret=interpret, out_dtype=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def _flash(qn, qr, kn, kr, v, q_seg, k_seg, q_start, scale, blocks, interpret):
    o, _, row_max = flash_forward(qn, qr, kn, kr, v, q_seg, k_seg, q_start, scale=scale, blocks=blocks,
                                  interpret=interpret)
    return o, row_max


def _flash_fwd(qn, qr, kn, kr, v, q_seg, k_seg, q_start, scale, blocks, interpret):
    o, lse, row_max = flash_forward(qn, qr, kn, kr, v, q_seg, k_seg, q_start, scale=scale, blocks=blocks,
                                    interpret=interpret)
    return (o, row_max), (qn, qr, kn, kr, v, q_seg, k_seg, q_start, o, lse)


def _flash_bwd(scale, blocks, interpret, res, cotangents):
    from pallas_kernels.mla_attention import kernel_gpu
    qn, qr, kn, kr, v, q_seg, k_seg, q_start, o, lse = res
    do, _ = cotangents  # the row max is a statistic (stop_gradient in mla_attention)
    wide = lambda x: x.astype(jnp.float32)
    delta = jnp.einsum("BTHV,BTHV->BHT", wide(o), wide(do))  # FlashAttention-2 D = rowsum(dO ⊙ O), fp32
    dqn, dqr, dkn, dkr, dv = kernel_gpu.flash_backward(qn, qr, kn, kr, v, q_seg, k_seg, q_start, do.astype(v.dtype),
                                                       lse, delta, scale=scale, blocks=blocks, interpret=interpret)
    dkr = jnp.sum(dkr, axis=2).astype(kr.dtype)  # shared rope key: sum over heads
    return dqn, dqr, dkn, dkr, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def _check_shapes(q_nope, q_rope, k_nope, k_rope, v, segment_ids, key_segment_ids, q_start):
    if q_nope.ndim != 4 or k_nope.ndim != 4:
        raise ValueError(f"q_nope and k_nope must be [B, T, H, N], got shapes {q_nope.shape}, {k_nope.shape}")
    B, T, H, N = q_nope.shape
    S = k_nope.shape[1]
    if q_start is None and S != T:
        raise ValueError(f"k_nope must have shape {(B, T, H, N)} without q_start, got {tuple(k_nope.shape)}")
    expected = dict(q_rope=(B, T, H, q_rope.shape[-1]), k_nope=(B, S, H, N), k_rope=(B, S, q_rope.shape[-1]),
                    v=(B, S, H, v.shape[-1]), segment_ids=(B, T), key_segment_ids=(B, S))
    given = dict(q_rope=q_rope, k_nope=k_nope, k_rope=k_rope, v=v, segment_ids=segment_ids,
                 key_segment_ids=key_segment_ids)
    for name, shape in expected.items():
        if given[name] is not None and tuple(given[name].shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(given[name].shape)}")
    if (segment_ids is None) != (key_segment_ids is None) and q_start is not None:
        raise ValueError("segment_ids and key_segment_ids must be given together with q_start")
    if q_start is not None and jnp.shape(q_start) not in ((), (B,)):
        raise ValueError(f"q_start must be a scalar or one offset per row [B={B}], got shape {jnp.shape(q_start)}")
    if isinstance(q_start, int) and not 0 <= q_start <= S - T:
        raise ValueError(f"q_start must be in [0, {S - T}] (S - T: every query needs its keys), got {q_start}")
    dtypes = {x.dtype for x in (q_nope, q_rope, k_nope, k_rope, v)}
    if len(dtypes) != 1:
        raise ValueError(f"q_nope, q_rope, k_nope, k_rope and v must share one dtype, got {sorted(map(str, dtypes))}")


def mla_attention(q_nope: Float[Array, "B T H N"], q_rope: Float[Array, "B T H R"],
                  k_nope: Float[Array, "B S H N"], k_rope: Float[Array, "B S R"], v: Float[Array, "B S H V"],
                  segment_ids: Int[Array, "B T"] | None = None, *, scale: float,
                  implementation: str | None = None, interpret: bool = False,
                  blocks: BlockSizes | None = None, q_start: int | Int[Array, ""] | Int[Array, "B"] | None = None,
                  key_segment_ids: Int[Array, "B S"] | None = None
                  ) -> tuple[Float[Array, "B T H V"], Float[Array, "H"]]:
    """Causal attention of ``q = [q_nope, q_rope]`` over ``k = [k_nope, k_rope (shared)]`` within each
    document; returns ``(o [B,T,H,V] in the inputs' dtype, max_logit [H] in promote(dtype, float32))``:
    ``o`` is normalised in float32 and rounded once (the kernel writes bf16 ``o`` directly: half the
    bytes of its write, of the backward's ``rowsum(dO ⊙ O)`` read and of the cotangent).

    Self-attention by default (``S == T``). With ``q_start`` (an int or a traced int32 scalar) the
    queries are rows ``q_start .. q_start+T-1`` of the ``S`` keys (``q_start + T <= S``): context
    parallel's shard of queries against the gathered keys. ``segment_ids`` then label the queries
    and ``key_segment_ids`` the keys (both or neither; ``segment_ids[t]`` must equal
    ``key_segment_ids[q_start + t]``). ``q_start`` may also give each row its own offset ``[B]``
    (chunked prefill of rows whose caches hold different lengths).
    """
    _check_shapes(q_nope, q_rope, k_nope, k_rope, v, segment_ids, key_segment_ids, q_start)
    B, T, H, N = q_nope.shape
    S, R, V = k_nope.shape[1], q_rope.shape[-1], v.shape[-1]
    key_seg = segment_ids if q_start is None else key_segment_ids
    if resolve_implementation(implementation, q_nope.dtype, interpret) == "xla":
        o, max_logit = mla_attention_reference(q_nope, q_rope, k_nope, k_rope, v, segment_ids, scale=scale,
                                               q_start=0 if q_start is None else q_start,
                                               key_segment_ids=key_seg)
        return o.astype(q_nope.dtype), jax.lax.stop_gradient(max_logit)
    blocks = (blocks or BlockSizes()).clipped(T, S)
    Tp, Sp = padded_length(blocks, T, keys=False), padded_length(blocks, S, keys=True)
    if q_start is None:  # self-attention: one padded length for both
        Tp = Sp = max(Tp, Sp)
    q_seg = jnp.zeros((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    k_seg = jnp.zeros((B, S), jnp.int32) if key_seg is None else key_seg.astype(jnp.int32)
    start = jnp.zeros((B,), jnp.int32) if q_start is None else jnp.broadcast_to(q_start, (B,)).astype(jnp.int32)
    pad = lambda x, width, length: pad_axis(pad_axis(x, x.ndim - 1, width), 1, length)
    o, row_max = _flash(pad(q_nope, pow2_width(N), Tp), pad(q_rope, pow2_width(R), Tp),
                        pad(k_nope, pow2_width(N), Sp), pad(k_rope, pow2_width(R), Sp),
                        pad(v, pow2_width(V), Sp), pad_axis(q_seg, 1, Tp), pad_axis(k_seg, 1, Sp), start,
                        float(scale), blocks, interpret)
    max_logit = jnp.max(jax.lax.stop_gradient(row_max)[:, :, :T], axis=(0, 2))
    return o[:, :T, :, :V], max_logit


def cached_attention(q_c: Float[Array, "B T H R"], q_r: Float[Array, "B T H K"], latent: Float[Array, "B S C"],
                     last: Int[Array, "B T"], scale: float, *, implementation: str | None = None,
                     interpret: bool = False) -> Float[Array, "B T H R"]:
    """Decode's absorbed attention over the compressed cache (``reference_decode`` states the contract).

    ``implementation``: ``None`` runs the decode kernel (:mod:`kernel_gpu_decode`) when compiling for a
    CUDA GPU and it takes the shapes (power-of-two latent and rope widths), the reference
    otherwise; ``"xla"`` is the reference; ``"pallas"`` is the kernel (a CUDA GPU or ``interpret=True``),
    ``ValueError`` naming what it cannot take."""
    from pallas_kernels.mla_attention import kernel_gpu_decode
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "pallas":
        kernel_gpu_decode.check_inputs(q_c, q_r, latent, last)
        if not (interpret or _cuda_gpu()):
            raise ValueError("implementation='pallas' needs a CUDA GPU (or interpret=True); "
                             f"compiling for {current_target().platform!r}")
    elif implementation == "xla" or not (_cuda_gpu() and kernel_gpu_decode.accepts(q_c, q_r, latent, last)):
        return cached_attention_reference(q_c, q_r, latent, last, scale)
    return kernel_gpu_decode.cached_attention_pallas(q_c, q_r, latent, last, scale=float(scale), interpret=interpret)
