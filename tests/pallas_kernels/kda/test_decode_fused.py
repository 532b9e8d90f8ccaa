"""The fused KDA decode step (``kernel_gpu_decode.fused_step_pallas``: convs, q/k norms, β, the decay gate
from ``f_a``, the delta rule and the conv tails in one kernel) against its reference
(``reference_decode.fused_step_reference``), interpreted on CPU and compiled on the GPU; its errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.kda.kernel_gpu_decode import MAX_FUSED_TOKENS, fused_accepts, fused_step_pallas
from pallas_kernels.kda.reference_decode import decay_product, fused_step_reference
from tests.tolerances import BF16_FWD_RTOL, F32_RTOL, rel_rmse

W = 4


def _inputs(seed, B, T, H, K, num_new=None, param_dtype=jnp.float32, lower_bound=-5.0, extra=5):
    """Packed projections ``y`` (q, k, v, β, f_a, then ``extra`` columns the step does not read: the output
    gate's), cached conv inputs, the layer's parameters, a state and each row's real new tokens."""
    ks = jax.random.split(jax.random.key(seed), 8)
    R = K
    N = 3 * H * K + H + R + extra
    y = jax.random.normal(ks[0], (B, T, N)).astype(jnp.bfloat16)
    tails = jax.random.normal(ks[1], (3, B, W - 1, H * K), jnp.float32)
    convs = tuple((0.5 * jax.random.normal(k, (W, H, K))).astype(param_dtype) for k in jax.random.split(ks[2], 3))
    f_b = (0.1 * jax.random.normal(ks[3], (R, H, K))).astype(param_dtype)
    dt_bias = jax.random.normal(ks[4], (H, K)).astype(param_dtype)
    a_log = jax.random.normal(ks[5], (H,)).astype(param_dtype)
    state = jax.random.normal(ks[6], (B, H, K, K), jnp.float32)
    num_new = jnp.full((B,), T, jnp.int32) if num_new is None else jnp.asarray(num_new, jnp.int32)
    offsets = (0, H * K, 2 * H * K, 3 * H * K, 3 * H * K + H)
    kw = dict(offsets=offsets, scale=K ** -0.5, lower_bound=lower_bound, eps=1e-6)
    return (y, tails, convs, f_b, dt_bias, a_log, state, num_new), kw


def _with_product(args, kw):
    """``args`` with the decay's product ``z = f_a · W_fb`` made first (as XLA's matmul makes it from
    ``MIN_STATES`` states) in place of ``W_fb``."""
    z = decay_product(args[0], args[3], kw["offsets"][4])
    return args[:3] + (z,) + args[4:], kw


def _assert_float32_but_one_flip(state, want):
    """Interpreted, the kernel's float32 sums almost always run as the reference's (CPU) and the state agrees to
    float32. Where XLA:CPU orders one otherwise, a value one float32 ulp from a bf16 rounding tie rounds the other
    way (hypothesis found seed 3063, B=3, T=4, H=2, K=32, rows [0, 0, 1]: k of row 2, head 1, channel 8 sits one
    ulp from the tie), and that head's whole update moves by a bf16-input error (8.7e-5). So one (row, head) may
    miss float32, within the bf16-input tolerance; a wrong rounding point would move every head."""
    errs = [rel_rmse(state[b, h], want[b, h]) for b in range(state.shape[0]) for h in range(state.shape[1])]
    assert sum(e > F32_RTOL for e in errs) <= 1 and max(errs) <= BF16_FWD_RTOL, errs


def _check(args, kw, interpret=True):
    """Interpreted, the state agrees to float32 (:func:`_assert_float32_but_one_flip`); compiled, another
    summation order flips some of the bf16 roundings of q, k, v and the decay product inside the step (H100:
    state 2e-4 with z given, 2e-3 with the product inside), a bf16-input error."""
    want = jax.jit(lambda *a: fused_step_reference(*a, **kw))(*args)
    got = fused_step_pallas(*args, **kw, interpret=interpret)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
    o, state, tails = got
    if interpret:
        _assert_float32_but_one_flip(state, want[1])
    else:
        assert rel_rmse(state, want[1]) <= BF16_FWD_RTOL
    assert rel_rmse(o, want[0]) <= BF16_FWD_RTOL
    np.testing.assert_array_equal(np.asarray(tails), np.asarray(want[2]))  # copies of the inputs


@pytest.mark.parametrize("B,T,H,K,num_new,param_dtype,lower_bound", [
    (1, 1, 2, 16, None, jnp.float32, -5.0),       # one token, one V block (small()'s batch 1, narrower)
    (2, 3, 2, 32, [1, 3], jnp.float32, -5.0),     # ragged rows: tokens past num_new are no-ops, tails end there
    (2, 4, 3, 32, [0, 2], jnp.bfloat16, None),    # an empty row, Kimi-Linear's softplus gate, bf16 parameters
    (1, 2, 2, 64, None, jnp.float32, -5.0),       # two V blocks of 32 a head
])
def test_interpreted_kernel_matches_reference(B, T, H, K, num_new, param_dtype, lower_bound):
    _check(*_inputs(0, B, T, H, K, num_new, param_dtype, lower_bound))


@pytest.mark.parametrize("B,T,num_new,lower_bound", [(2, 1, None, -5.0), (2, 3, [3, 1], None)])
def test_interpreted_kernel_takes_the_product_given(B, T, num_new, lower_bound):
    """``decay`` as the product ``z [B, T, H, K]`` instead of ``W_fb``: the same step."""
    args, kw = _inputs(4, B, T, 2, 32, num_new, lower_bound=lower_bound)
    _check(*_with_product(args, kw))
    got = fused_step_pallas(*_with_product(args, kw)[0], **kw, interpret=True)
    want = fused_step_pallas(*args, **kw, interpret=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), B=st.integers(1, 3), T=st.integers(1, MAX_FUSED_TOKENS), H=st.integers(1, 3),
       K=st.sampled_from([16, 32]), data=st.data())
