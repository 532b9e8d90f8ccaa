"""Pallas TPU KDA kernel, run on CPU in the TPU interpreter, against the XLA chunked reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import chunk_kda, chunk_kda_reference
from pallas_kernels.kda.kernel_tpu import TpuKdaTiles, chunk_kda_fwd
from tests.pallas_kernels.kda.conftest import kda_inputs, segments_from_lengths
from tests.tolerances import BF16_FWD_RTOL, F32_RTOL, rel_rmse

B, T, H, K, V = 2, 70, 2, 8, 5  # 3 chunks of 32, the last one partial


def _segments():
    # row 0: documents starting mid-tile, at a tile start, and a 1-token one; row 1: one document
    return jnp.stack([segments_from_lengths((11, 5, 1, 30, 23)), segments_from_lengths((T,))])


def _run_both(args, s0, seg, tiles, dtype=jnp.float32):
    q, k, v, g, beta = args
    cast = lambda x: x.astype(dtype)
    kernel = jax.jit(lambda *a: chunk_kda_fwd(
        *a, scale=K**-0.5, initial_state=s0, segment_ids=seg, interpret=True, tiles=tiles))
    o, s = kernel(cast(q), cast(k), cast(v), g, beta)
    reference = jax.jit(lambda *a: chunk_kda_reference(*a, initial_state=s0, segment_ids=seg))
    o_ref, s_ref = reference(q, k, v, g, beta)
    assert o.dtype == dtype and s.dtype == jnp.float32
    return o.astype(jnp.float32), s, o_ref, s_ref


def test_fp32_matches_reference():
    """4 sub-tiles of 8 per chunk of 32 (the merge takes two squarings), documents, initial state."""
    q, k, v, g, beta, s0 = kda_inputs(0, B, T, H, K, V, dtype=jnp.float32)
    o, s, o_ref, s_ref = _run_both((q, k, v, g, beta), s0, _segments(), TpuKdaTiles(32, 8))
    assert rel_rmse(o, o_ref) <= F32_RTOL
    assert rel_rmse(s, s_ref) <= F32_RTOL


def test_bf16_inputs_match_fp32_reference():
    q, k, v, g, beta, s0 = kda_inputs(1, B, T, H, K, V, dtype=jnp.float32)
    o, s, o_ref, s_ref = _run_both((q, k, v, g, beta), s0, _segments(), TpuKdaTiles(32, 16), jnp.bfloat16)
    assert rel_rmse(o, o_ref) <= BF16_FWD_RTOL
    assert rel_rmse(s, s_ref) <= BF16_FWD_RTOL


def test_default_chunk_unbounded_gate():
    """Chunk 64 (4 sub-tiles); softplus gate decays of e^-30 per token stay exact and finite."""
    q, k, v, _, beta, s0 = kda_inputs(2, 1, 80, 1, 8, 8, dtype=jnp.float32)
    g = -jax.nn.softplus(8.0 * jax.random.normal(jax.random.PRNGKey(3), q.shape))
    assert float(g.min()) < -20.0
    o, s, o_ref, s_ref = _run_both((q, k, v, g, beta), s0, None, TpuKdaTiles())
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(s))
    assert rel_rmse(o, o_ref) <= F32_RTOL
    assert rel_rmse(s, s_ref) <= F32_RTOL


def test_public_op_pallas_interpret_gradients():
    """chunk_kda(implementation='pallas', interpret=True): forward and backward kernels, fp32."""
    q, k, v, g, beta, s0 = kda_inputs(3, 1, 40, 2, 4, 3, dtype=jnp.float32)
    seg = segments_from_lengths((13, 27))[None]
    w_o = jax.random.normal(jax.random.PRNGKey(9), v.shape)

    def loss(impl, *args):
        o, s = chunk_kda(
            *args[:5], initial_state=args[5], segment_ids=seg, output_final_state=True,
            implementation=impl, interpret=impl == "pallas", chunk_size=16,
        )
        return jnp.sum(o * w_o) + jnp.sum(s)

    args = (q, k, v, g, beta, s0)
    grads = jax.jit(jax.grad(lambda *a: loss("pallas", *a), argnums=range(6)))(*args)
    grads_ref = jax.jit(jax.grad(lambda *a: loss("xla", *a), argnums=range(6)))(*args)
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), grads, grads_ref):
        assert rel_rmse(a, b) <= F32_RTOL, name


@pytest.mark.parametrize("device_kind", ["TPU v5p", "TPU v6e"])
def test_lowers_to_mosaic_for_tpu(device_kind):
    """The kernel lowers to a Mosaic custom call for real TPUs (head dims 128, bf16) without a TPU.

    This covers Pallas -> Mosaic lowering only; Mosaic's own layout passes need libtpu.
    """
    b, t, h, d = 1, 128, 2, 128
    qkv = jnp.zeros((b, t, h, d), jnp.bfloat16)
    args = (qkv, qkv, qkv, jnp.zeros((b, t, h, d)), jnp.zeros((b, t, h)))
    fwd = jax.jit(lambda *a: chunk_kda_fwd(
        *a, scale=d**-0.5, initial_state=jnp.zeros((b, h, d, d)), segment_ids=jnp.zeros((b, t), jnp.int32)))
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=1, platform="tpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        lowered = fwd.trace(*args).lower(lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()
