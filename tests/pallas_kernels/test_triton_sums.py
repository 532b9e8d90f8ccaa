"""``triton_sums.sums``: several sums in one Pallas-Triton reduction, equal to ``jnp.sum`` of each."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.triton_sums import sums


def _in_kernel(xs, axis, interpret):
    """``sums(*xs, axis)`` inside one Pallas kernel (whole arrays as blocks)."""
    shape = xs[0].shape[:axis] + xs[0].shape[axis + 1:]

    def kernel(*refs):
        ins, outs = refs[:len(xs)], refs[len(xs):]
        for out, s in zip(outs, sums(*(r[...] for r in ins), axis=axis)):
            out[...] = s

    return pl.pallas_call(kernel, out_shape=[jax.ShapeDtypeStruct(shape, x.dtype) for x in xs],
                          interpret=interpret)(*xs)


def _cases():
    rng = np.random.default_rng(0)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    i = lambda *shape: jnp.asarray(rng.integers(-50, 50, shape), jnp.int32)
    return [((f(16, 128), f(16, 128), i(16, 128)), 1),  # mixed dtypes, the minor axis
            ((f(32, 64), f(32, 64)), 0),  # the major axis
            (tuple(f(256) for _ in range(6)), 0)]  # many operands, to scalars


@pytest.mark.parametrize("case", range(3))
def test_sums_equal_each_operands_sum_interpreted(case):
    xs, axis = _cases()[case]
    for got, x in zip(_in_kernel(xs, axis, interpret=True), xs):
        np.testing.assert_allclose(np.asarray(got), np.asarray(jnp.sum(x, axis=axis)), rtol=1e-5, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(3))
def test_sums_equal_each_operands_sum_compiled(case):
    xs, axis = _cases()[case]
    for got, x in zip(_in_kernel(xs, axis, interpret=False), xs):
        np.testing.assert_allclose(np.asarray(got), np.asarray(jnp.sum(x, axis=axis)), rtol=1e-5, atol=1e-4)


def test_sums_outside_a_kernel_and_shape_errors():
    x, y = jnp.ones((4, 8)), jnp.arange(32.0).reshape(4, 8)
    a, b = jax.jit(lambda u, v: sums(u, v, axis=-1))(x, y)
    np.testing.assert_array_equal(np.asarray(a), np.full(4, 8.0))
    np.testing.assert_array_equal(np.asarray(b), np.asarray(jnp.sum(y, axis=1)))
    assert sums() == []
    with pytest.raises(ValueError, match=r"xs\[1\] has shape \[4\], xs\[0\] \[4, 8\]"):
        sums(x, jnp.ones(4))
