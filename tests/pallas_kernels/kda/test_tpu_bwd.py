"""Pallas TPU KDA backward kernel, run on CPU in the TPU interpreter, against the XLA reference's VJP."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import chunk_kda, chunk_kda_reference
from pallas_kernels.kda.kernel_tpu import TpuKdaTiles, chunk_kda_fwd
from pallas_kernels.kda.kernel_tpu_bwd import chunk_kda_bwd
from pallas_kernels.kda.ops import _tpu_chunk_kda
from tests.pallas_kernels.kda.conftest import kda_inputs, segments_from_lengths
from tests.tolerances import BF16_GRAD_RTOL, F32_RTOL, rel_rmse

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _cotangents(seed, v, s0):
    k_o, k_s = jax.random.split(jax.random.PRNGKey(seed))
    return jax.random.normal(k_o, v.shape, jnp.float32), jax.random.normal(k_s, s0.shape, jnp.float32)


def _reference_grads(args, seg, chunk, do, d_final):
    ref = lambda *a: chunk_kda_reference(*a[:5], initial_state=a[5], segment_ids=seg, chunk_size=chunk)
    _, vjp = jax.vjp(ref, *args)
    return jax.jit(vjp)((do, d_final))


def test_kernel_fp32_gradients_match_reference():
    """Sub-tiles of 8 in chunks of 32, T = 70 (last chunk partial), documents starting mid-tile,
    at a tile start and a 1-token one, an initial state: every gradient at fp32 rounding."""
    B, T, H, K, V = 2, 70, 1, 8, 5
    args = kda_inputs(0, B, T, H, K, V, dtype=jnp.float32)
    seg = jnp.stack([segments_from_lengths((11, 5, 1, 30, 23)), segments_from_lengths((T,))])
    do, d_final = _cotangents(1, args[2], args[5])
    tiles = TpuKdaTiles(32, 8)

    @jax.jit
    def kernel_grads(q, k, v, g, beta, s0):
        kw = dict(scale=K**-0.5, segment_ids=seg, interpret=True, tiles=tiles)
        _, _, states = chunk_kda_fwd(q, k, v, g, beta, initial_state=s0, return_states=True, **kw)
        return chunk_kda_bwd(q, k, v, g, beta, states, do, d_final, **kw)

    grads = kernel_grads(*args)
    for name, a, b, x in zip(NAMES, grads, _reference_grads(args, seg, 32, do, d_final), args):
        assert a.shape == x.shape and a.dtype == x.dtype, name
        assert rel_rmse(a, b) <= F32_RTOL, name


def _op_loss(implementation, seg, chunk, w_o, w_s, *args):
    o, s = chunk_kda(
        *args[:5], initial_state=args[5], segment_ids=seg, output_final_state=True,
        implementation=implementation, interpret=implementation == "pallas", chunk_size=chunk,
    )
    return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(s * w_s)


@pytest.mark.parametrize(
    "K,V,T,chunk,lengths",
    [
        (64, 128, 45, 32, (20, 25)),  # odd T: a full and a partial chunk, a document start mid-chunk
        (128, 64, 21, 32, (9, 12)),  # T < chunk: one padded chunk
    ],
)
def test_public_op_bf16_gradients_match_fp32_reference(K, V, T, chunk, lengths):
    """bf16 q, k, v through ``chunk_kda(implementation='pallas', interpret=True)`` against the fp32
    XLA reference: all six gradients within the bf16 gradient tolerance."""
    args = kda_inputs(2, 1, T, 1, K, V, dtype=jnp.float32)
    seg = segments_from_lengths(lengths)[None]
    w_o, w_s = _cotangents(3, args[2], args[5])
    argnums = tuple(range(6))
    bf16_args = tuple(x.astype(jnp.bfloat16) for x in args[:3]) + args[3:]
    grads = jax.jit(jax.grad(lambda *a: _op_loss("pallas", seg, chunk, w_o, w_s, *a), argnums))(*bf16_args)
    grads_ref = jax.jit(jax.grad(lambda *a: _op_loss("xla", seg, chunk, w_o, w_s, *a), argnums))(*args)
    for name, a, b, x in zip(NAMES, grads, grads_ref, bf16_args):
        assert a.dtype == x.dtype, name
        assert rel_rmse(a.astype(jnp.float32), b) <= BF16_GRAD_RTOL, name


def test_no_gradient_crosses_a_document_start():
    """A loss on the second document's outputs and the final state: every gradient of the first
    document's tokens and of the initial state is exactly 0 (the start falls mid-chunk, mid-tile)."""
    T, cut, K, V = 40, 21, 8, 4
    args = kda_inputs(4, 1, T, 1, K, V, dtype=jnp.float32)
    seg = segments_from_lengths((cut, T - cut))[None]
    w_o, w_s = _cotangents(5, args[2], args[5])
    w_o = w_o.at[:, :cut].set(0.0)
    grads = jax.jit(jax.grad(lambda *a: _op_loss("pallas", seg, 16, w_o, w_s, *a), tuple(range(6))))(*args)
    for name, grad in zip(NAMES[:5], grads[:5]):
        assert np.all(np.asarray(grad[:, :cut]) == 0.0), name
        assert np.any(np.asarray(grad[:, cut:]) != 0.0), name
    assert np.all(np.asarray(grads[5]) == 0.0)


def test_unbounded_gate_gradients_finite_and_exact():
    """Chunk 64 (4 sub-tiles of 16) with softplus gate decays down to e^-30 per token."""
    args = list(kda_inputs(6, 1, 80, 1, 8, 8, dtype=jnp.float32))
    args[3] = -jax.nn.softplus(8.0 * jax.random.normal(jax.random.PRNGKey(7), args[0].shape))
    assert float(args[3].min()) < -20.0
    w_o, w_s = _cotangents(8, args[2], args[5])
    argnums = tuple(range(6))
    grads = jax.jit(jax.grad(lambda *a: _op_loss("pallas", None, 64, w_o, w_s, *a), argnums))(*args)
    grads_ref = jax.jit(jax.grad(lambda *a: _op_loss("xla", None, 64, w_o, w_s, *a), argnums))(*args)
    for name, a, b in zip(NAMES, grads, grads_ref):
        assert np.all(np.isfinite(a)), name
        assert rel_rmse(a, b) <= F32_RTOL, name


@pytest.mark.parametrize("device_kind", ["TPU v5p", "TPU v6e"])
def test_backward_lowers_to_mosaic_for_tpu(device_kind):
    """The gradient's kernels lower to Mosaic custom calls for real TPUs (head dims 128, bf16).

    This covers Pallas -> Mosaic lowering only; Mosaic's own layout passes need libtpu.
    """
    b, t, h, d = 1, 128, 2, 128
    qkv = jnp.zeros((b, t, h, d), jnp.bfloat16)
    args = (qkv, qkv, qkv, jnp.zeros((b, t, h, d)), jnp.zeros((b, t, h)), jnp.zeros((b, h, d, d)))

    def loss(*a):  # the TPU backend of chunk_kda, which on this CPU host would pick XLA
        o, s = _tpu_chunk_kda(
            *a[:5], scale=d**-0.5, initial_state=a[5], segment_ids=None, chunk_size=64, interpret=False
        )
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=1, platform="tpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        lowered = jax.jit(jax.grad(loss, tuple(range(6)))).trace(*args).lower(lowering_platforms=("tpu",))
    text = lowered.as_text()
    assert "kda_chunk_bwd_tpu" in text and "kda_chunk_fwd_tpu" in text
