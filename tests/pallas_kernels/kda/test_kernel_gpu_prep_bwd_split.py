"""Two-kernel Mosaic GPU backward of the KDA prep (``prep_bwd="split"``) == ``jax.vjp`` of the XLA prep.

Runs in the CPU interpreter (default suite, tiny sizes) and compiled on the H200 (``-m gpu``);
the CUDA lowering (layouts, shared memory) is checked on the CPU host.
"""

import jax
import jax.numpy as jnp
import pytest

from k3jax.config import KDAConfig
from pallas_kernels.kda import chunk_kda
from pallas_kernels.kda.kernel_gpu import chunk_kda_pallas
from pallas_kernels.kda.kernel_gpu_prep import CHUNK, _cumsum_anchors, _kernel_inputs, prep_fwd
from pallas_kernels.kda.kernel_gpu_prep_bwd_intra import intra_bwd
from pallas_kernels.kda.kernel_gpu_prep_bwd_split import prepare_bwd_split, wy_bwd
from tests.pallas_kernels.kda.prep_bwd_cases import (
    CASES, MODES, SM_SMEM_BYTES, assert_grads_close, assert_whole_op_grads, cuda_gradient_text, kernel_shapes,
    prep_inputs, record_smem, xla_prep_vjp,
)
from tests.tolerances import rel_rmse

@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("B,T,H,K,V,lengths,gate_bound", CASES)
def test_split_prep_bwd_matches_xla_vjp(interpret, B, T, H, K, V, lengths, gate_bound):
    args, sidx, _ = prep_inputs(7, B, T, H, K, V, lengths, gate_bound)
    scale = K**-0.5
    _, cts, want = xla_prep_vjp(args, sidx, scale)
    got = jax.jit(lambda c, *a: prepare_bwd_split(*a, sidx, c, scale=scale, interpret=interpret))(cts, *args)
    assert_grads_close(args, got, want)


@pytest.mark.parametrize("interpret", MODES)
def test_chunk_kda_gradients_with_split_prep_bwd(interpret):
    """The whole op through ``chunk_kda(gpu_prep_backward="split")`` against the fp32 chunked reference."""
    assert_whole_op_grads(lambda *a: chunk_kda(*a[:5], initial_state=a[5], segment_ids=a[6], output_final_state=True,
                                               implementation="pallas", interpret="gpu" if interpret else False,
                                               gpu_prep_backward="split"), 64, 64)


def test_split_needs_the_fused_prep():
    assert KDAConfig(num_heads=1, head_dim=16, gpu_prep_backward="split").gpu_prep_backward == "split"
    (q, k, v, g, beta), _, _ = prep_inputs(2, 1, 20, 1, 64, 64, None)
    with pytest.raises(ValueError, match="prep_bwd"):
        chunk_kda_pallas(q, k, v, g, beta, scale=1.0, prep="xla", prep_bwd="split")


@pytest.mark.parametrize("K,V", [(128, 128), (64, 128)])
def test_kernels_lower_for_cuda(K, V, monkeypatch):
    """Both kernels lower for CUDA on the CPU host: layouts resolve, and by Mosaic GPU's own
    shared-memory estimate two CTAs of each fit on one SM (the point of the split)."""
    smem_bytes = record_smem(monkeypatch)
    B, Tp, H = 1, 128, 2
    S, bf, f32, C, BH, tok, common = kernel_shapes(B, Tp, H, K, V)
    wy = wy_bwd.trace(tok(K, bf), tok(V, bf), *common.values(), S((BH, Tp, K), bf), S((BH, Tp, V), bf),
                      interpret=False, dv_dtype=bf)
    intra = intra_bwd.trace(tok(K, bf), tok(K, bf), *common.values(), S((BH, Tp, C), f32), S((BH, Tp, C), bf),
                            S((BH, Tp, K), bf), S((BH, Tp, K), f32), S((BH, Tp, K), f32),
                            scale=0.1, interpret=False, dtypes=(bf, bf))
    for traced, name in ((wy, "kda_prep_bwd_wy"), (intra, "kda_prep_bwd_intra")):
        smem_bytes.clear()
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call @mosaic_gpu") == 1
        assert f"{name}_mosaic_gpu" in text
        assert 2 * (max(smem_bytes) + 1024) <= SM_SMEM_BYTES, (name, max(smem_bytes))


def test_chunk_kda_gradient_lowers_for_cuda():
    """The differentiated op at K = V = 128 lowers to five Mosaic GPU kernels (prep fwd, scan fwd
    and bwd, the two prep backward kernels) and nothing else."""
    text = cuda_gradient_text("split")
    assert text.count("custom_call @mosaic_gpu") == 5
    for name in ("kda_prep_fwd", "kda_prep_bwd_wy", "kda_prep_bwd_intra", "kda_scan_fwd", "kda_scan_bwd"):
        assert f"{name}_mosaic_gpu" in text, name


def test_gradient_takes_the_split_kernels_only_when_asked():
    (q, k, v, g, beta), _, _ = prep_inputs(3, 1, 64, 1, 64, 64, None)
    for choice, expected in (("split", True), ("xla", False)):
        loss = lambda *a: jnp.sum(chunk_kda(*a, implementation="pallas", interpret="gpu",
                                            gpu_prep_backward=choice)[0].astype(jnp.float32))
        text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(q, k, v, g, beta))
        assert ("kda_prep_bwd_wy" in text and "kda_prep_bwd_intra" in text) == expected, choice


@pytest.mark.parametrize("interpret", MODES)
def test_whole_op_grads_at_k128(interpret):
    """``prep_bwd="split"`` under ``jax.grad`` at K = V = 128 (the forward kernel's right operand
    formed once, left operands from registers, G and its anchors saved for the backward kernels)."""
    assert_whole_op_grads(lambda *a: chunk_kda_pallas(*a[:5], scale=a[0].shape[-1] ** -0.5, initial_state=a[5],
                                                      segment_ids=a[6], interpret=interpret, prep_bwd="split"),
                          128, 128)


def test_saved_g_and_anchors_match_xla():
    """``prep_fwd(save_g=True)``'s G and anchors (rows 0-4 of each chunk's 8) == :func:`_cumsum_anchors`."""
    (q, k, v, g, beta), sidx, _ = prep_inputs(3, 2, 100, 2, 128, 128, (30, 70))
    qh, kh, vh, g_p, vecs, _ = _kernel_inputs(q, k, v, g, beta, sidx)
    outs = prep_fwd(qh, kh, vh, g_p, vecs, scale=0.1, interpret=True, save_g=True)
    G, anchors = outs[-2:]
    want_G, want_anchors = _cumsum_anchors(g_p)
    n = g_p.shape[1] // CHUNK
    rows = lambda a: a.reshape(a.shape[0], n, 8, *a.shape[2:])[:, :, :5]
    assert rel_rmse(G, want_G) <= 1e-6
    assert rel_rmse(rows(anchors), rows(want_anchors)) <= 1e-6
