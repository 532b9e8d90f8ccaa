"""Where the PyTorch reference venv and the golden-file cache live (set up by ``make refvenv``).

Runs under both venvs (the JAX one imports it; the reference scripts do not need it).
"""

from __future__ import annotations

import os


def cache_root() -> str:
    """``$K3JAX_CACHE``, else ``~/.cache/k3jax``."""
    return os.environ.get("K3JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "k3jax")


def reference_python() -> str | None:
    """The reference venv's python: ``$K3JAX_REF_PYTHON``, else ``<cache>/refvenv/bin/python``; None if absent."""
    path = os.environ.get("K3JAX_REF_PYTHON") or os.path.join(cache_root(), "refvenv", "bin", "python")
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


def golden_dir(name: str) -> str:
    """Cache folder of one golden reference (checkpoint + outputs)."""
    return os.path.join(cache_root(), "golden", name)
