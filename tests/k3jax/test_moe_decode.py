"""The MoE's decode paths (k3jax/layers/moe_decode.py) and MXFP4 expert weights (k3jax/layers/mxfp4.py).

- gathered and dense experts equal ``moe_ffn`` (the training path) in float32;
- the JAX MXFP4 decoder equals the release codec (k3jax/convert/mxfp4.py), tiny exponents included;
- a MoE reading MXFP4 weights equals the same MoE on the dequantised weights, on every path
  (gather, dense, grouped), and stays within the quantisation error of the unquantised weights;
- a whole decode step with MXFP4 experts (scanned stack included) equals it on dequantised weights.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import config
from k3jax.convert import mxfp4 as codec
from k3jax.infer.cache import init_cache
from k3jax.infer.decode import decode_step
from k3jax.layers import moe_decode, mxfp4
from k3jax.layers.moe import MoE
from pallas_kernels.moe import moe_ffn
from tests.tolerances import F32_RTOL, rel_rmse

RNG = np.random.default_rng(0)
E, K, L, F = 8, 2, 64, 32


def _expert_inputs(T):
    x = jnp.asarray(RNG.normal(size=(T, L)), jnp.float32)
    ids = jnp.asarray(np.stack([RNG.choice(E, K, replace=False) for _ in range(T)]), jnp.int32)
    weights = jnp.asarray(RNG.uniform(0.1, 1.0, size=(T, K)), jnp.float32)
    ws = [jnp.asarray(RNG.normal(size=s) * 0.1, jnp.float32) for s in ((E, L, F), (E, L, F), (E, F, L))]
    return x, ids, weights, ws


@pytest.mark.parametrize("path,T", [("gather", 1), ("gather", 2), ("dense", 8)])
def test_decode_paths_equal_moe_ffn(path, T):
    assert moe_decode.decode_path(T, K, E) == path
    x, ids, weights, ws = _expert_inputs(T)
    run = moe_decode.gathered_experts if path == "gather" else moe_decode.dense_experts
    with jax.default_matmul_precision("highest"):
        got = run(x, ids, weights, *ws, activation="situ")
        ref = moe_ffn(x, ids, weights, *ws, activation="situ", implementation="xla")
    assert rel_rmse(got, ref) <= F32_RTOL


def test_decoder_matches_codec():
    w = RNG.normal(size=(6, 64)).astype(np.float32) * np.logspace(-3, 2, 64, dtype=np.float32)
    packed, scale = codec.encode(w)
    scale[0, 0] = 3  # a group down at 2^-124: values stay normal (XLA flushes float32 subnormals)
    ref = codec.decode(packed, scale)
    got = mxfp4.dequantize(jnp.asarray(packed), jnp.asarray(scale), jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), ref)
    np.testing.assert_array_equal(np.asarray(mxfp4.dequantize(jnp.asarray(packed), jnp.asarray(scale), jnp.bfloat16),
                                             np.float32), ref)  # exact in bf16


def _moe_variables(cfg):
    x = jnp.zeros((1, 4, cfg.hidden), jnp.float32)
    return nn.meta.unbox(jax.jit(MoE(cfg).init)(jax.random.key(0, impl="unsafe_rbg"), x))


@pytest.mark.parametrize("T,decode", [(1, True), (8, True), (3, True), (40, False)])  # gather, dense, grouped, training
def test_mxfp4_moe_equals_dequantised(T, decode):
    cfg = dataclasses.replace(config.tiny(), dtype=jnp.float32)
    variables = _moe_variables(cfg)
    quantized = mxfp4.quantize_experts(variables)
    assert "w1" not in quantized["params"] and quantized["mxfp4"]["w1"].packed.dtype == jnp.uint8
    dequantized = mxfp4.dequantize_experts(quantized, jnp.float32)
    x = jnp.asarray(RNG.normal(size=(1, T, cfg.hidden)), jnp.float32)
    apply = lambda v: MoE(cfg).apply(v, x, decode=decode)
    with jax.default_matmul_precision("highest"):
        got, ref, exact = apply(quantized), apply(dequantized), apply(variables)
    assert rel_rmse(got, ref) <= F32_RTOL
    # Against the unquantised weights: within the weights' own quantisation error.
    w_err = rel_rmse(dequantized["params"]["w1"], variables["params"]["w1"])
    assert 0 < rel_rmse(got, exact) <= 2 * w_err


def test_mxfp4_decode_step_equals_dequantised(tiny_model):
    cfg, variables = tiny_model.cfg, tiny_model.variables
    quantized = mxfp4.quantize_experts(variables)
    dequantized = mxfp4.dequantize_experts(quantized, jnp.float32)
    tokens = jnp.asarray(RNG.integers(0, cfg.vocab_size, size=(1, 1)), jnp.int32)
    with jax.default_matmul_precision("highest"):
        got, _ = decode_step(quantized, cfg, tokens, init_cache(cfg, 1, 4))
        ref, _ = decode_step(dequantized, cfg, tokens, init_cache(cfg, 1, 4))
    assert rel_rmse(got, ref) <= F32_RTOL


def test_quantize_needs_experts():
    with pytest.raises(ValueError, match="no MoE expert weights"):
        mxfp4.quantize_experts({"params": {"dense": {"kernel": jnp.zeros((32, 32))}}})


def test_e2m1_arithmetic_is_the_code_table():
    """The decoder computes each code's value (no table gather): bit for bit the codec's table, -0.0 too."""
    got = np.asarray(mxfp4._e2m1(jnp.arange(16, dtype=jnp.uint8)))
    np.testing.assert_array_equal(got, codec.CODE_VALUES)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(codec.CODE_VALUES))


def test_quantized_shapes_and_axes_match_quantize_experts():
    """The abstract twin (plans) gives quantize_experts' tree, shapes and dtypes; the names swap to [out, in]."""
    cfg = dataclasses.replace(config.tiny(), dtype=jnp.float32)
    x = jnp.zeros((1, 4, cfg.hidden), jnp.float32)
    boxed = jax.eval_shape(MoE(cfg).init, jax.random.key(0), x)
    real = mxfp4.quantize_experts(_moe_variables(cfg))
    abstract = mxfp4.quantized_shapes(nn.meta.unbox(boxed))
    assert jax.tree.structure(abstract) == jax.tree.structure(real)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == jax.tree.map(lambda a: (a.shape, a.dtype), real)
    axes = mxfp4.quantized_axes(nn.get_partition_spec(boxed))
    assert tuple(axes["mxfp4"]["w2"].scale) == ("experts", "latent", "expert_mlp")
    assert tuple(axes["mxfp4"]["w1"].packed) == ("experts", "expert_mlp", "latent")
