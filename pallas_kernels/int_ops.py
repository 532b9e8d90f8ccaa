"""Integer index arithmetic that holds with and without ``jax_enable_x64``.

``lax.div`` and ``lax.rem`` do not promote, and under ``jax_enable_x64`` a Python ``int`` operand
becomes int64: ``lax.div(int32_iota, 4)`` (and ``pl.cdiv``, which calls it) raises in every x64
program. These take a Python divisor in the dividend's dtype, so kernels index in int32 (or in a
loop index's own dtype) whatever the flag. Truncating division, as ``lax.div``: callers divide
non-negative indices, where it equals the floor without ``//``'s sign fix-up.
"""

import jax
import jax.numpy as jnp
from jax import lax


def _as_dtype_of(x: jax.Array, d: jax.Array | int) -> jax.Array:
    return jnp.asarray(d, x.dtype) if isinstance(d, int) else d


def div(x: jax.Array, d: jax.Array | int) -> jax.Array:
    """``x / d`` truncated toward zero (``lax.div``)."""
    return lax.div(x, _as_dtype_of(x, d))


def rem(x: jax.Array, d: jax.Array | int) -> jax.Array:
    """Remainder of :func:`div`, with the sign of ``x`` (``lax.rem``)."""
    return lax.rem(x, _as_dtype_of(x, d))


def cdiv(x: jax.Array | int, d: jax.Array | int) -> jax.Array | int:
    """``ceil(x / d)`` for ``x >= 0, d > 0`` (``pl.cdiv``); two Python ints give a Python int."""
    if isinstance(x, int) and isinstance(d, int):
        return -(x // -d)
    return div(x + (d - 1), d)
