"""KDA's short-conv kernels (``kernel_gpu_conv``) against ``short_convs``' XLA stages, their reference:
interpreted on CPU (values and every gradient, with and without packed documents, fp32 and bf16),
compiled on the GPU; which implementation ``None`` picks, and the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import kernel_gpu_conv
from pallas_kernels.kda.conv import same_document_taps, short_convs
from pallas_kernels.target import Target, compile_for
from tests.tolerances import F32_RTOL, rel_rmse

B, T, C, W = 2, 64, 256, 4
GROUPS = (128, 128, None)  # q and k normalised per 128-channel head, v not


def _inputs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    xs = tuple(jnp.asarray(rng.normal(size=(B, T, C)), dtype) for _ in range(3))
    ws = tuple(jnp.asarray(rng.uniform(-0.5, 0.5, size=(C, W)), jnp.float32) for _ in range(3))
    cts = tuple(jnp.asarray(rng.normal(size=(B, T, C)), dtype) for _ in range(3))
    # documents of ~25 tokens on average: some start inside a 16-row block, some span whole blocks
    seg = jnp.asarray(np.cumsum(rng.random((B, T)) < 0.04, axis=1), jnp.int32)
    return xs, ws, cts, seg


def _run(implementation, xs, ws, cts, keep, dtype):
    f = lambda xs, ws: short_convs(xs, ws, keep, l2_groups=GROUPS, out_dtype=dtype,
                                   implementation=implementation, interpret=implementation == "pallas")
    out, vjp = jax.vjp(jax.jit(f), xs, ws)
    return out, vjp(cts)


@pytest.mark.parametrize("with_docs", [False, True])
def test_kernels_match_the_xla_stages_fp32(with_docs):
    xs, ws, cts, seg = _inputs(jnp.float32)
    keep = same_document_taps(seg, W) if with_docs else None
    got, want = _run("pallas", xs, ws, cts, keep, jnp.float32), _run("xla", xs, ws, cts, keep, jnp.float32)
    leaves = list(zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    assert len(leaves) == 9  # 3 outputs, 3 dx, 3 dw
    for a, b in leaves:
        assert a.shape == b.shape and a.dtype == b.dtype
        assert rel_rmse(a, b) <= F32_RTOL


def test_kernels_match_the_xla_stages_bf16():
    """bf16 inputs, outputs and cotangents (the layer's setting): the same fp32 arithmetic, so the
    outputs agree to a bf16 rounding of nearly equal fp32 values."""
    xs, ws, cts, seg = _inputs(jnp.bfloat16, seed=1)
    keep = same_document_taps(seg, W)
    got, want = _run("pallas", xs, ws, cts, keep, jnp.bfloat16), _run("xla", xs, ws, cts, keep, jnp.bfloat16)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.dtype == b.dtype
        assert rel_rmse(a.astype(jnp.float32), b.astype(jnp.float32)) <= 2e-3


def test_forward_saves_the_per_head_inverse_norms():
    xs, ws, _, _ = _inputs(jnp.float32)
    y, inv = kernel_gpu_conv.conv_forward(xs[0], ws[0], None, group=128, eps=1e-6, out_dtype=jnp.float32,
                                          interpret=True)
    assert inv.shape == (B, T, C // 128, 1)
    norms = jnp.sqrt(jnp.sum(jnp.square(y.reshape(B, T, C // 128, 128)), axis=-1))
    np.testing.assert_allclose(np.asarray(norms), 1.0, rtol=1e-5)
    _, none = kernel_gpu_conv.conv_forward(xs[2], ws[2], None, group=None, eps=1e-6, out_dtype=jnp.float32,
                                           interpret=True)
    assert none is None


def test_clean_blocks_are_those_no_mask_changes():
    """``mask_operands``' per-block flag: True exactly where every tap of the block's 16 rows and of
    the W-1 rows after it stays in its document; the test inputs have blocks of both kinds."""
    keep = np.asarray(same_document_taps(_inputs(jnp.float32)[3], W)).reshape(B * T, W - 1)
    _, clean = kernel_gpu_conv.mask_operands(jnp.asarray(keep).reshape(B, T, W - 1), 16)
    want = [bool(keep[i * 16 : i * 16 + 16 + W - 1].all()) for i in range(B * T // 16)]
    assert list(np.asarray(clean, bool)) == want
    assert 0 < sum(want) < len(want)


def _has_pallas_call(xs, ws, keep) -> bool:
    # a fresh function per trace: a traced function's jaxpr is cached regardless of the target
    return "pallas_call" in str(jax.make_jaxpr(lambda xs, ws: short_convs(xs, ws, keep, l2_groups=GROUPS))(xs, ws))


def test_default_picks_the_kernels_on_a_cuda_target():
    xs, ws, _, _ = _inputs(jnp.float32)
    odd = tuple(x[:, :40] for x in xs)  # T = 40: no multiple of the 16-row blocks
    keep = same_document_taps(_inputs(jnp.float32)[3], W)
    with compile_for(Target("gpu", "NVIDIA H200", cuda=True)):
        assert _has_pallas_call(xs, ws, None)
        assert not _has_pallas_call(odd, ws, None)
        assert _has_pallas_call(xs, ws, keep)  # packed documents too (stop 40: 1.29 against 2.09 ms)
    with compile_for("cpu"):
        assert not _has_pallas_call(xs, ws, None)


@pytest.mark.unchecked
def test_bad_inputs_raise():
    xs, ws, _, _ = _inputs(jnp.float32)
    call = lambda xs, ws, groups=GROUPS, **kw: short_convs(xs, ws, None, l2_groups=groups, **kw)
    with pytest.raises(ValueError, match="implementation must be one of"):
        call(xs, ws, implementation="triton")
    with compile_for("cpu"), pytest.raises(ValueError, match="needs a CUDA GPU"):
        call(xs, ws, implementation="pallas")
    with pytest.raises(ValueError, match=r"L2 group \(64 channels\) must equal tiles.block_c=128"):
        call(xs, ws, groups=(64, 64, None), implementation="pallas", interpret=True)
    with pytest.raises(ValueError, match="tiles.block_t=16 must be a power of two dividing T=40"):
        call(tuple(x[:, :40] for x in xs), ws, implementation="pallas", interpret=True)
    with pytest.raises(ValueError, match="power-of-two width W"):
        kernel_gpu_conv.check_inputs(xs[0], ws[0][:, :3], None, 128)
    with pytest.raises(ValueError, match="dy must have x's shape"):
        kernel_gpu_conv.conv_dz(xs[0], ws[0], None, None, xs[0][:, :32], interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("with_docs", [False, True])
def test_compiled_kernels_match_the_xla_stages(with_docs):
    xs, ws, cts, seg = _inputs(jnp.float32)
    keep = same_document_taps(seg, W) if with_docs else None
    run = lambda impl: jax.vjp(jax.jit(lambda xs, ws: short_convs(xs, ws, keep, l2_groups=GROUPS,
                                                                   implementation=impl)), xs, ws)
    (got, vjp_got), (want, vjp_want) = run("pallas"), run("xla")
    for a, b in zip(jax.tree.leaves((got, vjp_got(cts))), jax.tree.leaves((want, vjp_want(cts)))):
        assert rel_rmse(a, b) <= F32_RTOL
