"""``kernel_gpu_tokens.token_matmul`` (5–64 tokens, tensor cores) against its reference, with and without the
input norm it may apply: interpreted on the CPU, compiled on the GPU at small()'s batch-64 shapes; the inputs it
refuses, named."""

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


@pytest.mark.parametrize("T,D,N,G,gated,n_w", [
    (64, 256, 64, 256, False, 1),  # one norm over the row (the MoE's latent norm before up_proj): a pass first
    (20, 256, 32, 64, True, 1),  # per group of 64 columns with the output gate (KDA's before o_proj)
    (8, 128, 32, 128, False, 2),  # normed input into a gate and up
])
def test_normed_input_matches_reference(T, D, N, G, gated, n_w):
    """With ``scale`` the kernel norms (and gates) x itself, as ``mixed_norm`` norms a lone source."""
    x, ws = _inputs(G, T, D, N, n_w)
    rng = np.random.default_rng(D)
    x = x * 3  # rms far from 1, so a missing norm shows
    scale = jnp.asarray(rng.normal(size=(G,)), jnp.float32)
    gate = jnp.asarray(rng.normal(size=(T, D)), x.dtype) if gated else None
    act = ACT if n_w == 2 else None
    got = token_matmul(x, ws, activation=act, scale=scale, gate=gate, norm_eps=1e-5, tiles=TokenTiles(block_d=64),
                       interpret=True)
    want = token_matmul_reference(x, ws, None, dict(act) if act else None, scale=scale, gate=gate, norm_eps=1e-5)
    _assert_close(got, want)
    assert not np.allclose(np.asarray(got, np.float32), np.asarray(token_matmul_reference(x, ws, None, dict(act) if act
                                                                                           else None), np.float32))


def test_block_n_gives_every_sm_a_program():
    """The widest of 64 / 32 / 16 columns that still makes 128 programs, else 16; 0 where none divides."""
    assert block_n(8192) == 64 and block_n(4096) == 32 and block_n(2048) == 16 and block_n(1024) == 16
    assert block_n(48) == 16 and block_n(4232) == 0 and block_n(1024, TokenTiles(block_n=32)) == 32
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
    for kw, match in [(dict(scale=jnp.ones((48,))), r"scale must be \[D\]=\[128\]"),
                      (dict(scale=jnp.ones((8,))), "a power of two >= 16"),
                      (dict(scale=jnp.ones((128,)), gate=x[:, :64]), r"gate must be \[T, D\]"),
                      (dict(gate=x), "needs the norm's scale")]:
        with pytest.raises(ValueError, match=match):
            check_inputs(x, ws, **kw)
    with pytest.raises(ValueError, match="norm_eps .* goes with scale"):
        token_matmul(x, ws, scale=jnp.ones((128,)), interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("D,N,G,gated", [(512, 1024, 512, False), (1024, 1024, 128, True), (1024, 4256, 1024, False)])
def test_compiled_normed_input_matches_reference(D, N, G, gated):
    """small()'s batch-64 products of a lone normed source: up_proj after the latent norm, KDA's o_proj after
    its per-head norm and gate, layer 0's packed KDA inputs (padded to 4256 rows) on the normed embedding."""
    x, ws = _inputs(N, 64, D, N)
    rng = np.random.default_rng(G)
    scale = jnp.asarray(rng.normal(size=(G,)), jnp.float32)
    gate = jnp.asarray(rng.normal(size=(64, D)), x.dtype) if gated else None
    got = jax.jit(lambda x, ws, s, g: token_matmul(x, ws, scale=s, gate=g, norm_eps=1e-5))(x * 3, ws, scale, gate)
    _assert_close(got, token_matmul_reference(x * 3, ws, scale=scale, gate=gate, norm_eps=1e-5))


@pytest.mark.gpu
@pytest.mark.parametrize("D,N,n_w", [(1024, 2048, 2), (1024, 512, 1), (512, 1024, 1), (1024, 1024, 1)])
def test_compiled_kernel_matches_reference(D, N, n_w):
    """small()'s batch-64 projections: the shared experts' gate and up, the latent down_proj and up_proj,
    KDA's o_proj."""
    x, ws = _inputs(N, 64, D, N, n_w)
    act = ACT if n_w == 2 else None
    got = jax.jit(lambda x, ws: token_matmul(x, ws, activation=act))(x, ws)
    _assert_close(got, token_matmul_reference(x, ws, None, dict(act) if act else None))
