"""Split prep backward reading the forward's saved ``T`` (``prep_bwd="split-saved"``).

Gradients == ``jax.vjp`` of the fp32 XLA prep, kernel A == the recomputing kernel A, in the CPU
interpreter (default suite, tiny sizes) and compiled on the H200 (``-m gpu``); the CUDA lowering
(layouts, Mosaic GPU's shared-memory estimate) is checked on the CPU host.
"""

import jax
import jax.numpy as jnp
import pytest

from k3jax.config import KDAConfig
from pallas_kernels.kda import chunk_kda
from pallas_kernels.kda.kernel_gpu import chunk_kda_pallas
from pallas_kernels.kda.kernel_gpu_intra import prepare_from_index
from pallas_kernels.kda.kernel_gpu_prep import CHUNK, _kernel_inputs, prep_fwd
from pallas_kernels.kda.kernel_gpu_prep_bwd_intra import intra_bwd
from pallas_kernels.kda.kernel_gpu_prep_bwd_split import prepare_bwd_split, prepare_split, wy_bwd_saved
from tests.pallas_kernels.kda.prep_bwd_cases import (
    CASES, GRADS, MODES, SM_SMEM_BYTES, assert_grads_close, assert_whole_op_grads, cotangents, cuda_gradient_text,
    kernel_shapes, prep_inputs, record_smem, xla_prep_vjp,
)
from tests.tolerances import BF16_FWD_RTOL, F32_RTOL, rel_rmse


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize("B,T,H,K,V,lengths,gate_bound", CASES)
def test_saved_prep_bwd_matches_xla_vjp(interpret, B, T, H, K, V, lengths, gate_bound):
    """Through the custom_vjp: the kernel forward saves T, kernels A (reading T) and B run backward."""
    args, sidx, _ = prep_inputs(7, B, T, H, K, V, lengths, gate_bound)
    scale = K**-0.5
    want_outs, cts, want = xla_prep_vjp(args, sidx, scale)

    @jax.jit
    def ours(cts, *a):
        outs, ours_vjp = jax.vjp(lambda *p: prepare_split(*p, sidx.astype(jnp.float32), scale, interpret, True), *a)
        return outs, ours_vjp(tuple(c.astype(o.dtype) for c, o in zip(cts, outs)))[:5]  # W, U are bf16

    outs, got = ours(cts, *args)
    for i, (a, b) in enumerate(zip(outs, want_outs)):  # the forward is unchanged by saving T
        assert rel_rmse(a, b) <= BF16_FWD_RTOL, (i, rel_rmse(a, b))
    assert_grads_close(args, got, want)


@pytest.mark.parametrize("interpret", MODES)
def test_saved_backward_equals_recomputing_backward(interpret):
    """The saved halves are the operands the recomputing kernel A builds, up to fp32 rounding (the
    forward's G is its in-kernel tensor-core cumsum, A's is XLA's: the same sum in another order):
    in the interpreter dv differs by a few bf16 one-ulp flips (2.7e-6 rel. RMSE), dg by 1e-7, dq
    and dk not at all, each within the fp32 tolerance; dbeta's ``dL S_kk`` term moves from A (fp32
    dL) to B (bf16 ``beta dL``: 1e-4 rel. RMSE between the two paths, each 1.7e-3 from the fp32 XLA
    vjp), so each gradient must be as close to the XLA vjp as the recomputing path's. Documents mid-chunk,
    padded last chunk, K != V."""
    B, T, H, K, V = 1, 100, 1, 128, 64
    args, sidx, _ = prep_inputs(4, B, T, H, K, V, (30, 1, 69))
    scale = K**-0.5
    shapes = jax.eval_shape(lambda *a: prepare_from_index(*a, sidx, scale=scale, chunk=CHUNK), *args)
    cts = cotangents(shapes)

    @jax.jit
    def both(cts, *a):
        *fwd_inputs, _ = _kernel_inputs(*a, sidx)
        t = prep_fwd(*fwd_inputs, scale=scale, interpret=interpret, save_t=True)[6:]
        bwd = lambda saved_t: prepare_bwd_split(*a, sidx, cts, scale=scale, interpret=interpret, saved_t=saved_t)
        return bwd(tuple(t)), bwd(None)

    saved, recomputed = both(cts, *args)
    xla = lambda *a: prepare_from_index(*a, sidx, scale=scale, chunk=CHUNK, precision="highest")
    want = jax.vjp(xla, *(x.astype(jnp.float32) for x in args))[1](cts)
    for name, a, b, c in zip(GRADS, saved, recomputed, want):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        err = rel_rmse(a, b)
        assert err <= (BF16_FWD_RTOL if name == "dbeta" else F32_RTOL), f"{name}: rel RMSE {err:.3e}"
        assert rel_rmse(a, c) <= rel_rmse(b, c) * 1.05 + F32_RTOL, (name, rel_rmse(a, c), rel_rmse(b, c))


