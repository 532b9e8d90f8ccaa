"""Mosaic GPU backward of the KDA intra-chunk prep == ``jax.vjp`` of the XLA prep (``kernel_gpu_intra``).

Runs in the CPU interpreter (default suite, tiny sizes) and compiled on the H200 (``-m gpu``);
the CUDA lowering (layouts, shared memory within the 227 KB limit) is checked on the CPU host.
"""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.kda.kernel_gpu import chunk_kda_pallas
from pallas_kernels.kda.kernel_gpu_prep import CHUNK
from pallas_kernels.kda.kernel_gpu_prep_bwd import prep_bwd, prepare_bwd
from tests.pallas_kernels.kda.prep_bwd_cases import (
    CASES, MODES, assert_grads_close, assert_whole_op_grads, cuda_gradient_text, prep_inputs, xla_prep_vjp,
)

@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("B,T,H,K,V,lengths,gate_bound", CASES)
def test_prep_bwd_matches_xla_vjp(interpret, B, T, H, K, V, lengths, gate_bound):
    args, sidx, _ = prep_inputs(7, B, T, H, K, V, lengths, gate_bound)
    scale = K**-0.5
    _, cts, want = xla_prep_vjp(args, sidx, scale)
    got = jax.jit(lambda c, *a: prepare_bwd(*a, sidx, c, scale=scale, interpret=interpret))(cts, *args)
    assert_grads_close(args, got, want)


@pytest.mark.parametrize("interpret", MODES)
def test_chunk_kda_gradients_with_kernel_prep_bwd(interpret):
    """The whole op (prep kernels + scan kernels) against the fp32 chunked reference."""
    K, V = 64, 128
    assert_whole_op_grads(lambda *a: chunk_kda_pallas(*a[:5], scale=K**-0.5, initial_state=a[5], segment_ids=a[6],
                                                      interpret=interpret, prep="fused", prep_bwd="kernel"), K, V)


def test_bad_prep_bwd_is_refused():
    (q, k, v, g, beta), _, _ = prep_inputs(2, 1, 20, 1, 64, 64, None)
    with pytest.raises(ValueError, match="prep_bwd"):
        chunk_kda_pallas(q, k, v, g, beta, scale=1.0, prep_bwd="triton")
    with pytest.raises(ValueError, match="prep_bwd"):
        chunk_kda_pallas(q, k, v, g, beta, scale=1.0, prep="xla", prep_bwd="kernel")


def test_kernel_lowers_for_cuda(K=64, V=128):
    """Lowered for CUDA on the CPU host: layouts resolve and shared memory fits one CTA per SM."""
    B, Tp, H, C = 1, 128, 2, CHUNK
    S, bf, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    args = (S((B, Tp, H, K), bf), S((B, Tp, H, K), bf), S((B, Tp, H, V), bf), S((B, Tp, H, K), f32),
            S((B, Tp // C * 8, H, K), f32), S((B * H, 5, Tp), f32), S((B * H, Tp, K), bf), S((B * H, Tp, V), bf),
            S((B * H, Tp, K), f32), S((B * H, Tp, K), f32), S((B * H, Tp, C), f32))
    traced = prep_bwd.trace(*args, scale=0.1, interpret=False, dtypes=(bf, bf, bf))
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1
    assert "kda_prep_bwd_mosaic_gpu" in text


def test_chunk_kda_gradient_lowers_for_cuda():
    """The whole differentiated op at K = V = 128 (the kernel's largest shared memory) lowers to
    the four Mosaic GPU kernels, with no XLA prep forward kept for an autodiff backward."""
    text = cuda_gradient_text("kernel")
    assert text.count("custom_call @mosaic_gpu") == 4
    for name in ("kda_prep_fwd", "kda_prep_bwd", "kda_scan_fwd", "kda_scan_bwd"):
        assert f"{name}_mosaic_gpu" in text, name
