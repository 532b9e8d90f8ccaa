"""The dense path's GPU decode kernels (``kernel_gpu_decode_dense``) against ``moe_decode.dense_experts``,
interpreted on CPU and compiled on the GPU; the default, the switches and their errors.

The kernels round where the reference does (the gate and up products, the activation and each
expert's output to bf16, the weighted sum over k in fp32); only fp32 summation orders differ, so against
the NumPy definition that rounds at those points an output may move by one bf16 ulp, rarely. The MoE
layer's switch (``MoEConfig.decode_implementation``) is tested for both paths in ``test_decode_kernel.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.layers import moe_decode, mxfp4
from pallas_kernels.moe.kernel_gpu_decode_dense import (WIDE, DenseTiles, accepts, default_tiles, dense_experts_pallas,
                                                       expert_outputs)
from pallas_kernels.target import Target, compile_for
from tests.pallas_kernels.moe.test_decode_kernel import _assert_within_ulps, _inputs, _rounded_reference, check_compiled


def _xla(x, ids, weights, ws, activation):
    return jax.jit(lambda *a: moe_decode.dense_experts(*a, activation=activation, implementation="xla"))(
        x, ids, weights, *ws)


@pytest.mark.parametrize("T,k,E,L,F,activation,tiles", [
    (64, 8, 8, 128, 128, "situ", DenseTiles()),                       # one token block, two column blocks
    (20, 2, 8, 64, 128, "swiglu", DenseTiles(block_n=32, block_k=32)),  # 20 tokens padded to a block of 32
    (40, 4, 4, 64, 64, "situ", DenseTiles(block_t=16, block_n=32, block_k=16)),  # three token blocks
    (32, 4, 8, 128, 256, "situ", None),  # the default at these widths: the Mosaic GPU (TMA) kernels
])
def test_interpreted_kernels_match_the_dense_path(T, k, E, L, F, activation, tiles):
    x, ids, weights, ws = _inputs(T + E, T, k, E, L, F)
    got = dense_experts_pallas(x, ids, weights, *ws, activation=activation, tiles=tiles, interpret=True)
    assert got.shape == x.shape and got.dtype == x.dtype
    _assert_within_ulps(got, _rounded_reference(x, ids, weights, ws, activation), max_fraction=0.02)
    _assert_within_ulps(got, _xla(x, ids, weights, ws, activation), max_fraction=0.02)


def test_default_tiles_follow_the_widths():
    """128 columns and 8 warps where the latent and the intermediate width are multiples of 128 (small()'s
    512 and K3's 3584 latent), the 64-column tiles otherwise; the kernels then take those widths."""
    assert default_tiles(512, 512) == default_tiles(3584, 2048) == WIDE
    assert WIDE.block_n == 128 and WIDE.num_warps == 8
    assert default_tiles(64, 128) == default_tiles(128, 192) == DenseTiles()
    x, ids, weights, ws = _inputs(1, 16, 2, 4, 64, 192)
    assert accepts(x, ids, weights, *ws) and not accepts(x, ids, weights, *ws, WIDE)


def test_every_expert_output_is_the_rounded_product():
    """``expert_outputs`` is ``act(x W1_e, x W3_e) W2_e`` for every expert and token (padding rows cut)."""
    x, _, _, ws = _inputs(3, 24, 2, 4, 64, 64)
    y = expert_outputs(x, *ws, activation="situ", tiles=DenseTiles(block_n=32, block_k=32), interpret=True)
    assert y.shape == (4, 24, 64) and y.dtype == jnp.bfloat16
    for e in range(4):
        ids = jnp.full((24, 1), e, jnp.int32)
        ref = _rounded_reference(x, ids, jnp.ones((24, 1), jnp.float32), ws, "situ")
        # a flipped rounding of g or u moves every output of its token: a few percent of them here
        _assert_within_ulps(y[e], ref, max_fraction=0.05)


def _has_pallas_call(x, ids, weights, ws) -> bool:
    # a fresh function per trace: a traced function's jaxpr is cached regardless of the target
    return "pallas_call" in str(jax.make_jaxpr(
        lambda *a: moe_decode.dense_experts(*a, activation="situ"))(x, ids, weights, *ws))


def test_default_picks_the_kernels_on_a_cuda_target():
    """``implementation=None``: the kernels when tracing for a CUDA GPU and they take the inputs; XLA
    for a CPU target, float32 weights and widths that are no multiple of the 64-column blocks."""
    fits, narrow = _inputs(0, 16, 4, 8, 64, 128), _inputs(0, 16, 4, 8, 64, 96)
    x, ids, weights, ws = fits
    wide = (x.astype(jnp.float32), ids, weights, [w.astype(jnp.float32) for w in ws])
    with compile_for(Target("gpu", "NVIDIA H200", cuda=True)):
        assert _has_pallas_call(*fits)
        assert not _has_pallas_call(*narrow) and not _has_pallas_call(*wide)
    with compile_for("cpu"):
        assert not _has_pallas_call(*fits)
    default = moe_decode.dense_experts(x, ids, weights, *ws, activation="situ")
    np.testing.assert_array_equal(np.asarray(default, np.float32), np.asarray(_xla(x, ids, weights, ws, "situ"),
                                                                              np.float32))


@pytest.mark.unchecked
def test_bad_inputs_raise():
    x, ids, weights, ws = _inputs(0, 16, 4, 8, 64, 96)
    run = lambda *a, **kw: moe_decode.dense_experts(*a, activation="situ", implementation="pallas", interpret=True,
                                                    **kw)
    with pytest.raises(ValueError, match="implementation must be one of"):
        moe_decode.dense_experts(x, ids, weights, *ws, activation="situ", implementation="triton")
    with pytest.raises(ValueError, match=r"F=96 must be a multiple of tiles.block_n=64"):
        run(x, ids, weights, *ws)
    with pytest.raises(ValueError, match="one 16-bit float dtype"):
        run(x.astype(jnp.float32), ids, weights, *[w[..., :64].astype(jnp.float32) for w in ws[:2]],
            ws[2][:, :64].astype(jnp.float32))
    with pytest.raises(ValueError, match=r"tiles.block_t=24 must be a power of two"):
        dense_experts_pallas(x, ids, weights, *[w[..., :64] for w in ws[:2]], ws[2][:, :64], activation="situ",
                             tiles=DenseTiles(block_t=24), interpret=True)
    packed = mxfp4._encode_stack(np.asarray(ws[0][:, :, :32], np.float32))
    with pytest.raises(ValueError, match="MXFP4 weights"):
        run(x, ids, weights, packed, packed, packed)
    with compile_for("cpu"), pytest.raises(ValueError, match="needs a CUDA GPU"):
        moe_decode.dense_experts(x, ids, weights, *ws, activation="situ", implementation="pallas")


@pytest.mark.gpu
@pytest.mark.parametrize("T,activation", [(64, "situ"), (40, "swiglu")])
def test_compiled_kernels_match_the_dense_path(T, activation):
    """``small()``'s experts at batch 64, and 40 tokens (a padded block)."""
    check_compiled(moe_decode.dense_experts, T, activation)
