"""``kernel_gpu_tma.greedy_head`` (greedy decoding's head on TMA and ``wgmma``) against its reference: interpreted
on the CPU (rows padded, several tiles a CTA, ties to the lowest id within and across tiles), compiled on the
GPU at small()'s head; the inputs it refuses, named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.head_argmax.kernel_gpu_tma import TmaHeadTiles, accepts, check_inputs, greedy_head
from pallas_kernels.head_argmax.reference import greedy_tokens
from tests.pallas_kernels.head_argmax.test_kernel import _assert_best, _inputs


@pytest.mark.parametrize("T,D,V,tiles", [
    (5, 128, 1024, TmaHeadTiles()),           # 8 CTA tiles over 2 interpreted SMs, 2 K steps, 8 slots
    (64, 256, 2048, TmaHeadTiles(128, 64, 3)),  # every row; the ring's 3 slots across tiles of 4 K steps
    (1, 64, 256, TmaHeadTiles(64, 64, 2)),    # batch 1, one K step a tile
])
def test_kernel_matches_reference(T, D, V, tiles):
    x, w = _inputs(T, T, D, V)
    got = greedy_head(x, w, tiles=tiles, interpret=True)
    assert got.dtype == jnp.int32 and got.shape == (T,)
    np.testing.assert_array_equal(got, greedy_tokens(x, w))


def test_ties_go_to_the_lowest_id():
    """Equal logits within a warpgroup's tile and across tiles: the lowest id wins, as ``jnp.argmax``."""
    D, V = 64, 512
    w = np.zeros((D, V), np.float32)
    w[:, [70, 100, 300]] = 1.0  # row 0 ties 70 and 100 in tile 1 and 300 in tile 4
    w = jnp.asarray(w, jnp.bfloat16)
    x = jnp.ones((2, D), jnp.bfloat16).at[1].set(-1.0)  # row 1: every other logit (0) is the max -> id 0
    got = greedy_head(x, w, tiles=TmaHeadTiles(64, 64, 2), interpret=True)
    np.testing.assert_array_equal(got, [70, 0])
    np.testing.assert_array_equal(got, greedy_tokens(x, w))


def test_bad_inputs_raise():
    x, w = _inputs(0, 4, 128, 256)
    for args, match in [
        ((x[0], w), r"1 <= T <= 64 rows"), ((jnp.zeros((65, 128), x.dtype), w), r"1 <= T <= 64 rows"),
        ((x, w[:64]), r"w must be \[D=128, V\]"),
        ((x.astype(jnp.float32), w.astype(jnp.float32)), "16-bit"), ((x, w.astype(jnp.float16)), "16-bit"),
        ((x, w[:, :192]), r"V=192 must be a multiple of 2·tiles.tile_n=128"),
        ((x[:, :96], w[:96]), r"D=96 must be a multiple of tiles.tile_k=64"),
    ]:
        with pytest.raises(ValueError, match=match):
            check_inputs(*args)
    assert accepts(x, w) and not accepts(x, w[:, :192])


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5, 64])
def test_compiled_kernel_at_small_head(T):
    """small()'s head (1024 × 163840): the compiled kernel picks each row's largest logit."""
    x, w = _inputs(T, T, 1024, 163840)
    got = jax.block_until_ready(greedy_head(x, w))
    _assert_best(got, x, w)
    assert np.mean(np.asarray(got) == np.asarray(greedy_tokens(x, w))) >= 0.95