@pytest.mark.parametrize("interpret", [
    pytest.param(True, id="interpret", marks=pytest.mark.slow),
    pytest.param(False, id="compiled", marks=pytest.mark.gpu),
])
def test_chunk_kda_gradients_with_saved_t(interpret):
    """The whole op through ``chunk_kda(gpu_prep_backward="split-saved")`` against the fp32 chunked reference."""
    assert_whole_op_grads(lambda *a: chunk_kda(*a[:5], initial_state=a[5], segment_ids=a[6], output_final_state=True,
                                               implementation="pallas", interpret="gpu" if interpret else False,
                                               gpu_prep_backward="split-saved"), 64, 64)


def test_chunk_kda_takes_the_saved_path_only_when_asked():
    (q, k, v, g, beta), _, _ = prep_inputs(3, 1, 64, 1, 64, 64, None)
    for choice, expected in (("split-saved", True), ("split", False)):
        loss = lambda *a: jnp.sum(chunk_kda(*a, implementation="pallas", interpret="gpu",
                                            gpu_prep_backward=choice)[0].astype(jnp.float32))
        text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(q, k, v, g, beta))
        assert ("kda_prep_bwd_wy_saved" in text) == expected, choice
        assert "kda_prep_bwd_intra" in text
    assert KDAConfig(num_heads=1, head_dim=16, gpu_prep_backward="split-saved").gpu_prep_backward == "split-saved"
    with pytest.raises(ValueError, match="prep_bwd"):
        chunk_kda_pallas(q, k, v, g, beta, scale=1.0, prep="xla", prep_bwd="split-saved")


@pytest.mark.parametrize("K,V", [(128, 128), (64, 128)])
def test_saving_kernels_lower_for_cuda(K, V, monkeypatch):
    """The forward with ``save_t`` and kernel A reading T lower for CUDA; by Mosaic GPU's own
    estimate two CTAs of each still fit on one SM, and saving T costs the forward no shared memory."""
    smem_bytes = record_smem(monkeypatch)
    B, Tp, H = 1, 128, 2
    S, bf, f32, C, BH, tok, common = kernel_shapes(B, Tp, H, K, V)
    fwd_args = (tok(K, bf), tok(K, bf), tok(V, bf), common["G"], common["vecs"])  # g has G's shape
    per_kernel = {}
    for save_t in (False, True):
        smem_bytes.clear()
        text = prep_fwd.trace(*fwd_args, scale=0.1, interpret=False, save_t=save_t).lower(
            lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call @mosaic_gpu") == 1 and "kda_prep_fwd_mosaic_gpu" in text
        per_kernel[f"fwd save_t={save_t}"] = max(smem_bytes)
    G, _, vecs = common.values()
    wy = wy_bwd_saved.trace(tok(K, bf), tok(V, bf), G, vecs, S((BH, Tp, C), bf), S((BH, Tp, C), bf),
                            S((BH, Tp, K), bf), S((BH, Tp, V), bf), interpret=False, dv_dtype=bf)
    intra = intra_bwd.trace(tok(K, bf), tok(K, bf), *common.values(), S((BH, Tp, C), f32), S((BH, Tp, C), bf),
                            S((BH, Tp, K), bf), S((BH, Tp, K), f32), S((BH, Tp, K), f32),
                            scale=0.1, interpret=False, dtypes=(bf, bf), dbeta_rows=True)
    for traced, name in ((wy, "kda_prep_bwd_wy_saved"), (intra, "kda_prep_bwd_intra")):
        smem_bytes.clear()
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call @mosaic_gpu") == 1 and f"{name}_mosaic_gpu" in text
        per_kernel[name] = max(smem_bytes)
    print(f"K={K} V={V} smem bytes: {per_kernel}")
    assert per_kernel["fwd save_t=True"] == per_kernel["fwd save_t=False"], per_kernel
    for name, used in per_kernel.items():
        assert 2 * (used + 1024) <= SM_SMEM_BYTES, (name, used)


def test_chunk_kda_gradient_lowers_for_cuda_with_saved_t():
    """The differentiated op lowers to prep fwd (saving T), scan fwd and bwd, A reading T, and B."""
    text = cuda_gradient_text("split-saved")
    assert text.count("custom_call @mosaic_gpu") == 5
    for name in ("kda_prep_fwd", "kda_prep_bwd_wy_saved", "kda_prep_bwd_intra", "kda_scan_fwd", "kda_scan_bwd"):
        assert f"{name}_mosaic_gpu" in text, name
