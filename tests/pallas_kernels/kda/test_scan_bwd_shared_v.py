"""Backward scan kernel (``kernel_gpu_bwd.scan_bwd``) with ``shared_v``: one CTA per head, one
warpgroup per V block, the V sums of ``dW, dqg, dkg, dA_qk, dd`` taken in the kernel, against the
default one-CTA-per-V-block kernel (whose V partials XLA sums) and through the whole op's gradients.

Interpreter runs watch the lockstep pipeline and the cross-warpgroup smem reads with the CPU
interpreter's race detector; the shared kernel lowers for CUDA on the CPU host within one SM's smem.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.kda.kernel_gpu import CHUNK, ScanConfig, _scan
from pallas_kernels.kda.kernel_gpu_bwd import scan_bwd, shared_slotted
from pallas_kernels.kda.kernel_gpu_intra import prepare
from tests.pallas_kernels.kda.conftest import (
    assert_grads_match, bf16_qkv_inputs, fp32_reference, pallas_scan_op, run_race_watched,
)
from tests.pallas_kernels.kda.prep_bwd_cases import CTA_SMEM_BYTES, SHARED_MODES, record_smem
from tests.tolerances import BF16_GRAD_RTOL, F32_RTOL, rel_rmse

BF, F32 = jnp.bfloat16, jnp.float32
NAMES = ("dw", "du", "dqg", "dkg", "daqk", "dd", "ds0")


def _operands(seed, BH, n, K, V):
    """Backward operands as ``_scan_vjp_bwd`` hands them over: head-major bf16, fp32 decays and ``dS``."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 9)
    tok = lambda key, rows, cols, s: (s * jax.random.normal(key, (BH, rows, cols), F32)).astype(BF)
    w, qg, kg = (tok(ks[i], n * CHUNK, K, K**-0.5) for i in range(3))
    u, do = tok(ks[3], n * CHUNK, V, 1.0), tok(ks[7], n * CHUNK, V, 1.0)
    aqk = tok(ks[4], n * CHUNK, CHUNK, CHUNK**-0.5)
    d = jax.random.uniform(ks[5], (BH, n, K), F32, 0.5, 1.0)
    h = tok(ks[6], n * K, V, 1.0)
    return w, qg, kg, u, aqk, d, h, do, jax.random.normal(ks[8], (BH, K, V), F32)


def _run(monkeypatch, interpret, shared_v, operands):
    """The kernel traced afresh (no jit cache); ``shared_v`` with the interpreter's race detector on,
    asserting no race. (The default kernel is not watched: the detector flags its slot refills after
    the plain smem loads of ``h`` and ``d`` that end the previous chunk, with no sync event between.)"""
    fn = functools.partial(scan_bwd.__wrapped__, bv=64, interpret=interpret, shared_v=shared_v)
    return run_race_watched(monkeypatch, fn, operands, interpret and shared_v, f"shared_v={shared_v}")


@pytest.mark.parametrize("interpret", SHARED_MODES)
@pytest.mark.parametrize(
    "BH,n,K,V",
    [
        (2, 3, 128, 128),  # one-slot shared inputs: refilled after every warpgroup is done
        (3, 2, 64, 128),  # K != V: every input keeps two slots
        (1, 2, 128, 64),  # one V block: one warpgroup owns every product
    ],
)
def test_shared_v_equals_one_cta_per_block(monkeypatch, interpret, BH, n, K, V):
    ops = _operands(0, BH, n, K, V)
    split = _run(monkeypatch, interpret, False, ops)
    shared = _run(monkeypatch, interpret, True, ops)
    for name, a, b in zip(NAMES, split, shared):
        assert a.shape == b.shape and b.dtype == F32, name
        # Same products; only the V sum's order differs (one accumulator instead of XLA's add).
        assert rel_rmse(b, a) <= F32_RTOL, f"{name}: {rel_rmse(b, a):.3e}"


@pytest.mark.parametrize("interpret", SHARED_MODES)
@pytest.mark.parametrize("B,T,H,K,V", [(2, 100, 2, 128, 128), (3, 70, 1, 64, 128)])
def test_scan_vjp_shared_equals_default(interpret, B, T, H, K, V):
    """Through ``_scan``'s custom VJP (so ``ScanConfig.shared_v`` reaches the backward) on the prep's
    operands: T not a multiple of the chunk (zero padded rows), several batches and heads, all seven
    cotangents."""
    q, k, v, g, beta, s0 = bf16_qkv_inputs(2, B, T, H, K, V)
    ops = prepare(q, k, v, g, beta, scale=K**-0.5, segment_ids=None, chunk=CHUNK)
    s0 = s0.reshape(B * H, K, V)
    Tp = ops[0].shape[1]
    k_o, k_s = jax.random.split(jax.random.PRNGKey(3))
    do = jax.random.normal(k_o, (B, Tp, H, V), F32) * (jnp.arange(Tp) < T)[None, :, None, None]
    dS = jax.random.normal(k_s, s0.shape, F32)

    def cotangents(shared_v):
        cfg = ScanConfig(bv=64, interpret=interpret, shared_v=shared_v)
        _, pull = jax.vjp(lambda *a: _scan(*a, cfg, BF, H), *ops, s0)
        cts = (do.astype(BF), dS)
        assert ("kda_scan_bwd_shared" in str(jax.make_jaxpr(pull)(cts))) == shared_v  # the config reaches it
        return jax.jit(pull)(cts)

    default, shared = cotangents(False), cotangents(True)
    for name, a, b in zip(NAMES, default, shared):
        assert a.shape == b.shape and b.dtype == F32, name
        assert rel_rmse(b, a) <= F32_RTOL, f"{name}: {rel_rmse(b, a):.3e}"


