"""The GPU decode kernel (``kernel_gpu_decode``) against the defining recurrence, interpreted on CPU and
compiled on the GPU; the dispatch of ``recurrent_kda_step`` and its errors."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.kda import naive_recurrent_kda, recurrent_kda_step
from pallas_kernels.kda.kernel_gpu_decode import recurrent_step_pallas
from pallas_kernels.target import compile_for
from tests.pallas_kernels.kda.conftest import kda_inputs
from tests.tolerances import BF16_FWD_RTOL, F32_RTOL, rel_rmse


def _inputs(seed, B, T, H, K, V, dtype):
    q, k, v, g, beta, s0 = kda_inputs(seed, B, T, H, K, V, dtype=dtype)
    return q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32), s0.astype(jnp.float32)


def _check(B, T, H, K, V, dtype, interpret, seed=0):
    q, k, v, g, beta, s0 = _inputs(seed, B, T, H, K, V, dtype)
    wide = lambda x: x.astype(jnp.float32)
    o_ref, s_ref = jax.jit(lambda *a: naive_recurrent_kda(*map(wide, a), initial_state=s0))(q, k, v, g, beta)
    o, s = recurrent_step_pallas(q, k, v, g, beta, s0, scale=K ** -0.5, interpret=interpret)
    assert o.shape == v.shape and o.dtype == v.dtype and s.shape == s0.shape and s.dtype == jnp.float32
    assert rel_rmse(s, s_ref) <= F32_RTOL
    assert rel_rmse(o, o_ref) <= (F32_RTOL if dtype == jnp.float32 else BF16_FWD_RTOL)


@pytest.mark.parametrize("B,T,H,K,V,dtype", [
    (2, 1, 3, 16, 16, jnp.float32),   # one decode token, one V block
    (1, 3, 2, 32, 64, jnp.float32),   # three tokens (padded to four), two V blocks
    (2, 4, 2, 16, 32, jnp.bfloat16),  # bf16 q, k, v as the layer passes them
])
def test_interpreted_kernel_matches_recurrence(B, T, H, K, V, dtype):
    _check(B, T, H, K, V, dtype, interpret=True)


def test_steps_through_the_op_equal_one_recurrence():
    """Several calls of ``recurrent_kda_step(implementation="pallas")`` carry the state as one
    recurrence over all tokens does."""
    q, k, v, g, beta, s0 = _inputs(3, 2, 7, 2, 16, 32, jnp.float32)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=s0)
    outs, state, start = [], s0, 0
    for n in (1, 2, 1, 3):
        sl = slice(start, start + n)
        o, state = recurrent_kda_step(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], state,
                                      implementation="pallas", interpret=True)
        outs.append(o)
        start += n
    assert rel_rmse(jnp.concatenate(outs, axis=1), o_ref) <= F32_RTOL
    assert rel_rmse(state, s_ref) <= F32_RTOL


@pytest.mark.unchecked
def test_dispatch_errors():
    q, k, v, g, beta, s0 = _inputs(0, 1, 1, 1, 16, 16, jnp.float32)
    with pytest.raises(ValueError, match="implementation must be"):
        recurrent_kda_step(q, k, v, g, beta, s0, implementation="triton")
    with compile_for("cpu"), pytest.raises(ValueError, match="needs a CUDA GPU"):
        recurrent_kda_step(q, k, v, g, beta, s0, implementation="pallas")
    with pytest.raises(ValueError, match="power-of-two head widths >= 16, got K=12"):
        recurrent_kda_step(q[..., :12], k[..., :12], v, g[..., :12], beta, s0[:, :, :12],
                           implementation="pallas", interpret=True)


def test_default_off_gpu_is_the_recurrence():
    """On a CPU target ``implementation=None`` runs the XLA recurrence (bit-for-bit)."""
    q, k, v, g, beta, s0 = _inputs(1, 1, 2, 2, 16, 16, jnp.float32)
    with compile_for("cpu"):
        o, s = recurrent_kda_step(q, k, v, g, beta, s0)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=s0)
    assert (o == o_ref).all() and (s == s_ref).all()


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H,K,V", [(64, 1, 8, 128, 128), (1, 1, 96, 128, 128), (4, 5, 8, 128, 128)])
def test_compiled_kernel_matches_recurrence(B, T, H, K, V):
    _check(B, T, H, K, V, jnp.bfloat16, interpret=False)
