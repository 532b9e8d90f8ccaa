"""Public KDA ops: argument checks, dispatch, dtypes, decode steps, random shapes (XLA path)."""

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.kda import chunk_kda, naive_recurrent_kda, recurrent_kda_step
from tests.pallas_kernels.kda.conftest import kda_inputs
from tests.tolerances import F64_RTOL, rel_rmse

B, T, H, K, V = 2, 9, 3, 4, 5


def _args(**overrides):
    qk = jnp.full((B, T, H, K), K**-0.5)
    args = dict(q=qk, k=qk, v=jnp.ones((B, T, H, V)), g=jnp.full((B, T, H, K), -0.1), beta=jnp.full((B, T, H), 0.5))
    args.update(overrides)
    return args


@pytest.mark.unchecked
@pytest.mark.parametrize(
    "overrides,needle",
    [
        (dict(q=jnp.ones((B, T, H))), "q must have shape"),
        (dict(k=jnp.ones((B, T, H, K + 1))), "k must have shape"),
        (dict(v=jnp.ones((B, T, H + 1, V))), "v must have shape"),
        (dict(g=jnp.ones((B, T, H, K + 1))), "g must have shape"),
        (dict(g=jnp.ones((B, T, H, K), jnp.int32)), "g must have a floating dtype"),
        (dict(beta=jnp.ones((B, T, H, 1))), "beta must have shape"),
        (dict(initial_state=jnp.ones((B, H, V, K))), "initial_state must have shape"),
        (dict(segment_ids=jnp.ones((B, T + 1), jnp.int32)), "segment_ids must have shape"),
        (dict(segment_ids=jnp.ones((B, T))), "segment_ids must have an integer dtype"),
        (dict(implementation="triton"), "implementation must be"),
        (dict(chunk_size=0), "chunk_size must be"),
    ],
)
def test_bad_arguments_raise(overrides, needle):
    with pytest.raises(ValueError, match=needle):
        chunk_kda(**_args(**overrides))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU has no Pallas KDA kernel")
def test_pallas_without_interpret_raises_on_cpu():
    with pytest.raises(ValueError, match="implementation='pallas' needs a GPU or TPU kernel"):
        chunk_kda(**_args(implementation="pallas"))


def test_dtypes_and_optional_state():
    args = _args()
    for name in ("q", "k", "v"):
        args[name] = args[name].astype(jnp.bfloat16)
    o, state = jax.jit(lambda a: chunk_kda(**a))(args)
    assert o.dtype == jnp.bfloat16 and state is None
    o, state = jax.jit(lambda a: chunk_kda(**a, output_final_state=True, implementation="xla"))(args)
    assert state.dtype == jnp.float32 and state.shape == (B, H, K, V)


def test_decode_steps_equal_recurrence(x64):
    q, k, v, g, beta, s0 = kda_inputs(1, B, 12, H, K, V)
    o_ref, s_ref = jax.jit(lambda *a: naive_recurrent_kda(*a, initial_state=s0))(q, k, v, g, beta)
    step = jax.jit(recurrent_kda_step)
    outs, state, start = [], s0, 0
    for n in (1, 1, 3, 3, 1, 3):
        sl = slice(start, start + n)
        o, state = step(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], state)
        outs.append(o)
        start += n
    assert state.dtype == jnp.float64
    assert rel_rmse(jnp.concatenate(outs, axis=1), o_ref) <= F64_RTOL
    assert rel_rmse(state, s_ref) <= F64_RTOL


@settings(max_examples=4, deadline=None)
@given(
    shape=st.tuples(*(st.integers(1, n) for n in (2, 72, 3, 6, 6))),  # T up to 18 chunks of 4
    chunk=st.sampled_from([4, 8, 32]),
    cuts=st.lists(st.integers(1, 71), max_size=3),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_xla_matches_recurrence(shape, chunk, cuts, seed):
    b, t, h, k_dim, v_dim = shape
    with jax.enable_x64(True):
        q, k, v, g, beta, s0 = kda_inputs(seed, b, t, h, k_dim, v_dim)
        pos = jnp.arange(t)
        seg = sum((pos >= c).astype(jnp.int32) for c in cuts) if cuts else jnp.zeros(t, jnp.int32)
        seg = jnp.broadcast_to(seg, (b, t))
        kw = dict(initial_state=s0, segment_ids=seg)
        chunked = jax.jit(lambda *a: chunk_kda(
            *a, **kw, output_final_state=True, implementation="xla", chunk_size=chunk))
        o, s = chunked(q, k, v, g, beta)
        o_ref, s_ref = jax.jit(lambda *a: naive_recurrent_kda(*a, **kw))(q, k, v, g, beta)
        assert rel_rmse(o, o_ref) <= F64_RTOL
        assert rel_rmse(s, s_ref) <= F64_RTOL


def test_dispatch_paths():
    from pallas_kernels.kda.ops import _resolve

    args = dict(_args(), scale=0.5, initial_state=None, segment_ids=None, chunk_size=16, interpret=True)
    assert _resolve("xla", False, args)[0] == "xla"
    assert _resolve(None, True, args)[0] == "pallas-tpu-interpret"
    assert _resolve("pallas", "tpu", args)[0] == "pallas-tpu-interpret"
    if jax.default_backend() == "cpu":
        assert _resolve(None, False, args)[0] == "xla"
    with jax.enable_x64(True):  # no kernel takes float64: None falls back, "pallas" refuses
        args64 = dict(args, q=jnp.zeros((B, T, H, K), jnp.float64))
        assert _resolve(None, True, args64)[0] == "xla"
        with pytest.raises(ValueError, match="does not support these inputs"):
            _resolve("pallas", True, args64)
    with pytest.raises(ValueError, match="interpret must be"):
        _resolve(None, "cpu", args)
