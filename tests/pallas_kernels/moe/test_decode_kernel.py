"""The gather path's GPU decode kernel (``kernel_gpu_decode``) against ``moe_decode.gathered_experts``,
interpreted on CPU and compiled on the GPU; the default and the switches (``implementation=``, ``MoEConfig``) and their errors.

The kernel rounds where the reference does (g, u, the activation and each expert's output to bf16, the
weighted sum over k in fp32), so against a NumPy reference that rounds at exactly those points it may
differ only where a different fp32 summation order flips a rounding: rarely, by one bf16 ulp. XLA's
gather path drops the round trip of each expert's output through bf16 (excess precision, CPU compile),
so against it the bound is one ulp, not the frequency.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from k3jax import config
from k3jax.component_configs import MoEConfig
from k3jax.layers import moe_decode, mxfp4
from k3jax.layers.moe import MoE
from pallas_kernels.moe.activations import gated_activation
from pallas_kernels.moe.kernel_gpu_decode import DecodeTiles, gathered_experts_pallas
from pallas_kernels.target import Target, compile_for

BF16_ULP = 2.0 ** -7  # spacing of bf16 relative to the value's power of two


def _inputs(seed, T, k, E, L, F):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(T, L)), jnp.bfloat16)
    ids = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(T)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, size=(T, k)), jnp.float32)
    ws = [jnp.asarray(rng.normal(size=s) * L ** -0.5, jnp.bfloat16) for s in ((E, L, F), (E, L, F), (E, F, L))]
    return x, ids, weights, ws


def _rounded_reference(x, ids, weights, ws, activation) -> np.ndarray:
    """The definition, rounding to bf16 at each of ``gathered_experts``' points, in NumPy fp32."""
    bf, f32 = ml_dtypes.bfloat16, np.float32
    rnd = lambda a: np.asarray(a, f32).astype(bf).astype(f32)
    x, w, (w1, w3, w2) = np.asarray(x, f32), np.asarray(weights), [np.asarray(a, f32) for a in ws]
    out = np.zeros(x.shape, f32)
    for t in range(x.shape[0]):
        for s, e in enumerate(np.asarray(ids[t])):
            g, u = rnd(x[t] @ w1[e]), rnd(x[t] @ w3[e])
            a = rnd(gated_activation(jnp.asarray(g), jnp.asarray(u), activation))
            out[t] += w[t, s] * rnd(a @ w2[e])
    return rnd(out)


def _assert_within_ulps(got, ref, max_fraction=1.0):
    """Within one bf16 ulp of the element plus one of the token's largest output: an expert output's
    rounding that went the other way moves the weighted sum by an ulp of that output, which the sum
    may cancel down to a smaller element."""
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    diff = np.abs(got - ref)
    bound = BF16_ULP * (np.maximum(np.abs(ref), np.abs(got)) + np.max(np.abs(ref), axis=-1, keepdims=True))
    assert np.all(diff <= bound), (diff / bound).max()
    assert np.mean(diff > 0) <= max_fraction, np.mean(diff > 0)


@pytest.mark.parametrize("T,k,E,L,F,activation,block_f,prefetch", [
    (1, 8, 64, 512, 512, "situ", 32, True),     # small() at batch 1: 8 slots x 16 F blocks
    (2, 8, 64, 512, 512, "swiglu", 32, False),  # two tokens, each block read where it is used
    (2, 2, 8, 64, 48, "situ", 16, True),        # small: three F blocks (not a power of two), k = 2
])
def test_interpreted_kernel_matches_gather_path(T, k, E, L, F, activation, block_f, prefetch):
    x, ids, weights, ws = _inputs(T + k, T, k, E, L, F)
    tiles = DecodeTiles(block_f=block_f, prefetch=prefetch)
    got = gathered_experts_pallas(x, ids, weights, *ws, activation=activation, tiles=tiles, interpret=True)
    assert got.shape == x.shape and got.dtype == x.dtype
    _assert_within_ulps(got, _rounded_reference(x, ids, weights, ws, activation), max_fraction=0.02)
    xla = jax.jit(lambda *a: moe_decode.gathered_experts(*a, activation=activation))(x, ids, weights, *ws)
    _assert_within_ulps(got, xla)


def test_opt_in_through_gathered_experts():
    """``implementation="pallas"`` runs the kernel; None and "xla" stay the XLA fusions."""
    x, ids, weights, ws = _inputs(1, 1, 2, 8, 64, 32)
    kernel = gathered_experts_pallas(x, ids, weights, *ws, activation="situ", tiles=DecodeTiles(block_f=16),
                                     interpret=True)
    opted = moe_decode.gathered_experts(x, ids, weights, *ws, activation="situ", implementation="pallas",
                                        interpret=True)
    np.testing.assert_array_equal(np.asarray(opted, np.float32),
                                  np.asarray(gathered_experts_pallas(x, ids, weights, *ws, activation="situ",
                                                                     interpret=True), np.float32))
    _assert_within_ulps(kernel, opted)
    default = moe_decode.gathered_experts(x, ids, weights, *ws, activation="situ")
    xla = moe_decode.gathered_experts(x, ids, weights, *ws, activation="situ", implementation="xla")
    np.testing.assert_array_equal(np.asarray(default, np.float32), np.asarray(xla, np.float32))
    assert MoEConfig().decode_implementation is None


