"""The context-parallel KDA state pass (``sharding.cp._local_and_transition``) on one device.

``o_local, N`` must be the chunked KDA from a zero state, ``M`` the transition
``pallas_kernels.kda.kda_transition`` and ``o_local + R·S`` the KDA entered from any state ``S``.
"""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.kda import chunk_kda, chunk_kda_state, kda_transition
from sharding.cp import _local_and_transition
from tests.tolerances import BF16_FWD_RTOL, F32_RTOL, rel_rmse

B, T, H, C = 2, 32, 2, 8


def _inputs(K, V, dtype=jnp.float32, chunk=C, length=T):
    ks = jax.random.split(jax.random.PRNGKey(3), 6)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q, k = (unit(jax.random.normal(kk, (B, length, H, K))).astype(dtype) for kk in ks[:2])
    v = jax.random.normal(ks[2], (B, length, H, V)).astype(dtype)
    g = -0.5 * jax.nn.sigmoid(jax.random.normal(ks[3], (B, length, H, K)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, length, H)))
    t = jnp.arange(length)
    seg = jnp.stack([(t >= length // 2 + 3).astype(jnp.int32), jnp.zeros(length, jnp.int32)])  # row 0: 2 docs
    S = jax.random.normal(ks[5], (B, H, K, V))
    return (q, k, v, g, beta), seg, S


def _check(K, V, implementation, dtype=jnp.float32, chunk=C, length=T):
    (q, k, v, g, beta), seg, S = _inputs(K, V, dtype, chunk, length)
    kw = dict(scale=K**-0.5, chunk_size=chunk, implementation=implementation, gpu_prep_backward="xla")
    o_local, N, R, M = jax.jit(lambda *a: _local_and_transition(*a, seg, **kw))(q, k, v, g, beta)
    f32 = lambda x: x.astype(jnp.float32)
    ref = dict(scale=K**-0.5, segment_ids=seg, chunk_size=chunk, implementation="xla")
    o_ref, _ = chunk_kda(*map(f32, (q, k, v)), g, beta, **ref)
    o_from_S, _ = chunk_kda(*map(f32, (q, k, v)), g, beta, initial_state=S, **ref)
    N_ref = chunk_kda_state(f32(k), f32(v), g, beta, segment_ids=seg, chunk_size=chunk)
    M_ref = kda_transition(f32(k), g, beta, seg, chunk_size=chunk)
    entered = f32(o_local) + jnp.einsum("BTHK,BHKV->BTHV", f32(R), S, precision="highest")
    return {"o": rel_rmse(o_local, o_ref), "N": rel_rmse(N, N_ref), "M": rel_rmse(M, M_ref),
            "entered": rel_rmse(entered, o_from_S)}


@pytest.mark.parametrize("K,V", [(8, 8), (8, 16)], ids=["stacked", "two_calls"])
def test_state_pass_is_exact(K, V):
    with jax.default_matmul_precision("highest"):
        errs = _check(K, V, "xla")
    assert max(errs.values()) <= F32_RTOL, errs


def test_document_start_in_shard_zeroes_transition():
    (q, k, v, g, beta), seg, _ = _inputs(8, 8)
    kw = dict(scale=8**-0.5, chunk_size=C, implementation="xla", gpu_prep_backward="xla")
    _, _, R, M = _local_and_transition(q, k, v, g, beta, seg, **kw)
    assert float(jnp.abs(M[0]).max()) == 0.0  # row 0 starts a document mid-span
    assert float(jnp.abs(M[1]).max()) > 0.0
    assert float(jnp.abs(R[0, T // 2 + 3:]).max()) == 0.0  # the entering state no longer reaches them


@pytest.mark.gpu
def test_state_pass_on_the_gpu_kernel():
    """K = V = 128 and chunk 64 in bf16: the Pallas path, against the fp32 XLA reference."""
    errs = _check(128, 128, None, jnp.bfloat16, chunk=64, length=256)
    assert max(errs.values()) <= BF16_FWD_RTOL, errs
