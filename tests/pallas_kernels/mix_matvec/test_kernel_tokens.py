"""``kernel_gpu_tokens.token_matmul`` (5–64 tokens, tensor cores) against its reference: interpreted on the
CPU, compiled on the GPU at small()'s batch-64 shapes; the inputs it refuses, named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mix_matvec.kernel_gpu_tokens import (TokenTiles, accepts, block_d, block_n, check_inputs,
                                                         token_matmul)
from pallas_kernels.mix_matvec.reference import token_matmul_reference
from tests.pallas_kernels.mix_matvec.test_kernel import ACT, _assert_close


def _inputs(seed, T, D, N, n_w=1, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(T, D)), dtype)
    return x, tuple(jnp.asarray(rng.normal(size=(N, D)) * D ** -0.5, dtype) for _ in range(n_w))


@pytest.mark.parametrize("T,D,N,n_w,out,tiles", [
    (64, 256, 64, 1, None, TokenTiles(block_d=64)),  # every row, four slabs of D, one 64-column program
    (20, 128, 96, 1, jnp.float32, TokenTiles(block_n=16, block_d=32)),  # rows padded to 32, six programs, fp32 out
    (5, 128, 48, 2, None, TokenTiles(block_d=128)),  # the fewest tokens; gate and up with the activation
])
def test_kernel_matches_reference(T, D, N, n_w, out, tiles):
    x, ws = _inputs(T, T, D, N, n_w)
    act = ACT if n_w == 2 else None
    got = token_matmul(x, ws, out_dtype=out, activation=act, tiles=tiles, interpret=True)
    _assert_close(got, token_matmul_reference(x, ws, out, dict(act) if act else None))


def test_block_n_gives_every_sm_a_program():
    """The widest of 64 / 32 / 16 columns that still makes 128 programs, else 16; 0 where none divides."""
    assert block_n(8192) == 64 and block_n(4096) == 32 and block_n(2048) == 16 and block_n(1024) == 16
    assert block_n(48) == 16 and block_n(4232) == 0 and block_n(4256) == 32
    assert block_n(1024, TokenTiles(block_n=32)) == 32
    assert block_d(1024) == 128 and block_d(96) == 32 and block_d(64) == 64 and block_d(72) == 0


def test_bad_inputs_raise():
    x, ws = _inputs(0, 8, 128, 64)
    for args, match in [
        ((x[:4], ws), "4 < T <= 64 tokens"), ((jnp.zeros((65, 128), x.dtype), ws), "4 < T <= 64 tokens"),
        ((x, ws * 2), "with an activation"), ((x, (ws[0][:, :64],)), r"weights\[0\] must be \[N, D=128\]"),
        ((x.astype(jnp.float32), tuple(w.astype(jnp.float32) for w in ws)), "16-bit"),
        ((x, (ws[0][:40],)), "N=40 must be a multiple of 16"),
    ]:
        with pytest.raises(ValueError, match=match):
            check_inputs(*args)  # two weights without an activation: refused too
    with pytest.raises(ValueError, match="D=72 must be a multiple of 16"):
        check_inputs(x[:, :72], tuple(w[:, :72] for w in ws))
    with pytest.raises(ValueError, match="tiles.block_d=24"):
        check_inputs(x, ws, tiles=TokenTiles(block_d=24))
    assert accepts(x, ws) and not accepts(x[:4], ws)


@pytest.mark.gpu
@pytest.mark.parametrize("D,N,n_w", [(1024, 2048, 2), (1024, 512, 1), (512, 1024, 1), (1024, 1024, 1),
                                     (1024, 4256, 1)])
def test_compiled_kernel_matches_reference(D, N, n_w):
    """small()'s batch-64 projections: the shared experts' gate and up, the latent down_proj and up_proj,
    KDA's o_proj, KDA's packed inputs (4232 rows padded to 4256, 133 programs)."""
    x, ws = _inputs(N, 64, D, N, n_w)
    act = ACT if n_w == 2 else None
    got = jax.jit(lambda x, ws: token_matmul(x, ws, activation=act))(x, ws)
    _assert_close(got, token_matmul_reference(x, ws, None, dict(act) if act else None))
