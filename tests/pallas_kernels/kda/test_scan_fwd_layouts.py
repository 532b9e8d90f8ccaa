"""Forward scan kernel (``kernel_gpu.scan_fwd``): ``o`` stored token-major ``[B, Tp, H, V]`` by TMA,
and ``ScanConfig(shared_v=True)`` (one CTA per head, one warpgroup per V block sharing the chunk
loads) against the one-CTA-per-V-block mode, a ``jnp`` scan and the fp32 chunked reference.

Interpreter runs watch the shared pipeline and the output staging with the CPU interpreter's race
detector; both modes lower for CUDA on the CPU host within one SM's shared memory.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda.kernel_gpu import CHUNK, ScanConfig, chunk_kda_pallas, scan_fwd
from tests.pallas_kernels.kda.conftest import (
    assert_grads_match, bf16_qkv_inputs, fp32_reference, pallas_scan_op, run_race_watched,
)
from tests.pallas_kernels.kda.prep_bwd_cases import (
    CTA_SMEM_BYTES, MODES, SHARED_INTERPRET_MARKS, SHARED_MODES, record_smem,
)
from tests.tolerances import BF16_FWD_RTOL, BF16_GRAD_RTOL, rel_rmse

BF, F32 = jnp.bfloat16, jnp.float32


def _operands(seed, BH, n, K, V):
    """Scan operands as the prep hands them over: head-major ``[BH, n*C, .]`` bf16, fp32 decays."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 7)
    tok = lambda key, cols, s: (s * jax.random.normal(key, (BH, n * CHUNK, cols), F32)).astype(BF)
    w, qg, kg = (tok(ks[i], K, K**-0.5) for i in range(3))
    u, aqk = tok(ks[3], V, 1.0), tok(ks[4], CHUNK, CHUNK**-0.5)
    d = jax.random.uniform(ks[5], (BH, n, K), F32, 0.5, 1.0)
    return w, qg, kg, u, aqk, d, jax.random.normal(ks[6], (BH, K, V), F32)


def _jnp_scan(w, qg, kg, u, aqk, d, s0):
    """``(o [BH,Tp,V], S_final, h [BH,N*K,V])`` with the kernel's bf16 rounding of ``S`` and ``v_new``."""
    f = lambda x: x.astype(F32)
    per_chunk = lambda x: jnp.swapaxes(x.reshape(x.shape[0], -1, CHUNK, x.shape[-1]), 0, 1)

    def step(S, ins):
        w_c, qg_c, kg_c, u_c, aqk_c, d_c = ins
        sb = f(S.astype(BF))
        vn = f((f(u_c) - jnp.einsum("bck,bkv->bcv", f(w_c), sb)).astype(BF))
        o = jnp.einsum("bck,bkv->bcv", f(qg_c), sb) + jnp.einsum("bcs,bsv->bcv", f(aqk_c), vn)
        return d_c[..., None] * S + jnp.einsum("bck,bcv->bkv", f(kg_c), vn), (o, sb)

    ins = (*(per_chunk(x) for x in (w, qg, kg, u, aqk)), jnp.swapaxes(d, 0, 1))
    S, (o, h) = jax.lax.scan(step, s0, ins)
    BH, K, V = s0.shape
    return jnp.swapaxes(o, 0, 1).reshape(BH, -1, V), S, jnp.swapaxes(h, 0, 1).reshape(BH, -1, V)


def _run(monkeypatch, interpret, shared_v, operands, *, store_states, out_dtype, heads):
    """The kernel traced afresh (no jit cache), with the interpreter's race detector on; asserts no race."""
    cfg = ScanConfig(bv=64, interpret=interpret, shared_v=shared_v)
    fn = functools.partial(scan_fwd.__wrapped__, cfg=cfg, store_states=store_states, out_dtype=out_dtype, heads=heads)
    return run_race_watched(monkeypatch, fn, operands, bool(interpret), f"shared_v={shared_v}")


@pytest.mark.parametrize("interpret", SHARED_MODES)
@pytest.mark.parametrize(
    "B,H,n,K,V,store_states,out_dtype",
    [
        (1, 2, 3, 128, 128, True, BF),  # three chunks: the shared pipeline refills each slot
        (2, 3, 2, 64, 128, False, F32),  # K != V, fp32 output staging
        (3, 1, 3, 128, 64, True, F32),  # one V block: one warpgroup with shared_v
    ],
)
def test_shared_v_equals_one_cta_per_block(monkeypatch, interpret, B, H, n, K, V, store_states, out_dtype):
    ops = _operands(0, B * H, n, K, V)
    split = _run(monkeypatch, interpret, False, ops, store_states=store_states, out_dtype=out_dtype, heads=H)
    shared = _run(monkeypatch, interpret, True, ops, store_states=store_states, out_dtype=out_dtype, heads=H)
    o_r, S_r, h_r = _jnp_scan(*ops)
    o_r = jnp.swapaxes(o_r.reshape(B, H, n * CHUNK, V), 1, 2)  # token-major
    assert split[0].shape == (B, n * CHUNK, H, V) and split[0].dtype == out_dtype
    for got in (split, shared):
        assert rel_rmse(got[0].astype(F32), o_r) <= BF16_FWD_RTOL
        assert rel_rmse(got[1], S_r) <= BF16_FWD_RTOL
        assert (got[2] is None) != store_states
        if store_states:
            assert rel_rmse(got[2].astype(F32), h_r) <= BF16_FWD_RTOL
    if interpret:  # the same products in the same order: bit-identical
        for a, b in zip(split, shared):
            if a is not None:
                np.testing.assert_array_equal(np.asarray(a.astype(F32)), np.asarray(b.astype(F32)))








