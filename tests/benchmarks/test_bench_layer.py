"""benchmarks/bench_layer.py: the expert-parallel stand-in, the FLOP count, the residual accounting."""

import jax
import numpy as np
import pytest

from benchmarks.bench_layer import activation_bytes, layer_config, layer_flops, layer_index, make_case
from benchmarks.layer_breakdown import kernel_kind


def test_stand_in_is_one_rank_of_16_way_expert_parallelism():
    cfg = layer_config("kimi_k3", 56, 16, "bfloat16")
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.hidden, cfg.moe.latent_dim) == (56, 16, 7168, 3584)
    assert 896 // 16 == cfg.moe.num_experts  # K3's experts over 16 ranks
    assert (layer_index(cfg, "kda"), layer_index(cfg, "mla")) == (46, 47)  # mid-stack, 4 stored AttnRes blocks
    with pytest.raises(ValueError, match="top_k"):
        layer_config("kimi_k3", 56, 57, "bfloat16")
    with pytest.raises(ValueError, match="kind"):
        layer_index(layer_config("tiny", 8, 2, "float32"), "gqa")


def _sizes(params):
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    expert = sum(np.prod(v.shape) for p, v in leaves if str(p[-1].key) in ("w1", "w2", "w3"))
    return sum(np.prod(v.shape) for _, v in leaves), expert


@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_flops_count_k_of_e_experts_and_remat_keeps_less(kind):
    cfg = layer_config("tiny", 8, 2, "float32")
    loss, inputs, _ = make_case(cfg, kind, 32, "none", jax.random.key(0), abstract=True)
    total, expert = _sizes(inputs[0])
    active = total - expert + expert * 2 / 8
    flops = layer_flops(cfg, inputs[0], kind, 32)
    assert 32 * 6 * active < flops < 32 * 6 * active * 1.5  # plus the token mixer's own term
    kept = {r: activation_bytes(*make_case(cfg, kind, 32, r, jax.random.key(0), abstract=True)[:2])
            for r in ("none", "moe", "layer")}
    assert kept["none"] > kept["moe"] > kept["layer"]


def test_kernel_kinds():
    assert kernel_kind("moe_gmm") == "moe grouped matmul (Pallas)"
    assert kernel_kind("kda_prep_fwd") == "kda kernels (Pallas)"
    assert kernel_kind("mla_flash_dq") == "mla flash (Pallas)"
    assert kernel_kind("gated_act_bwd") == "gated activations (Pallas)"
    assert kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32") == "dense matmul (cuBLAS / XLA gemm)"
    assert kernel_kind("loop_multiply_fusion_3") == "XLA glue (fusions, copies, reductions)"


def test_compiler_variants_start_from_the_train_steps_options():
    """Every ``bench_layer.py`` build compiles with the train step's XLA options; a ``--variant`` adds
    its own on top, typed as ``TrainConfig.xla_options``; a malformed one is named."""
    from benchmarks.bench_layer import compiler_variants
    from k3jax.train.config import TrainConfig, xla_compiler_options

    variants = compiler_variants(["lt:xla_gpu_enable_cublaslt=true,xla_gpu_autotune_level=0",
                                  "xe:xla_allow_excess_precision=true"])
    base = xla_compiler_options(TrainConfig.excess_precision, TrainConfig.xla_options)
    assert variants["base"] == base and base["xla_allow_excess_precision"] is False
    assert variants["lt"] == {**base, "xla_gpu_enable_cublaslt": True, "xla_gpu_autotune_level": 0}
    assert variants["xe"] == {"xla_allow_excess_precision": True}
    for bad in ("lt", "base:xla_gpu_enable_cublaslt=true", "lt:", "lt:enable_cublaslt=true"):
        with pytest.raises(ValueError, match="variant|xla_options entry"):
            compiler_variants([bad])
    with pytest.raises(ValueError, match="new NAME"):
        compiler_variants(["a:xla_gpu_enable_cublaslt=true", "a:xla_gpu_autotune_level=0"])


def test_train_variants_keep_a_tuples_commas():
    import argparse

    from benchmarks.bench_train import _variant

    p = argparse.ArgumentParser()
    assert _variant('n:xla_options=("xla_a=1","xla_b=2"),remat=layer', ["seq_len=64"], p) == (
        "n", ["seq_len=64", 'xla_options=("xla_a=1","xla_b=2")', "remat=layer"])
    with pytest.raises(SystemExit):
        _variant("base:remat=layer", [], p)