def _has_pallas_call(x, ids, weights, ws) -> bool:
    # a fresh function per trace: a traced function's jaxpr is cached regardless of the target
    return "pallas_call" in str(jax.make_jaxpr(
        lambda *a: moe_decode.gathered_experts(*a, activation="situ"))(x, ids, weights, *ws))


def test_default_picks_the_kernel_on_a_cuda_target():
    """``implementation=None``: the kernel when tracing for a CUDA GPU and it takes the shapes; XLA
    for a CPU target and for shapes the kernel refuses (F = 48 is no multiple of its 32-column blocks)."""
    fits, odd = _inputs(0, 1, 2, 8, 64, 64), _inputs(0, 1, 2, 8, 64, 48)
    with compile_for(Target("gpu", "NVIDIA H200", cuda=True)):
        assert _has_pallas_call(*fits)
        assert not _has_pallas_call(*odd)
    with compile_for("cpu"):
        assert not _has_pallas_call(*fits)


@pytest.mark.unchecked
def test_bad_inputs_raise():
    x, ids, weights, ws = _inputs(0, 1, 2, 8, 64, 48)
    with pytest.raises(ValueError, match="implementation must be one of"):
        moe_decode.gathered_experts(x, ids, weights, *ws, activation="situ", implementation="triton")
    with pytest.raises(ValueError, match="block_f=32 must be a power of two >= 16 dividing F=48"):
        moe_decode.gathered_experts(x, ids, weights, *ws, activation="situ", implementation="pallas", interpret=True)
    packed = mxfp4._encode_stack(np.asarray(ws[0][:, :, :32], np.float32))
    with pytest.raises(ValueError, match="MXFP4 weights"):
        moe_decode.gathered_experts(x, ids, weights, packed, packed, packed, activation="situ",
                                    implementation="pallas", interpret=True)
    with compile_for("cpu"), pytest.raises(ValueError, match="needs a CUDA GPU"):
        moe_decode.gathered_experts(x, ids, weights, *ws, activation="situ", implementation="pallas")
    with pytest.raises(ValueError, match="decode_implementation='triton' must be one of"):
        MoEConfig(decode_implementation="triton")


def check_compiled(experts, T: int, activation: str):
    """``experts(implementation="pallas")`` compiled for the GPU at ``small()``'s experts (64 of 512 ×
    512, k = 8) against the exact-rounding reference."""
    x, ids, weights, ws = _inputs(T, T, 8, 64, 512, 512)
    got = jax.jit(lambda *a: experts(*a, activation=activation, implementation="pallas"))(x, ids, weights, *ws)
    _assert_within_ulps(got, _rounded_reference(x, ids, weights, ws, activation), max_fraction=0.02)


@pytest.mark.gpu
@pytest.mark.parametrize("T,activation", [(1, "situ"), (2, "swiglu")])
def test_compiled_kernel_matches_gather_path(T, activation):
    check_compiled(moe_decode.gathered_experts, T, activation)


@pytest.mark.parametrize("path", ["gather", "dense"])
def test_moe_config_reaches_the_decode_kernels(path):
    """``MoEConfig.decode_implementation="pallas"``: a decode with plain weights takes the path's kernels
    (batch 1: the gather kernel; 2E/k tokens: the dense kernels; here, a CPU target: their error), MXFP4
    experts stay on the XLA path (same output as the default)."""
    base = dataclasses.replace(config.tiny(), dtype=jnp.float32)
    cfg = dataclasses.replace(base, moe=dataclasses.replace(base.moe, decode_implementation="pallas"))
    T = 1 if path == "gather" else 2 * cfg.moe.num_experts // cfg.moe.top_k
    assert moe_decode.decode_path(T, cfg.moe.top_k, cfg.moe.num_experts) == path
    x = jnp.asarray(np.random.default_rng(0).normal(size=(T, 1, cfg.hidden)), jnp.float32)
    variables = nn.meta.unbox(jax.jit(MoE(cfg).init)(jax.random.key(0), x))
    with compile_for("cpu"), pytest.raises(ValueError, match="needs a CUDA GPU"):
        MoE(cfg).apply(variables, x, decode=True)
    quantized = mxfp4.quantize_experts(variables)
    np.testing.assert_array_equal(np.asarray(MoE(cfg).apply(quantized, x, decode=True)),
                                  np.asarray(MoE(base).apply(quantized, x, decode=True)))