@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize(
    "B,T,H,K,V,shared_v",
    [
        (2, 100, 3, 128, 128, False),  # few programs: 32-wide V blocks
        pytest.param(3, 70, 2, 64, 128, True, marks=SHARED_INTERPRET_MARKS),  # see SHARED_MODES
    ],
)
def test_forward_token_major_matches_reference(interpret, B, T, H, K, V, shared_v):
    """T not a multiple of the chunk: the padded rows are sliced off the token-major ``o``."""
    args = bf16_qkv_inputs(0, B, T, H, K, V)
    o, S = jax.jit(pallas_scan_op(interpret, shared_v))(*args)
    o_r, S_r = jax.jit(fp32_reference)(*args)
    assert o.shape == (B, T, H, V) and o.dtype == BF
    assert rel_rmse(o, o_r) <= BF16_FWD_RTOL, rel_rmse(o, o_r)
    assert rel_rmse(S, S_r) <= BF16_FWD_RTOL, rel_rmse(S, S_r)


@pytest.mark.parametrize("interpret", SHARED_MODES)
def test_gradients_match_reference(interpret):
    """``shared_v`` storing states for the backward; several batches and heads, so the token-major
    ``do`` must reach the backward head-major."""
    assert_grads_match(pallas_scan_op(interpret, True), fp32_reference, bf16_qkv_inputs(1, 2, 70, 2, 64, 128), BF16_GRAD_RTOL)


@pytest.mark.parametrize("shared_v", [False, True])
@pytest.mark.parametrize("K,V", [(128, 128), (64, 128)])
def test_scan_fwd_lowers_for_cuda(K, V, shared_v, monkeypatch):
    """Every variant (states stored or not, bf16 or fp32 ``o``) lowers for CUDA on the CPU host and
    fits one CTA's shared memory by Mosaic GPU's own estimate."""
    smem_bytes = record_smem(monkeypatch)
    S = jax.ShapeDtypeStruct
    BH, Tp, C = 4, 2 * CHUNK, CHUNK
    args = (*[S((BH, Tp, K), BF)] * 3, S((BH, Tp, V), BF), S((BH, Tp, C), BF), S((BH, Tp // C, K), F32),
            S((BH, K, V), F32))
    for store_states in (False, True):
        for out_dtype in (BF, F32):
            smem_bytes.clear()
            traced = scan_fwd.trace(*args, cfg=ScanConfig(bv=64, shared_v=shared_v), store_states=store_states,
                                    out_dtype=out_dtype, heads=2)
            text = traced.lower(lowering_platforms=("cuda",)).as_text()
            assert text.count("custom_call @mosaic_gpu") == 1 and "kda_scan_fwd_mosaic_gpu" in text
            assert max(smem_bytes) <= CTA_SMEM_BYTES, (store_states, out_dtype, max(smem_bytes))


def test_wrapper_does_not_transpose_o():
    """After the scan the forward only slices ``o``'s padding off (and reshapes ``S``)."""
    S = jax.ShapeDtypeStruct
    B, T, H, K, V = 2, 100, 3, 128, 128
    args = (S((B, T, H, K), BF), S((B, T, H, K), BF), S((B, T, H, V), BF), S((B, T, H, K), F32), S((B, T, H), F32))
    for shared_v in (False, True):
        eqns = jax.make_jaxpr(lambda *a: chunk_kda_pallas(*a, scale=0.1, shared_v=shared_v))(*args).jaxpr.eqns
        last_scan = max(i for i, e in enumerate(eqns) if e.primitive.name == "custom_vjp_call")
        assert [e.primitive.name for e in eqns[last_scan + 1:]] == ["slice", "reshape"]


def test_shared_v_needs_at_most_two_v_blocks():
    q, k, v, g, beta, _ = bf16_qkv_inputs(2, 1, 20, 1, 64, 128)
    with pytest.raises(ValueError, match="block_v"):
        chunk_kda_pallas(q, k, v, g, beta, scale=1.0, block_v=32, shared_v=True)
    with pytest.raises(ValueError, match="bv"):
        scan_fwd(*_operands(0, 1, 1, 64, 128), cfg=ScanConfig(bv=32, shared_v=True), store_states=False,
                 out_dtype=BF, heads=1)
