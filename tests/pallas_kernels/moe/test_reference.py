"""The XLA path (sort + ragged_dot) against the dense one-hot oracles, plus input checks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax.experimental import checkify

from pallas_kernels.moe import combine, grouped_matmul, moe_ffn, permute
from pallas_kernels.moe.reference import grouped_matmul_dense, moe_ffn_dense
from tests.pallas_kernels.moe.conftest import (
    gmm_value_and_grads,
    group_sizes_strategy,
    random_gmm_inputs,
    random_moe_inputs,
)
from tests.tolerances import BF16_FWD_RTOL, F64_RTOL, rel_rmse

M, K, N, E = 24, 8, 6, 4


_xla = gmm_value_and_grads(lambda a, b, g: grouped_matmul(a, b, g, implementation="xla"))
_dense = gmm_value_and_grads(grouped_matmul_dense)


@settings(max_examples=15, deadline=None)
@given(gs=group_sizes_strategy(E, M))
def test_grouped_matmul_xla_matches_dense(gs):
    lhs, rhs = random_gmm_inputs(0, M, K, N, E, jnp.float32)
    (va, (da, db)), (vb, (ea, eb)) = _xla(lhs, rhs, gs), _dense(lhs, rhs, gs)
    out = grouped_matmul(lhs, rhs, gs, implementation="xla")
    assert rel_rmse(out, grouped_matmul_dense(lhs, rhs, gs)) < 1e-5
    assert np.all(np.asarray(out)[gs.sum():] == 0)
    assert rel_rmse(da, ea) < 1e-5 and rel_rmse(db, eb) < 1e-5


def test_grouped_matmul_float64_stays_float64():
    with jax.enable_x64(True):
        lhs, rhs = random_gmm_inputs(1, M, K, N, E, jnp.float64)
        gs = jnp.array([5, 0, 11, 3], jnp.int32)
        out = grouped_matmul(lhs, rhs, gs, implementation="xla")
        assert out.dtype == jnp.float64
        assert rel_rmse(out, grouped_matmul_dense(lhs, rhs, gs)) < F64_RTOL


def test_permute_combine_round_trip_exact():
    t, d, k = 10, 5, 3
    x = jax.random.normal(jax.random.PRNGKey(2), (t, d))
    ids = jax.random.randint(jax.random.PRNGKey(3), (t, k), 0, E)
    xs, gs, inv = permute(x, ids, E)
    np.testing.assert_array_equal(gs, np.bincount(np.asarray(ids).ravel(), minlength=E))
    np.testing.assert_array_equal(xs[inv], np.repeat(np.asarray(x), k, axis=0))
    # sorted rows come grouped by expert, in token order inside each group
    sorted_ids = np.asarray(ids).ravel()[np.argsort(np.asarray(inv))]
    assert np.all(np.diff(sorted_ids) >= 0)
    for slot in range(k):
        w = jax.nn.one_hot(jnp.full((t,), slot), k)
        np.testing.assert_array_equal(combine(xs, inv, w), x)


def test_permute_combine_gradients():
    t, d, k = 7, 4, 2
    x = jax.random.normal(jax.random.PRNGKey(4), (t, d))
    ids = jax.random.randint(jax.random.PRNGKey(5), (t, k), 0, E)
    w = jax.random.uniform(jax.random.PRNGKey(6), (t, k))
    scale = jax.random.normal(jax.random.PRNGKey(7), (t * k, d))

    def ours(x, w):
        xs, _, inv = permute(x, ids, E)
        return jnp.sum(jnp.sin(combine(xs * scale[jnp.argsort(inv)], inv, w)))

    def naive(x, w):
        rep = jnp.repeat(x, k, axis=0) * scale  # [T·k, D]
        return jnp.sum(jnp.sin(jnp.einsum("TkD,Tk->TD", rep.reshape(t, k, d), w)))

    for a, b in zip(jax.jit(jax.grad(ours, (0, 1)))(x, w), jax.jit(jax.grad(naive, (0, 1)))(x, w)):
        assert rel_rmse(a, b) < 1e-6


@pytest.mark.parametrize("activation", ["situ", "swiglu"])
def test_moe_ffn_xla_float64_matches_dense(activation):
    with jax.enable_x64(True):
        args = random_moe_inputs(8, 12, 8, 6, E, 2, jnp.float64)
        args = args[:2] + (args[2].astype(jnp.float64),) + args[3:]
        out = jax.jit(functools.partial(moe_ffn, activation=activation, implementation="xla"))(*args)
        assert out.dtype == jnp.float64
        assert rel_rmse(out, jax.jit(functools.partial(moe_ffn_dense, activation=activation))(*args)) < F64_RTOL

        def loss(fn):
            return lambda x, w, w1, w3, w2: jnp.sum(
                jnp.sin(fn(x, args[1], w, w1, w3, w2, activation=activation))
            )

        diff = (0, 1, 2, 3, 4)
        rest = (args[0],) + args[2:]
        ga = jax.jit(jax.grad(loss(lambda *a, **kw: moe_ffn(*a, implementation="xla", **kw)), diff))(*rest)
        gb = jax.jit(jax.grad(loss(moe_ffn_dense), diff))(*rest)
        for a, b in zip(ga, gb):
            assert a.dtype == jnp.float64
            assert rel_rmse(a, b) < F64_RTOL


def test_moe_ffn_bf16_matches_dense():
    args = random_moe_inputs(9, 16, 16, 8, E, 3, jnp.bfloat16)
    out = jax.jit(functools.partial(moe_ffn, implementation="xla"))(*args)
    assert out.dtype == jnp.bfloat16
    ref = jax.jit(moe_ffn_dense)(*[a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args])
    print("bf16 moe_ffn rel_rmse", rel_rmse(out, ref))
    assert rel_rmse(out, ref) < BF16_FWD_RTOL


def _gmm_args():
    lhs, rhs = random_gmm_inputs(0, M, K, N, E, jnp.float32)
    return lhs, rhs, jnp.array([4, 4, 4, 4], jnp.int32)


@pytest.mark.unchecked
@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a, b, g: (a, b, jnp.array([20, 10, 0, 0], jnp.int32)), "sum"),
        (lambda a, b, g: (a, b, jnp.array([-1, 4, 4, 4], jnp.int32)), ">= 0"),
        (lambda a, b, g: (a, b, jnp.array([4, 4, 4], jnp.int32)), "group_sizes must have shape"),
        (lambda a, b, g: (a, b.astype(jnp.bfloat16), g), "dtype"),
        (lambda a, b, g: (a, b[:, :3], g), "rhs.shape"),
        (lambda a, b, g: (a, b, g.astype(jnp.float32)), "integer"),
    ],
)
def test_grouped_matmul_bad_input(change, match):
    with pytest.raises(ValueError, match=match):
        grouped_matmul(*change(*_gmm_args()), implementation="xla")


def test_grouped_matmul_checkify_mode():
    lhs, rhs, _ = _gmm_args()
    f = jax.jit(checkify.checkify(lambda g: grouped_matmul(lhs, rhs, g, implementation="xla", checked=True)))
    err, _ = f(jnp.array([4, 4, 4, 4], jnp.int32))
    err.throw()
    err, _ = f(jnp.array([20, 10, 0, 0], jnp.int32))
    with pytest.raises(checkify.JaxRuntimeError, match="sum"):
        err.throw()
    err, _ = f(jnp.array([-2, 4, 4, 4], jnp.int32))
    assert err.get() is not None


@pytest.mark.unchecked
def test_moe_ffn_bad_input():
    x, ids, w, w1, w3, w2 = random_moe_inputs(0, 4, 8, 6, E, 2, jnp.float32)
    with pytest.raises(ValueError, match="w2"):
        moe_ffn(x, ids, w, w1, w3, w2[:, :, :3])
    with pytest.raises(ValueError, match="topk_ids"):
        moe_ffn(x, ids + E, w, w1, w3, w2)
    with pytest.raises(ValueError, match="w1.dtype"):
        moe_ffn(x, ids, w, w1.astype(jnp.bfloat16), w3, w2)
    with pytest.raises(ValueError, match="activation"):
        moe_ffn(x, ids, w, w1, w3, w2, activation="relu")
    with pytest.raises(ValueError, match="implementation"):
        moe_ffn(x, ids, w, w1, w3, w2, implementation="triton")
