"""The Pallas-Triton gated activations (``pallas_kernels/moe/activation_gpu.py``) against the jnp
reference beside them (``activations.py``), in the CPU interpreter and compiled on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe import activation_gpu as K
from pallas_kernels.moe.activations import (MIN_ELEMENTS, _value_and_partials, gated_activation, kernel_tiles,
                                            packed_gated_activation, split_gated_activation)
from pallas_kernels.target import Target, compile_for
from tests.tolerances import F32_RTOL, rel_rmse

BETAS = dict(beta1=4.0, beta2=25.0)
H200 = Target("gpu", "NVIDIA H200", cuda=True)


def _operands(shape, dtype, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    g = jax.random.normal(k1, shape) * 3
    g = g.at[0, :8].set(jnp.asarray([-30.0, 30.0, 0.0, 1e-30, -1e-3, 5e-3, -0.01, 0.02]))  # tails, series edge
    u = jax.random.normal(k2, shape) * 30
    return g.astype(dtype), u.astype(dtype), jax.random.normal(k3, shape).astype(dtype)


def _stable_f64(g, u, activation):
    """``(a, ∂a/∂g, ∂a/∂u)`` in float64 numpy, ``sech²`` and ``σ'`` without cancellation (autodiff's
    ``1 − tanh²`` is 0 at ``tanh = 1``, where the true slope is tiny but not zero)."""
    g, u = np.asarray(g, np.float64), np.asarray(u, np.float64)
    sig = np.exp(-np.logaddexp(0.0, -g))
    dsig = np.exp(-np.abs(g)) / (1.0 + np.exp(-np.abs(g))) ** 2
    if activation == "swiglu":
        return g * sig * u, u * (sig + g * dsig), g * sig
    sech2 = lambda x: 1.0 / np.cosh(x) ** 2
    gate, up = 4.0 * np.tanh(g / 4.0) * sig, 25.0 * np.tanh(u / 25.0)
    return gate * up, up * (sech2(g / 4.0) * sig + 4.0 * np.tanh(g / 4.0) * dsig), gate * sech2(u / 25.0)


@pytest.mark.parametrize("activation", ["situ", "swiglu"])
def test_fp32_math_matches_float64(activation):
    """The ex2 / reciprocal formulas in fp32 (the interpreter's exact reciprocal) against float64:
    within a few fp32 roundings everywhere, the saturated tails and the tanh series edge included."""
    g, u, _ = _operands((16, 256), jnp.float32)
    got = K.value_and_partials(g, u, activation, fast=False, **BETAS)
    for a, b in zip(got, _stable_f64(g, u, activation)):
        assert np.all(np.isfinite(np.asarray(a)))
        assert rel_rmse(a, b) < 1e-6
        np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=2e-5, atol=1e-6 * np.abs(b).max())


@pytest.mark.parametrize("activation", ["situ", "swiglu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_interpreted_kernels_match_the_reference(activation, dtype):
    g, u, da = _operands((16, 512), dtype)
    ref = lambda g, u: gated_activation(g, u, activation)
    run = dict(activation=activation, interpret=True, **BETAS)
    a = K.activation_forward(g, u, out_dtype=dtype, **run)
    dg, du = K.activation_backward(g, u, da, **run)
    want_a, vjp = jax.vjp(ref, g.astype(jnp.float32), u.astype(jnp.float32))
    want_dg, want_du = vjp(da.astype(jnp.float32))
    tol = F32_RTOL if dtype == jnp.float32 else 4e-3  # one bf16 rounding of the result
    assert a.dtype == dg.dtype == du.dtype == dtype
    for got, want in ((a, want_a), (dg, want_dg), (du, want_du)):
        assert rel_rmse(got, want) < tol
    # the packed [g | u] form reads the same values: the same forward, partials whose product is the gradient
    gu = jnp.concatenate([g, u], axis=1)
    a2, d_g, d_u = K.activation_with_partials(gu, out_dtype=dtype, **run)
    np.testing.assert_array_equal(np.asarray(a2, np.float32), np.asarray(a, np.float32))
    assert rel_rmse(da.astype(jnp.float32) * d_g.astype(jnp.float32), want_dg) < tol
    assert rel_rmse(da.astype(jnp.float32) * d_u.astype(jnp.float32), want_du) < tol


@pytest.mark.parametrize("activation", ["situ", "swiglu"])
def test_ops_through_the_interpreted_pass_match_their_jnp_forms(activation):
    """``split_gated_activation`` and ``packed_gated_activation`` with ``implementation="pallas"`` (the
    pass in the interpreter, any target) against ``"xla"``: values and gradients through their VJPs."""
    g, u, da = (x.reshape(4, 8, 256) for x in _operands((32, 256), jnp.bfloat16, seed=1))  # ops view [rows, F]
    for op, args in ((split_gated_activation, (g, u)), (packed_gated_activation, (jnp.concatenate([g, u], -1),))):
        run = lambda impl: jax.vjp(lambda *a: op(*a, activation, 4.0, 25.0, jnp.float32, impl, impl == "pallas"),
                                   *args)
        (got, vjp_got), (want, vjp_want) = run("pallas"), run("xla")
        assert got.dtype == jnp.float32 and got.shape == g.shape
        assert rel_rmse(got, want) < 1e-5  # the pass and jnp in fp32, one rounding each
        for a, b in zip(vjp_got(da.astype(jnp.float32)), vjp_want(da.astype(jnp.float32))):
            assert a.dtype == jnp.bfloat16 and rel_rmse(a, b) < 4e-3  # each rounded once to bf16 (packed: twice)


def test_tiles_for_shapes():
    assert K.tiles_for(131072, 3072) == K.ActTiles(2, 1024)
    assert K.tiles_for(262144, 512) == K.ActTiles(4, 512)
    assert K.tiles_for(32, 384) == K.ActTiles(16, 128) and K.tiles_for(24, 384) is None
    assert K.tiles_for(64, 96) is None  # no power-of-two factor >= 128
    with pytest.raises(ValueError, match=r"g: \[rows, cols\] = \[3, 1024\] must tile"):
        K.activation_forward(*_operands((3, 1024), jnp.bfloat16)[:2], out_dtype=jnp.bfloat16, interpret=True,
                             activation="situ", **BETAS)
    with pytest.raises(ValueError, match="activation must be 'situ' or 'swiglu'"):
        K.value_and_partials(jnp.ones(4), jnp.ones(4), "gelu", fast=False, **BETAS)
    g, u, _ = _operands((8, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="implementation must be one of"):
        split_gated_activation(g, u, "situ", implementation="triton")
    with compile_for("cpu"), pytest.raises(ValueError, match="needs a CUDA GPU"):
        split_gated_activation(g, u, "situ", implementation="pallas")
    with pytest.raises(ValueError, match=r"got bfloat16 \[8, 96\]"):
        split_gated_activation(g[:, :96], u[:, :96], "situ", implementation="pallas", interpret=True)
    with pytest.raises(ValueError, match="g and u of one dtype"):
        split_gated_activation(g, u.astype(jnp.float32), "situ", implementation="pallas", interpret=True)


def _has_kernel(fn, *args) -> bool:
    # a fresh function per trace: a traced function's jaxpr is cached regardless of the target
    return "pallas_call" in str(jax.make_jaxpr(lambda *a: fn(*a))(*args))


def test_the_ops_take_the_kernel_on_a_cuda_target_only():
    rows, cols = 16384, 512  # MIN_ELEMENTS: traced abstractly, nothing of this size is made
    g, u, da = (jax.ShapeDtypeStruct((rows, cols), jnp.bfloat16),) * 3
    gu = jax.ShapeDtypeStruct((rows, 2 * cols), jnp.bfloat16)
    split = lambda g, u: split_gated_activation(g, u, "situ")
    split_grad = lambda g, u, da: jax.vjp(split, g, u)[1](da)
    packed_grad = lambda gu, da: jax.vjp(lambda gu: packed_gated_activation(gu, "situ"), gu)[1](da)
    small = jax.ShapeDtypeStruct((64, cols), jnp.bfloat16)  # a decode step's rows
    with compile_for(H200):
        assert rows * cols == MIN_ELEMENTS and kernel_tiles(rows, cols, jnp.bfloat16) == K.ActTiles(4, 512)
        assert _has_kernel(split, g, u) and _has_kernel(split_grad, g, u, da)
        assert _has_kernel(packed_grad, gu, da) and _has_kernel(lambda gu: packed_gated_activation(gu, "situ"), gu)
        assert not _has_kernel(split, small, small)  # below MIN_ELEMENTS: XLA's fusion
        assert _has_kernel(lambda g, u: split_gated_activation(g, u, "situ", implementation="pallas"), small, small)
        assert kernel_tiles(rows - 8, cols, jnp.bfloat16) is None  # 16376 rows do not tile: the jnp reference
        assert kernel_tiles(rows, cols, jnp.float64) is None
        mesh = jax.sharding.AbstractMesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
        with jax.sharding.use_abstract_mesh(mesh):
            assert kernel_tiles(rows, cols, jnp.bfloat16) is None  # XLA partitions it: no custom call
    with compile_for("cpu"):
        assert not _has_kernel(split, g, u) and not _has_kernel(split_grad, g, u, da)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["situ", "swiglu"])
def test_compiled_kernels_match_the_reference(activation):
    g, u, da = _operands((4096, 1536), jnp.bfloat16)
    run = dict(activation=activation, **BETAS)
    a = jax.jit(lambda g, u: K.activation_forward(g, u, out_dtype=jnp.float32, **run))(g, u)
    dg, du = jax.jit(lambda g, u, da: K.activation_backward(g.astype(jnp.float32), u.astype(jnp.float32),
                                                            da.astype(jnp.float32), **run))(g, u, da)
    value, d_g, d_u = _stable_f64(g.astype(jnp.float32), u.astype(jnp.float32), activation)
    da64 = np.asarray(da, np.float64)
    for got, want in ((a, value), (dg, da64 * d_g), (du, da64 * d_u)):
        assert rel_rmse(got, want) < 1e-5  # rcp.approx and ex2 on the device: a few fp32 roundings
    want = _value_and_partials(g.astype(jnp.float32), u.astype(jnp.float32), activation, 4.0, 25.0)[0]
    assert rel_rmse(jax.jit(lambda g, u: split_gated_activation(g, u, activation))(g, u), want) < 4e-3
