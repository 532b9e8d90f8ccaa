"""Public KDA ops: ``chunk_kda`` (training / prefill) and ``recurrent_kda_step`` (decode).

``implementation`` picks the path: ``"xla"`` is :func:`chunk_kda_reference` (always available,
exact for any gate and dtype, float64 included); ``"pallas"`` is the target platform's kernel (or, with
``interpret``, a named kernel in its interpreter); ``None`` takes Pallas when the platform has a kernel that
supports the inputs, else XLA. The platform is the one the code is compiled for
(:func:`pallas_kernels.target.current_target`: the mesh in context, so an ahead-of-time compile for
TPU devices on a CPU host gets the TPU kernel), not the host's default backend.

A backend is ``(fn, supports)``: ``fn(q, k, v, g, beta, *, scale, initial_state, segment_ids,
chunk_size, interpret) -> (o, final_state)`` is differentiable, returns ``o`` in ``v.dtype`` and the
state in fp32; ``supports`` (same arguments, or None) is a trace-time bool. ``_pallas_backend``
maps a platform to its backend: "tpu" is ``kernel_tpu`` (forward) with ``kernel_tpu_bwd``
(backward) wired here by ``custom_vjp``, "gpu" is ``kernel_gpu.chunk_kda_pallas``/``kernel_gpu.supports``
when that module exists.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.kda import kernel_gpu_decode
from pallas_kernels.kda.reference import chunk_kda_reference, compute_dtype, naive_recurrent_kda
from pallas_kernels.target import current_target

logger = logging.getLogger(__name__)
_LOGGED_PATHS: set[str] = set()

Implementation = Literal["xla", "pallas"] | None


def _log_path_once(path: str) -> None:
    if path not in _LOGGED_PATHS:
        _LOGGED_PATHS.add(path)
        logger.debug("chunk_kda: using the %s path", path)


def _check_floating(name: str, x) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must have a floating dtype, got {x.dtype}")


def _validate(q, k, v, g, beta, initial_state, segment_ids) -> None:
    """Shape/dtype checks at trace time; every message names the argument and what it must be."""
    if q.ndim != 4:
        raise ValueError(f"q must have shape [B, T, H, K], got {q.shape}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have shape [B, T, H, K] = {q.shape} like q, got {k.shape}")
    if v.ndim != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must have shape [B, T, H, V] = [{B}, {T}, {H}, V], got {v.shape}")
    if g.shape != q.shape:
        raise ValueError(f"g must have shape [B, T, H, K] = {q.shape} like q, got {g.shape}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must have shape [B, T, H] = {(B, T, H)}, got {beta.shape}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _check_floating(name, x)
    V = v.shape[-1]
    if initial_state is not None:
        if initial_state.shape != (B, H, K, V):
            raise ValueError(
                f"initial_state must have shape [B, H, K, V] = {(B, H, K, V)}, got {initial_state.shape}"
            )
        _check_floating("initial_state", initial_state)
    if segment_ids is not None:
        if segment_ids.shape != (B, T):
            raise ValueError(f"segment_ids must have shape [B, T] = {(B, T)}, got {segment_ids.shape}")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"segment_ids must have an integer dtype, got {segment_ids.dtype}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _tpu_kernel(q, k, v, g, beta, s0, segment_ids, scale, chunk_size, interpret):
    from pallas_kernels.kda import kernel_tpu

    return kernel_tpu.chunk_kda_fwd(
        q, k, v, g, beta, scale=scale, initial_state=s0, segment_ids=segment_ids,
        chunk_size=chunk_size, interpret=interpret,
    )


def _tpu_fwd(q, k, v, g, beta, s0, segment_ids, scale, chunk_size, interpret):
    from pallas_kernels.kda import kernel_tpu

    o, s_final, states = kernel_tpu.chunk_kda_fwd(
        q, k, v, g, beta, scale=scale, initial_state=s0, segment_ids=segment_ids,
        chunk_size=chunk_size, interpret=interpret, return_states=True,
    )
    return (o, s_final), (q, k, v, g, beta, s0, segment_ids, states)


def _tpu_bwd(scale, chunk_size, interpret, residuals, cotangents):
    """The TPU backward kernel: chunks in reverse from the forward's per-chunk entering states."""
    from pallas_kernels.kda import kernel_tpu_bwd

    q, k, v, g, beta, s0, segment_ids, states = residuals
    do, d_final = cotangents
    dq, dk, dv, dg, dbeta, ds0 = kernel_tpu_bwd.chunk_kda_bwd(
        q, k, v, g, beta, states, do, d_final, scale=scale, segment_ids=segment_ids,
        chunk_size=chunk_size, interpret=interpret,
    )
    return dq, dk, dv, dg, dbeta, ds0.astype(s0.dtype), None