def test_property_kernel_matches_reference(seed, B, T, H, K, data):
    """Any batch, token count up to ``MAX_FUSED_TOKENS``, heads and ragged real-token counts."""
    num_new = data.draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
    _check(*_inputs(seed, B, T, H, K, num_new))


def test_the_property_tests_rounding_flip():
    """The property test's counterexample (:func:`_assert_float32_but_one_flip`), kept: on the CPU one head of row 2
    misses float32 by a bf16 rounding of k (8.7e-5), every other head matches to float32."""
    _check(*_inputs(3063, 3, 4, 2, 32, [0, 0, 1]))


def test_a_row_with_no_real_token_keeps_its_state():
    """``num_new = 0``: the state is returned unchanged (g = 0, β = 0) and the tails are the cached ones."""
    args, kw = _inputs(3, 2, 2, 2, 16, num_new=[0, 2])
    _, state, tails = fused_step_pallas(*args, **kw, interpret=True)
    np.testing.assert_array_equal(np.asarray(state[0]), np.asarray(args[6][0]))
    np.testing.assert_array_equal(np.asarray(tails[:, 0]), np.asarray(args[1][:, 0]))
    assert not np.array_equal(np.asarray(state[1]), np.asarray(args[6][1]))


@pytest.mark.parametrize("K,in_place", [(16, True), (32, True), (64, False)])
def test_tails_in_place_where_a_program_owns_the_heads_v(K, in_place):
    """The state is always updated in place; the conv tails only where one program holds a head's whole V
    (``BLOCK_V`` >= V), the other programs of a head reading all of its q and k tails otherwise."""
    args, kw = _inputs(0, 2, 1, 2, K)
    jaxpr = jax.make_jaxpr(lambda *a: fused_step_pallas(*a, **kw, interpret=True))(*args)
    calls = [e for e in jaxpr.eqns[0].params["jaxpr"].eqns if e.primitive.name == "pallas_call"]
    assert len(calls) == 1
    assert dict(calls[0].params["input_output_aliases"]) == ({9: 1, 2: 2} if in_place else {9: 1})


@pytest.mark.unchecked
def test_errors_name_the_argument():
    args, kw = _inputs(0, 1, 1, 2, 16)
    y, tails, convs, f_b, dt_bias, a_log, state, num_new = args
    call = lambda *a, **k: fused_step_pallas(*a, **{**kw, **k}, interpret=True)
    with pytest.raises(ValueError, match=f"y must be .B, T, N. with 1 <= T <= {MAX_FUSED_TOKENS}"):
        call(jnp.zeros((1, MAX_FUSED_TOKENS + 1, y.shape[2]), y.dtype), *args[1:])
    with pytest.raises(ValueError, match="state must be float32"):
        call(*args[:6], state.astype(jnp.bfloat16), num_new)
    with pytest.raises(ValueError, match="power-of-two widths >= 16 with V == K"):
        call(*args[:6], jnp.zeros((1, 2, 16, 32), jnp.float32), num_new)
    with pytest.raises(ValueError, match=r"tails must be \[3, B, W-1, H·K\]"):
        call(y, tails[:2], *args[2:])
    with pytest.raises(ValueError, match=r"conv_weights must be q's, k's and v's \[W, H, K\]"):
        call(y, tails, convs[:2], *args[3:])
    with pytest.raises(ValueError, match="dt_bias, a_log, num_new must be"):
        call(*args[:7], jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match=r"decay must be W_fb \[R, H, K\] or the product z \[B, T, H, K\]"):
        call(*args[:3], jnp.zeros((1, 1, 2, 16), jnp.float32), *args[4:])  # z not in y's dtype
    with pytest.raises(ValueError, match="offsets must be the columns of y"):
        call(*args, offsets=(0, 32, 64, 96, y.shape[2]))
    assert not fused_accepts(*args[:6], state.astype(jnp.bfloat16), num_new, kw["offsets"])
    assert fused_accepts(*args, kw["offsets"])


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H,K,num_new,product", [(1, 1, 8, 128, None, False), (2, 4, 8, 128, [4, 2], False),
                                                    (1, 1, 96, 128, None, True), (64, 1, 8, 128, None, True)])
def test_compiled_kernel_matches_reference(B, T, H, K, num_new, product):
    """small()'s KDA layer at batch 1 and 2 (four tokens, ragged) with W_fb inside, K3's 96 heads and small()'s
    batch 64 with the product given (the layer's path from MIN_STATES states)."""
    args, kw = _inputs(1, B, T, H, K, num_new)
    _check(*(_with_product(args, kw) if product else (args, kw)), interpret=False)
