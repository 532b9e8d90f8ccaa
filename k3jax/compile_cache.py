"""JAX's persistent compilation cache for the command-line entry points.

A ``small()`` train step takes minutes to compile on a GPU; with the cache on, the second run of
the same program on the same machine loads the executable instead. ``K3JAX_COMPILE_CACHE`` names
the folder (default ``~/.cache/k3jax/jax_cache``); an empty value turns the cache off.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "K3JAX_COMPILE_CACHE"


def default_path() -> str | None:
    """The folder from ``K3JAX_COMPILE_CACHE``, else ``~/.cache/k3jax/jax_cache``; None when set empty."""
    value = os.environ.get(ENV)
    if value is None:
        return str(Path.home() / ".cache" / "k3jax" / "jax_cache")
    return value or None


def enable_compilation_cache(path: str | None = None, min_compile_seconds: float = 1.0) -> str | None:
    """Cache executables that took at least ``min_compile_seconds`` to compile under ``path``.

    ``path=None`` uses :func:`default_path`. Returns the folder in use, or None when turned off.
    Call before the first compilation.
    """
    import jax

    path = default_path() if path is None else path
    if not path:
        return None
    if min_compile_seconds < 0:
        raise ValueError(f"min_compile_seconds must be >= 0, got {min_compile_seconds}")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
