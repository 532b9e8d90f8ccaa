"""Hopper KDA kernel (Mosaic GPU) == fp32 chunked reference: o, final state and every gradient.

Each case runs in the CPU interpreter (default suite, tiny sizes) and compiled on the H200
(``-m gpu``). Inputs are bf16 q/k/v with fp32 gates; the reference gets the same values in fp32.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import chunk_kda, chunk_kda_reference
from pallas_kernels.kda.kernel_gpu import chunk_kda_pallas, supports
from tests.pallas_kernels.kda.conftest import kda_inputs, segments_from_lengths
from tests.tolerances import BF16_FWD_RTOL, BF16_GRAD_RTOL, rel_rmse

ARG_NAMES = ("q", "k", "v", "g", "beta", "initial_state")
MODES = [
    pytest.param(True, id="interpret"),
    pytest.param(False, id="compiled", marks=pytest.mark.gpu),
]


def _inputs(seed, B, T, H, K, V, lengths, state=True):
    q, k, v, g, beta, s0 = kda_inputs(seed, B, T, H, K, V, dtype=jnp.float32, state=state)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    seg = None if lengths is None else jnp.stack([segments_from_lengths(lengths)] * B)
    return (q, k, v, g, beta, s0), seg


def _ours(interpret, seg, block_v=None, prep="xla", precision="highest"):
    def fn(q, k, v, g, beta, s0):
        scale = q.shape[-1] ** -0.5
        return chunk_kda_pallas(q, k, v, g, beta, scale=scale, initial_state=s0, segment_ids=seg,
                                interpret=interpret, block_v=block_v, prep=prep, prep_precision=precision)
    return fn


def _reference(seg):
    def fn(q, k, v, g, beta, s0):
        f32 = lambda x: x.astype(jnp.float32)
        return chunk_kda_reference(f32(q), f32(k), f32(v), g, beta, initial_state=s0, segment_ids=seg)
    return fn


def _grads(fn, args, seed=3):
    """Gradients of a random linear functional of (o, final state) w.r.t. all six inputs."""
    ko, ks = jax.random.split(jax.random.PRNGKey(seed))
    w_o = jax.random.normal(ko, args[2].shape, jnp.float32)
    w_s = jax.random.normal(ks, args[5].shape, jnp.float32)

    def loss(*a):
        o, S = fn(*a)
        return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(S * w_s)

    return jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*args)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize(
    "B,T,H,K,V,lengths,state",
    [
        (1, 37, 2, 128, 128, None, False),  # T < chunk, odd T, no initial state
        (2, 150, 1, 64, 128, (5, 80, 1, 64), True),  # 3 chunks, documents mid-chunk, K != V
    ],
)
def test_forward_matches_reference(interpret, B, T, H, K, V, lengths, state):
    """Through the public op, so the dispatch to this kernel is covered too."""
    args, seg = _inputs(0, B, T, H, K, V, lengths, state)
    q, k, v, g, beta, s0 = args

    @jax.jit
    def ours(q, k, v, g, beta, s0):
        return chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True, segment_ids=seg,
                         implementation="pallas", interpret="gpu" if interpret else False)

    o, S = ours(*args)
    o_r, S_r = jax.jit(_reference(seg))(*args)
    assert o.dtype == jnp.bfloat16 and o.shape == (B, T, H, V)
    assert S.dtype == jnp.float32 and S.shape == (B, H, K, V)
    assert rel_rmse(o, o_r) <= BF16_FWD_RTOL, rel_rmse(o, o_r)
    assert rel_rmse(S, S_r) <= BF16_FWD_RTOL, rel_rmse(S, S_r)


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize(
    "B,T,H,K,V,lengths,block_v,prep,precision",
    [
        (1, 90, 1, 64, 64, (30, 1, 59), 32, "xla", "highest"),  # documents + initial state, odd T
        (1, 70, 1, 128, 128, None, 64, "fused", "highest"),  # the Mosaic GPU intra-chunk kernel
        # TF32 prep matmuls (fp32 on the CPU interpreter; the compiled run is the real check)
        (1, 130, 1, 128, 128, (70, 60), 64, "xla", "tf32"),
    ],
)
def test_gradients_match_reference(interpret, B, T, H, K, V, lengths, block_v, prep, precision):
    args, seg = _inputs(1, B, T, H, K, V, lengths)
    got = _grads(_ours(interpret, seg, block_v, prep, precision), args)
    want = _grads(_reference(seg), args)
    for name, a, b in zip(ARG_NAMES, got, want):
        assert a.shape == b.shape, name
        err = rel_rmse(a, b)
        assert err <= BF16_GRAD_RTOL, f"d{name}: rel RMSE {err:.3e}"


@pytest.mark.parametrize("interpret", MODES)
def test_shared_v_with_documents_and_state_matches_reference(interpret):
    """The GPU default at many heads (shared-V scans, fused prep, split prep backward) on packed
    documents mid-chunk with an initial state: o, final state and every gradient."""
    args, seg = _inputs(6, 2, 150, 1, 128, 128, (5, 80, 1, 64))

    def ours(q, k, v, g, beta, s0):
        return chunk_kda_pallas(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=s0, segment_ids=seg,
                                interpret=interpret, prep="fused", prep_bwd="split", shared_v=True)

    (o, S), (o_r, S_r) = jax.jit(ours)(*args), jax.jit(_reference(seg))(*args)
    assert rel_rmse(o, o_r) <= BF16_FWD_RTOL and rel_rmse(S, S_r) <= BF16_FWD_RTOL
    for name, a, b in zip(ARG_NAMES, _grads(ours, args), _grads(_reference(seg), args)):
        assert rel_rmse(a, b) <= BF16_GRAD_RTOL, f"d{name}: rel RMSE {rel_rmse(a, b):.3e}"


@pytest.mark.parametrize("interpret", MODES)
def test_fused_prep_forward_with_documents(interpret):
    """The Mosaic GPU intra-chunk kernel: documents mid-chunk, K != V, initial state."""
    args, seg = _inputs(5, 2, 150, 1, 64, 128, (5, 80, 1, 64))
    o, S = jax.jit(_ours(interpret, seg, prep="fused"))(*args)
    o_r, S_r = jax.jit(_reference(seg))(*args)
    assert rel_rmse(o, o_r) <= BF16_FWD_RTOL, rel_rmse(o, o_r)
    assert rel_rmse(S, S_r) <= BF16_FWD_RTOL, rel_rmse(S, S_r)


def test_unsupported_inputs_are_refused():
    args, _ = _inputs(2, 1, 20, 1, 64, 64, None)
    q, k, v, g, beta, s0 = args
    assert supports(q, k, v, g, beta)
    assert not supports(q, k, v[..., :48], g, beta)
    assert not supports(q, k, v[..., :32], g, beta)
    assert not supports(q, k, v, g, beta, chunk_size=32)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda_pallas(q, k, v, g, beta, scale=1.0, chunk_size=32)
    with pytest.raises(ValueError, match="prep"):
        chunk_kda_pallas(q, k, v, g, beta, scale=1.0, prep="triton")
    with pytest.raises(ValueError, match="precision"):
        chunk_kda_pallas(q, k, v, g, beta, scale=1.0, prep_precision="bf16")


@pytest.mark.gpu
def test_long_sequence_at_gate_bound_is_finite():
    """T = 262144 with every gate at the -5 bound: no overflow in the anchored factors."""
    B, T, H, K, V = 1, 262144, 1, 128, 128
    args, _ = _inputs(4, B, T, H, K, V, None)
    q, k, v, _, beta, s0 = args
    g = jnp.full((B, T, H, K), -5.0 + 1e-6, jnp.float32)
    got = _grads(_ours(False, None), (q, k, v, g, beta, s0))
    o, S = jax.jit(_ours(False, None))(q, k, v, g, beta, s0)
    for x in (o, S, *got):
        assert bool(jnp.all(jnp.isfinite(x.astype(jnp.float32))))
    # Mild gates over the same length: long memory must still match the reference.
    g = jnp.full((B, T, H, K), -1e-3, jnp.float32)
    o, S = jax.jit(_ours(False, None))(q, k, v, g, beta, s0)
    o_r, S_r = jax.jit(_reference(None))(q, k, v, g, beta, s0)
    assert rel_rmse(o, o_r) <= BF16_FWD_RTOL and rel_rmse(S, S_r) <= BF16_FWD_RTOL
    assert np.isfinite(rel_rmse(o, o_r))


def test_shared_v_default_follows_heads():
    """``shared_v=None``: shared scans only when compiled, V = 128 and B·H is large; explicit values win."""
    from pallas_kernels.kda.kernel_gpu import SHARED_V_MIN_HEADS, _resolve_shared_v

    many, few = SHARED_V_MIN_HEADS, SHARED_V_MIN_HEADS - 1
    assert _resolve_shared_v(None, 128, many, interpret=False)
    assert not _resolve_shared_v(None, 128, few, interpret=False)
    assert not _resolve_shared_v(None, 64, many, interpret=False)
    assert not _resolve_shared_v(None, 128, many, interpret=True)
    assert _resolve_shared_v(True, 128, 1, interpret=True) and not _resolve_shared_v(False, 128, many, False)
