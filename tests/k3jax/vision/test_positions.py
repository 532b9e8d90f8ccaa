"""Position grid resampling against PyTorch's F.interpolate, 2-D RoPE and the time embedding."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.vision.positions import grid_taps, rope_2d, time_sincos
from tests.tolerances import F64_RTOL

# Written by torch 2.13 (F.interpolate(grid.permute(2,0,1)[None], size=(h, w), mode=mode), align_corners
# left at its default False) from a random [7, 9, 5] grid; stored because torch is not a test dependency.
GOLDEN = os.path.join(os.path.dirname(__file__), "interp_torch.npz")


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("h,w", [(4, 6), (7, 9), (12, 20), (3, 2), (16, 10)])
def test_grid_resampling_matches_torch(mode, h, w):
    ref = np.load(GOLDEN)
    grid = ref["grid"]
    rows, cols = (a.ravel() for a in np.meshgrid(np.arange(h), np.arange(w), indexing="ij"))
    index, weight = grid_taps(rows, cols, h, w, grid.shape[:2], mode)
    got = np.einsum("nk,nkd->nd", weight, grid.reshape(-1, grid.shape[-1])[index]).reshape(h, w, -1)
    np.testing.assert_allclose(got, ref[f"{mode}_{h}_{w}"], rtol=0, atol=1e-12)


def test_rope_2d_depends_only_on_offsets():
    """q·k after 2-D RoPE is a function of (Δrow, Δcol): shifting both patches leaves it unchanged."""
    rng = np.random.default_rng(0)
    q_np, k_np = rng.standard_normal((2, 1, 2, 3, 16))

    def dot(rows, cols):
        r, c = jnp.asarray([rows]), jnp.asarray([cols])
        q, k = jnp.asarray(q_np), jnp.asarray(k_np)
        qr, kr = rope_2d(q, r, c, 1e4, jnp.float64), rope_2d(k, r, c, 1e4, jnp.float64)
        return jnp.einsum("bhk,bhk->h", qr[:, 0], kr[:, 1])
    with jax.enable_x64(True):
        q = jnp.asarray(q_np)
        base = dot([2, 5], [7, 1])
        np.testing.assert_allclose(dot([12, 15], [3, -3]), base, rtol=F64_RTOL)
        assert not np.allclose(dot([2, 6], [7, 1]), base)  # a row offset matters
        assert not np.allclose(dot([2, 5], [7, 2]), base)  # so does a column offset
        # Rotations keep the norm; the origin is the identity.
        r = rope_2d(q, jnp.asarray([[3, 4]]), jnp.asarray([[1, 9]]), 1e4, jnp.float64)
        np.testing.assert_allclose(jnp.linalg.norm(r, axis=-1), jnp.linalg.norm(q, axis=-1), rtol=F64_RTOL)
        z = jnp.zeros((1, 2), jnp.int32)
        np.testing.assert_allclose(rope_2d(q, z, z, 1e4, jnp.float64), q, rtol=F64_RTOL)


def test_time_sincos():
    t = time_sincos(4, 8)
    np.testing.assert_allclose(t[0], [0, 0, 0, 0, 1, 1, 1, 1])
    np.testing.assert_allclose(t[2, [0, 4]], [np.sin(2.0), np.cos(2.0)])
    np.testing.assert_allclose(t[3, [1, 5]], [np.sin(0.3), np.cos(0.3)])  # ω_1 = 10⁴^(-1/4) = 0.1