def test_slots_chosen_by_smem_budget():
    assert not shared_slotted(CHUNK, 128, 128, 64) and shared_slotted(CHUNK, 64, 128, 64)
    assert shared_slotted(CHUNK, 128, 64, 64)








@pytest.mark.parametrize("interpret", SHARED_MODES)
@pytest.mark.parametrize("B,T,H,K,V", [(1, 130, 2, 128, 128), (2, 70, 1, 64, 128)])
def test_gradients_match_reference(interpret, B, T, H, K, V):
    """T not a multiple of the chunk; the shared forward stores the states the shared backward reads."""
    assert_grads_match(pallas_scan_op(interpret, True), fp32_reference, bf16_qkv_inputs(1, B, T, H, K, V), BF16_GRAD_RTOL)


@pytest.mark.parametrize("K,V", [(128, 128), (64, 128), (128, 64)])
def test_scan_bwd_shared_lowers_for_cuda(K, V, monkeypatch):
    """One Mosaic GPU kernel, no V-partial outputs (so no XLA sum after it), within one CTA's smem."""
    smem_bytes = record_smem(monkeypatch)
    S = jax.ShapeDtypeStruct
    BH, n, C = 4, 2, CHUNK
    args = (*[S((BH, n * C, K), BF)] * 3, S((BH, n * C, V), BF), S((BH, n * C, C), BF), S((BH, n, K), F32),
            S((BH, n * K, V), BF), S((BH, n * C, V), BF), S((BH, K, V), F32))
    traced = scan_bwd.trace(*args, bv=64, interpret=False, shared_v=True)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1 and "kda_scan_bwd_shared_mosaic_gpu" in text
    jaxpr = jax.make_jaxpr(functools.partial(scan_bwd.__wrapped__, bv=64, interpret=False, shared_v=True))(*args)
    assert len(jaxpr.jaxpr.eqns) == 1, "the V partials should be summed in the kernel, not after it"
    assert max(smem_bytes) <= CTA_SMEM_BYTES, max(smem_bytes)
    outs = jax.eval_shape(functools.partial(scan_bwd, bv=64, interpret=False, shared_v=True), *args)
    assert [o.shape for o in outs] == [(BH, n * C, K), (BH, n * C, V), (BH, n * C, K), (BH, n * C, K),
                                       (BH, n * C, C), (BH, n, K), (BH, K, V)]


def test_shared_v_needs_at_most_two_v_blocks():
    with pytest.raises(ValueError, match="bv"):
        scan_bwd(*_operands(0, 1, 1, 64, 128), bv=32, interpret=True, shared_v=True)


@pytest.mark.parametrize("interpret", SHARED_MODES)
def test_bf16_dw_du_are_the_rounded_fp32_ones(interpret):
    """``wu_dtype=bf16`` (W, U entered the scan in bf16): the shared kernel stores dW, dU rounded
    from the same fp32 values it stores otherwise, bit for bit; the other gradients are unchanged."""
    ops = _operands(1, 2, 2, 128, 128)
    run = lambda dt: jax.jit(functools.partial(scan_bwd, bv=64, interpret=interpret, shared_v=True, wu_dtype=dt))(*ops)
    wide, narrow = run(F32), run(BF)
    for name, a, b in zip(NAMES, wide, narrow):
        want = a.astype(BF) if name in ("dw", "du") else a
        assert b.dtype == want.dtype and jnp.array_equal(b, want), name


@pytest.mark.parametrize("interpret", SHARED_MODES)
@pytest.mark.parametrize("shared_v", [True, False])
def test_token_major_do_equals_head_major(interpret, shared_v):
    """``do`` token-major ``[B,Tp,H,V]`` (read in place by the shared kernel's TMA, transposed for the
    other) gives the same gradients, bit for bit, as the head-major copy."""
    B, H = 2, 2
    ops = _operands(2, B * H, 2, 128, 128)
    do = ops[7]
    token_major = jnp.swapaxes(do.reshape(B, H, *do.shape[1:]), 1, 2)  # [B, Tp, H, V]
    run = lambda d: jax.jit(functools.partial(scan_bwd, bv=64, interpret=interpret, shared_v=shared_v))(
        *ops[:7], d, ops[8])
    for name, a, b in zip(NAMES, run(do), run(token_major)):
        assert jnp.array_equal(a, b), name