_tpu_kernel.defvjp(_tpu_fwd, _tpu_bwd)


def _tpu_chunk_kda(q, k, v, g, beta, *, scale, initial_state, segment_ids, chunk_size, interpret):
    B, T, H, K = q.shape
    if initial_state is None:
        initial_state = jnp.zeros((B, H, K, v.shape[-1]), jnp.float32)
    if segment_ids is None:
        segment_ids = jnp.zeros((B, T), jnp.int32)
    return _tpu_kernel(
        q, k, v, g, beta, initial_state, segment_ids, scale, chunk_size, interpret
    )


def _tpu_supports(q, k, v, g, beta, *, scale, initial_state, segment_ids, chunk_size, interpret):
    from pallas_kernels.kda import kernel_tpu

    return kernel_tpu.supports(q, k, v, g, beta, initial_state=initial_state, chunk_size=chunk_size)


def _module_backend(module_name: str):
    """A backend living in a module that may not exist yet: ``(fn, supports)`` or ``None``."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:
            raise
        return None
    return module.chunk_kda_pallas, getattr(module, "supports", None)


def _pallas_backend(platform: str):
    """``(fn, supports_or_None)`` for a platform ("tpu", "gpu"), or ``None`` when it has no kernel."""
    if platform == "tpu":
        return _tpu_chunk_kda, _tpu_supports
    if platform == "gpu":
        return _module_backend("pallas_kernels.kda.kernel_gpu")
    return None


def _resolve(implementation, interpret, args: dict):
    """Pick ``(path_name, fn)``; raises ValueError when "pallas" cannot run here."""
    if implementation not in (None, "xla", "pallas"):
        raise ValueError(f"implementation must be None, 'xla' or 'pallas', got {implementation!r}")
    if interpret not in (False, True, "tpu", "gpu"):
        raise ValueError(f"interpret must be False, True, 'tpu' or 'gpu', got {interpret!r}")
    if implementation == "xla":
        return "xla", None
    # Interpret mode runs a named backend's kernel on any host; True means the TPU kernel,
    # whose interpreter also runs on CPU.
    platform = ("tpu" if interpret is True else interpret) if interpret else current_target().platform
    backend = _pallas_backend(platform)
    if backend is None:
        if implementation == "pallas":
            raise ValueError(
                f"implementation='pallas' needs a GPU or TPU kernel, none for platform {platform!r}; "
                "use implementation='xla' or interpret=True"
            )
        return "xla", None
    fn, supports = backend
    if supports is not None and not supports(**args):
        if implementation == "pallas":
            raise ValueError(f"implementation='pallas': the {platform} kernel does not support these inputs")
        return "xla", None
    return f"pallas-{platform}{'-interpret' if interpret else ''}", fn


def chunk_kda(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T H V"],
    g: Float[Array, "B T H K"],
    beta: Float[Array, "B T H"],
    *,
    scale: float | None = None,
    initial_state: Float[Array, "B H K V"] | None = None,
    output_final_state: bool = False,
    segment_ids: Int[Array, "B T"] | None = None,
    implementation: Implementation = None,
    chunk_size: int = 64,
    interpret: bool | Literal["tpu", "gpu"] = False,
    gpu_prep_backward: Literal["xla", "split"] = "split",
) -> tuple[Float[Array, "B T H V"], Float[Array, "B H K V"] | None]:
    """Chunkwise Kimi Delta Attention (SPEC §2); returns ``(o, final_state or None)``.

    q, k must already be L2-normalised; g is the per-channel log-decay (fp32, ``<= 0``); beta in
    (0, 1). ``o`` has ``v.dtype``; the final state is fp32 (float64 for float64 inputs).
    ``segment_ids`` (None = one document per row): a change of id at t zeroes the state before
    token t; ``initial_state`` enters token 0. ``scale`` is a Python number (default ``K**-0.5``).
    ``interpret`` runs a Pallas kernel in its interpreter on any host (True = the TPU kernel).
    ``gpu_prep_backward`` is the GPU kernel path's intra-chunk prep backward under ``jax.grad``:
    ``"split"`` (default: two Mosaic GPU kernels, ``kernel_gpu_prep_bwd_split``; the fastest on the
    H200) or ``"xla"`` (XLA autodiff, the reference); other paths ignore it. (``"kernel"``, one
    Mosaic GPU kernel, and ``"split-saved"``, ``"split"`` reading the forward's saved inverse, lost
    on the H200 and were deleted: ``pallas_kernels/kda/DESIGN_BWD.md``.)
    """
    if gpu_prep_backward not in ("xla", "split"):
        raise ValueError(f"gpu_prep_backward must be 'xla' or 'split', got {gpu_prep_backward!r}")
    _validate(q, k, v, g, beta, initial_state, segment_ids)
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    args = dict(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
        segment_ids=segment_ids, chunk_size=chunk_size, interpret=bool(interpret),
    )
    path, fn = _resolve(implementation, interpret, args)
    _log_path_once(path)
    if fn is None:
        args.pop("interpret")
        o, state = chunk_kda_reference(**args)
    else:
        if path.startswith("pallas-gpu"):
            args["prep_bwd"] = gpu_prep_backward
        o, state = fn(**args)
    return o, (state if output_final_state else None)


def recurrent_kda_step(
    q: Float[Array, "B Tn H K"],
    k: Float[Array, "B Tn H K"],
    v: Float[Array, "B Tn H V"],
    g: Float[Array, "B Tn H K"],
    beta: Float[Array, "B Tn H"],
    state: Float[Array, "B H K V"],
    *,
    scale: float | None = None,
    implementation: Implementation = None,
    interpret: bool = False,
) -> tuple[Float[Array, "B Tn H V"], Float[Array, "B H K V"]]:
    """Decode: advance ``state`` over a few new tokens per sequence; returns ``(o, new_state)``.

    Same recurrence as :func:`naive_recurrent_kda`; the state stays fp32 (float64 for f64 inputs).
    ``implementation``: ``"xla"`` is that recurrence; ``"pallas"`` the GPU kernel
    (``kernel_gpu_decode``: each state read and written once; ``interpret=True`` runs it in the CPU
    interpreter); None takes the kernel when compiling for a CUDA GPU, it supports the inputs and there
    are at least ``kernel_gpu_decode.MIN_STATES`` (sequence, head) states.
    """
    if implementation not in (None, "xla", "pallas"):
        raise ValueError(f"implementation must be None, 'xla' or 'pallas', got {implementation!r}")
    _validate(q, k, v, g, beta, state, None)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    target = current_target()
    fits = kernel_gpu_decode.supports(q, k, v, g, beta, state)
    if implementation == "pallas" and not fits:
        raise ValueError("implementation='pallas': the decode kernel needs an fp32 state, no float64 input and "
                         f"power-of-two head widths >= 16, got K={q.shape[-1]}, V={v.shape[-1]}, state {state.dtype}")
    if implementation == "pallas" and not (interpret or (target.platform == "gpu" and target.cuda)):
        raise ValueError(f"implementation='pallas' needs a CUDA GPU (target {target.platform!r}); "
                         "use implementation='xla' or interpret=True")
    large = q.shape[0] * q.shape[2] >= kernel_gpu_decode.MIN_STATES
    if implementation == "pallas" or (implementation is None and fits and large and target.platform == "gpu"
                                      and target.cuda):
        return kernel_gpu_decode.recurrent_step_pallas(q, k, v, g, beta, state, scale=scale, interpret=bool(interpret))
    dt = compute_dtype(q, k, v, g, beta, state)
    return naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=state.astype(dt))


__all__ = ["chunk_kda", "recurrent_kda_step"]
