"""Argument checks for the MoE ops: shapes and dtypes at trace time, values when concrete,
and an opt-in ``checkify`` mode for traced group sizes."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify


def _concrete(x):
    """``x`` as numpy when its value is known at trace time, else None."""
    if isinstance(x, jax.core.Tracer):
        return None
    try:
        return np.asarray(x)
    except (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return None


def check_grouped_matmul_args(lhs, rhs, group_sizes, *, checked: bool = False) -> None:
    """Raise ValueError for malformed ``grouped_matmul`` arguments.

    With ``checked=True`` also emit ``checkify.check``s on traced group sizes (run the op
    under ``jax.experimental.checkify.checkify`` to read them).
    """
    if lhs.ndim != 2:
        raise ValueError(f"lhs must be [M, K], got shape {lhs.shape}")
    if rhs.ndim != 3:
        raise ValueError(f"rhs must be [E, K, N], got shape {rhs.shape}")
    if rhs.shape[1] != lhs.shape[1]:
        raise ValueError(f"rhs.shape[1] must equal K=lhs.shape[1]={lhs.shape[1]}, got {rhs.shape[1]}")
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"group_sizes must have shape (E,)=({rhs.shape[0]},), got {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be an integer array, got dtype {group_sizes.dtype}")
    if lhs.dtype != rhs.dtype:
        raise ValueError(f"rhs.dtype must equal lhs.dtype={lhs.dtype}, got {rhs.dtype}")
    if not jnp.issubdtype(lhs.dtype, jnp.floating):
        raise ValueError(f"lhs must be floating point, got {lhs.dtype}")
    check_group_sizes(group_sizes, lhs.shape[0], checked=checked)


def check_group_sizes(group_sizes, m: int, *, checked: bool = False) -> None:
    """Group sizes must be >= 0 and sum to at most ``m`` rows."""
    gs = _concrete(group_sizes)
    if gs is not None:
        if (gs < 0).any():
            raise ValueError(f"group_sizes must be >= 0, got {gs.tolist()}")
        if int(gs.sum()) > m:
            raise ValueError(f"sum(group_sizes) must be <= M={m}, got {int(gs.sum())}")
    elif checked:
        checkify.check(jnp.all(group_sizes >= 0), "group_sizes must be >= 0")
        checkify.check(jnp.sum(group_sizes) <= m, f"sum(group_sizes) must be <= M={m}")


def check_moe_ffn_args(x, topk_ids, topk_weights, w1, w3, w2, activation, *, checked=False) -> None:
    """Raise ValueError for malformed ``moe_ffn`` arguments (see its docstring for shapes)."""
    if x.ndim != 2:
        raise ValueError(f"x must be [T, L], got shape {x.shape}")
    t, l = x.shape
    if topk_ids.ndim != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids must be [T, k] with T={t}, got {topk_ids.shape}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights must have shape topk_ids.shape={topk_ids.shape}, got {topk_weights.shape}")
    if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
        raise ValueError(f"topk_ids must be integer, got {topk_ids.dtype}")
    if not jnp.issubdtype(topk_weights.dtype, jnp.floating):
        raise ValueError(f"topk_weights must be floating (float32), got {topk_weights.dtype}")
    if w1.ndim != 3 or w1.shape[1] != l:
        raise ValueError(f"w1 must be [E, L, F] with L={l}, got {w1.shape}")
    e, _, f = w1.shape
    if w3.shape != w1.shape:
        raise ValueError(f"w3 must have shape w1.shape={w1.shape}, got {w3.shape}")
    if w2.shape != (e, f, l):
        raise ValueError(f"w2 must be [E, F, L]={(e, f, l)}, got {w2.shape}")
    for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
        if w.dtype != x.dtype:
            raise ValueError(f"{name}.dtype must equal x.dtype={x.dtype}, got {w.dtype}")
    if activation not in ("situ", "swiglu"):
        raise ValueError(f"activation must be 'situ' or 'swiglu', got {activation!r}")
    ids = _concrete(topk_ids)
    if ids is not None:
        if ids.size and (ids.min() < 0 or ids.max() >= e):
            raise ValueError(f"topk_ids must lie in [0, E={e}), got range [{ids.min()}, {ids.max()}]")
    elif checked:
        checkify.check(jnp.all((topk_ids >= 0) & (topk_ids < e)), f"topk_ids must lie in [0, E={e})")


def check_decode_expert_args(x, ids, weights, w1, w3, w2, kernel: str) -> tuple[int, int, int]:
    """``(E, L, F)`` of a decode kernel's routed-expert operands (``kernel`` names it in the errors),
    or ``ValueError``: plain ``[E, in, out]`` weights, ``x [T, L]``, ``ids`` / ``weights [T, k]``."""
    for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
        if not isinstance(w, jax.Array | jax.ShapeDtypeStruct) or w.ndim != 3:
            raise ValueError(f"{name} must be a plain [E, in, out] array for the {kernel} "
                             f"(MXFP4 weights take implementation='xla'), got {type(w).__name__}")
    if x.ndim != 2 or ids.shape != weights.shape or ids.ndim != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"x must be [T, L], ids and weights [T, k], got x {x.shape}, ids {ids.shape}, "
                         f"weights {weights.shape}")
    E, L, F = w1.shape
    if w3.shape != (E, L, F) or w2.shape != (E, F, L) or x.shape[1] != L:
        raise ValueError(f"w1, w3 must be [E, L, F] and w2 [E, F, L] with L = x.shape[1]={x.shape[1]}, "
                         f"got {w1.shape}, {w3.shape}, {w2.shape}")
    return E, L, F


def passes(check, *args) -> bool:
    """Whether ``check(*args)`` returns without ``ValueError`` (a kernel's ``accepts``)."""
    try:
        check(*args)
    except ValueError:
        return False
    return True
