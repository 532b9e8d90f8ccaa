"""The jaxtyping annotations are checked at run time under pytest (``tests/conftest.py`` installs the
import hook with beartype unless ``K3JAX_TYPECHECK=0``), and only there."""

import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import jaxtyping
import pytest

from pallas_kernels.moe import grouped_matmul
from pallas_kernels.kda import chunk_kda

ROOT = Path(__file__).resolve().parents[1]
CHECKED = os.environ.get("K3JAX_TYPECHECK", "1") != "0"
hooked = pytest.mark.skipif(not CHECKED, reason="runs in the checked process of test_checked_process")


@pytest.mark.skipif(CHECKED, reason="this process is the checked one")
def test_checked_process():
    """The hooked tests below, in a process with the annotation checks on (this one has them off)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "wrong"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", K3JAX_TYPECHECK="1"))
    assert out.returncode == 0 and "2 passed" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]


@hooked
def test_wrong_shape_fails_naming_the_argument():
    lhs, rhs = jnp.zeros((8, 4)), jnp.zeros((2, 5, 3))  # K = 4 against K = 5
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'rhs'"):
        grouped_matmul(lhs, rhs, jnp.asarray([4, 4]))


@hooked
def test_wrong_rank_and_dtype_fail_naming_the_argument():
    q = jnp.zeros((1, 8, 2, 4))
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'beta'"):
        chunk_kda(q, q, q, q, jnp.zeros((1, 8)))  # beta without its head axis
    with pytest.raises(jaxtyping.TypeCheckError, match="parameter 'segment_ids'"):
        chunk_kda(q, q, q, q, jnp.zeros((1, 8, 2)), segment_ids=jnp.zeros((1, 8)))  # float ids


def test_no_checks_outside_pytest():
    code = "import pallas_kernels.moe.ops as m; print(hasattr(m.grouped_matmul, '__wrapped__'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu"))
    assert out.stdout.strip() == "False", out.stderr[-2000:]
