"""Mosaic GPU backward of the KDA intra-chunk prep == ``jax.vjp`` of the XLA prep (``kernel_gpu_intra``).

Runs in the CPU interpreter (default suite, tiny sizes) and compiled on the H200 (``-m gpu``);
the CUDA lowering (layouts, shared memory within the 227 KB limit) is checked on the CPU host.
"""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.kda import chunk_kda_reference
from pallas_kernels.kda.kernel_gpu import chunk_kda_pallas
from pallas_kernels.kda.kernel_gpu_intra import prepare_from_index
from pallas_kernels.kda.kernel_gpu_prep import CHUNK
from pallas_kernels.kda.kernel_gpu_prep_bwd import prep_bwd, prepare_bwd
from pallas_kernels.kda.reference import segment_index
from tests.pallas_kernels.kda.conftest import kda_inputs, segments_from_lengths
from tests.tolerances import BF16_GRAD_RTOL, rel_rmse

MODES = [
    pytest.param(True, id="interpret"),
    pytest.param(False, id="compiled", marks=pytest.mark.gpu),
]
GRADS = ("dq", "dk", "dv", "dg", "dbeta")


def _inputs(seed, B, T, H, K, V, lengths, gate_bound=False):
    q, k, v, g, beta, _ = kda_inputs(seed, B, T, H, K, V, dtype=jnp.float32, state=False)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    if gate_bound:  # every gate at the -5 bound: the anchored factors reach e^{±75}
        g = jnp.full_like(g, -5.0 + 1e-6)
    seg = None if lengths is None else jnp.stack([segments_from_lengths(lengths)] * B)
    return (q, k, v, g, beta), segment_index(seg, B, T), seg


@pytest.mark.parametrize("interpret", MODES)
@pytest.mark.parametrize(
    "B,T,H,K,V,lengths,gate_bound",
    [
        (1, 100, 2, 128, 128, (30, 1, 69), False),  # 2 chunks, documents mid-chunk, padded last chunk
        (2, 64, 1, 64, 128, None, False),  # K != V, one full chunk, several batches
        (1, 80, 1, 128, 64, (50, 30), True),  # K != V the other way, gates at the bound
    ],
)
def test_prep_bwd_matches_xla_vjp(interpret, B, T, H, K, V, lengths, gate_bound):
    args, sidx, _ = _inputs(7, B, T, H, K, V, lengths, gate_bound)
    scale = K**-0.5
    xla = lambda *a: prepare_from_index(*a, sidx, scale=scale, chunk=CHUNK, precision="highest")
    outs, vjp = jax.vjp(xla, *(x.astype(jnp.float32) for x in args))
    keys = jax.random.split(jax.random.PRNGKey(1), len(outs))
    cts = tuple(jax.random.normal(key, o.shape, jnp.float32) for key, o in zip(keys, outs))
    want = vjp(cts)
    got = jax.jit(lambda c, *a: prepare_bwd(*a, sidx, c, scale=scale, interpret=interpret))(cts, *args)
    for name, x, a, b in zip(GRADS, args, got, want):
        assert a.shape == b.shape and a.dtype == x.dtype, (name, a.shape, b.shape, a.dtype)
        err = rel_rmse(a.astype(jnp.float32), b)
        assert err <= BF16_GRAD_RTOL, f"{name}: rel RMSE {err:.3e}"


@pytest.mark.parametrize("interpret", MODES)
def test_chunk_kda_gradients_with_kernel_prep_bwd(interpret):
    """The whole op (prep kernels + scan kernels) against the fp32 chunked reference."""
    B, T, H, K, V = 1, 100, 1, 64, 128
    (q, k, v, g, beta), _, seg = _inputs(1, B, T, H, K, V, (40, 60))
    s0 = jax.random.normal(jax.random.PRNGKey(5), (B, H, K, V), jnp.float32)
    w_o, w_s = (jax.random.normal(jax.random.PRNGKey(i), s, jnp.float32) for i, s in ((6, v.shape), (7, s0.shape)))

    def grads(fn):
        def loss(*a):
            o, S = fn(*a)
            return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(S * w_s)
        return jax.jit(jax.grad(loss, argnums=tuple(range(6))))(q, k, v, g, beta, s0)

    ours = lambda *a: chunk_kda_pallas(*a[:5], scale=K**-0.5, initial_state=a[5], segment_ids=seg,
                                       interpret=interpret, prep="fused", prep_bwd="kernel")
    f32 = lambda x: x.astype(jnp.float32)
    ref = lambda q, k, v, g, beta, s0: chunk_kda_reference(f32(q), f32(k), f32(v), g, beta, initial_state=s0,
                                                           segment_ids=seg)
    for name, a, b in zip(GRADS[:3] + ("dg", "dbeta", "ds0"), grads(ours), grads(ref)):
        err = rel_rmse(a.astype(jnp.float32), b)
        assert err <= BF16_GRAD_RTOL, f"{name}: rel RMSE {err:.3e}"


def test_bad_prep_bwd_is_refused():
    (q, k, v, g, beta), _, _ = _inputs(2, 1, 20, 1, 64, 64, None)
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
    S, bf, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    B, T, H, K, V = 1, 200, 2, 128, 128

    def loss(*a):
        o, _ = chunk_kda_pallas(*a, scale=0.1, prep="fused", prep_bwd="kernel")
        return jnp.sum(o.astype(f32))

    args = (S((B, T, H, K), bf), S((B, T, H, K), bf), S((B, T, H, V), bf), S((B, T, H, K), f32), S((B, T, H), f32))
    text = jax.jit(jax.grad(loss, argnums=tuple(range(5)))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 4
    for name in ("kda_prep_fwd", "kda_prep_bwd", "kda_scan_fwd", "kda_scan_bwd"):
        assert f"{name}_mosaic_gpu" in text, name
