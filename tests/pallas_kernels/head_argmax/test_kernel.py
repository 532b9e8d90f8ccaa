"""``kernel_gpu.greedy_head`` (greedy decoding's head without its logits) against its reference: interpreted
on the CPU (rows padded, several programs, ties to the lowest id across and within blocks), compiled on the
GPU at small()'s head; the inputs it refuses, named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.head_argmax.kernel_gpu import (DEFAULT, HeadTiles, accepts, check_inputs, default_tiles,
                                                 greedy_head, pays)
from pallas_kernels.head_argmax.reference import block_partials, combine_partials, greedy_tokens, logits


def _inputs(seed, T, D, V, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(T, D)), dtype),
            jnp.asarray(rng.normal(size=(D, V)) * D ** -0.5, dtype))


def _assert_best(got, x, w, rtol=1e-5):
    """Each row's token holds the row's largest logit, up to float32 summation order (a near-tie may go
    either way; on random weights there is almost never one)."""
    z = np.asarray(logits(x, w))
    picked = z[np.arange(z.shape[0]), np.asarray(got)]
    np.testing.assert_allclose(picked, z.max(axis=1), rtol=rtol, atol=rtol)


@pytest.mark.parametrize("T,D,V,tiles", [
    (3, 64, 256, HeadTiles(block_v=64, block_d=32)),  # rows padded to 16, four programs, two steps of D
    (64, 128, 512, HeadTiles(block_v=128, block_d=64, num_stages=2)),  # every row of a tile
    (1, 32, 64, HeadTiles(block_v=16, block_d=16)),  # batch 1: one row, the narrowest blocks
])
def test_kernel_matches_reference(T, D, V, tiles):
    x, w = _inputs(T, T, D, V)
    got = greedy_head(x, w, tiles=tiles, interpret=True)
    assert got.dtype == jnp.int32 and got.shape == (T,)
    np.testing.assert_array_equal(got, greedy_tokens(x, w))
    np.testing.assert_array_equal(combine_partials(*block_partials(x, w, tiles.block_v)), greedy_tokens(x, w))


def test_ties_go_to_the_lowest_id():
    """Equal logits within a block and across blocks: the lowest id wins, as ``jnp.argmax``."""
    D, V = 16, 64
    x = jnp.ones((2, D), jnp.bfloat16)
    w = np.zeros((D, V), np.float32)
    w[:, [5, 9, 40]] = 1.0  # row 0 ties 5 and 9 in block 0 and 40 in block 2
    w = jnp.asarray(w, jnp.bfloat16)
    x = x.at[1].set(-1.0)  # row 1: every logit but 5, 9, 40 (0) is the max -> id 0
    got = greedy_head(x, w, tiles=HeadTiles(block_v=16, block_d=16), interpret=True)
    np.testing.assert_array_equal(got, [5, 0])
    np.testing.assert_array_equal(got, greedy_tokens(x, w))


def test_bad_inputs_raise():
    x, w = _inputs(0, 4, 64, 256)
    for args, match in [
        ((x[0], w), r"1 <= T <= 64 rows"), ((jnp.zeros((65, 64), x.dtype), w), r"1 <= T <= 64 rows"),
        ((x, w[:32]), r"w must be \[D=64, V\]"),
        ((x.astype(jnp.float32), w.astype(jnp.float32)), "16-bit"), ((x, w.astype(jnp.float16)), "16-bit"),
        ((x, w[:, :200]), r"V=200 must be a multiple of tiles.block_v=16"),
    ]:
        with pytest.raises(ValueError, match=match):
            check_inputs(*args)
    with pytest.raises(ValueError, match="D=64 must be a multiple of tiles.block_d=48"):
        check_inputs(x, w, HeadTiles(block_v=256, block_d=48))
    assert accepts(x, w) and not accepts(x, w[:, :200])


def test_default_tiles_divide_the_vocabulary():
    """512 columns a program where they divide V (small() and K3: 163840), else the widest power of two that does."""
    assert [default_tiles(V).block_v for V in (163840, 256, 32000, 48)] == [512, 256, 256, 16]
    assert default_tiles(163840) == DEFAULT and default_tiles(256).block_d == DEFAULT.block_d


def test_pays_from_24_rows():
    """Where the kernel beats XLA's head and argmax on an H100 (RESULTS.md stops 68-69): 24 to 64 rows."""
    assert [pays(r) for r in (1, 16, 23, 24, 64, 65)] == [False, False, False, True, True, False]


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5, 64])
def test_compiled_kernel_at_small_head(T):
    """small()'s head (1024 × 163840): the compiled kernel picks each row's largest logit."""
    x, w = _inputs(T, T, 1024, 163840)
    got = jax.block_until_ready(greedy_head(x, w))
    _assert_best(got, x, w)
    assert np.mean(np.asarray(got) == np.asarray(greedy_tokens(x, w))) >= 0.95
