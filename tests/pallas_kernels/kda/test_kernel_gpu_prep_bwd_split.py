"""Two-kernel Mosaic GPU backward of the KDA prep (``prep_bwd="split"``) == ``jax.vjp`` of the XLA prep.

Runs in the CPU interpreter (default suite, tiny sizes) and compiled on the H200 (``-m gpu``);
the CUDA lowering (layouts, shared memory) is checked on the CPU host.
"""

import jax
import jax.numpy as jnp
import pytest

from k3jax.config import KDAConfig
from pallas_kernels.kda import chunk_kda, chunk_kda_reference
from pallas_kernels.kda.kernel_gpu import chunk_kda_pallas
from pallas_kernels.kda.kernel_gpu_intra import prepare_from_index
from pallas_kernels.kda.kernel_gpu_prep import CHUNK
from pallas_kernels.kda.kernel_gpu_prep_bwd_split import intra_bwd, prepare_bwd_split, wy_bwd
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
        (1, 100, 1, 128, 128, (30, 1, 69), False),  # 2 chunks, 2 slabs, documents mid-chunk, padded last chunk
        (2, 64, 2, 64, 128, None, False),  # K != V, one slab, one full chunk, several batches and heads
        (1, 80, 1, 128, 64, (50, 30), True),  # K != V the other way, gates at the bound
    ],
)
def test_split_prep_bwd_matches_xla_vjp(interpret, B, T, H, K, V, lengths, gate_bound):
    args, sidx, _ = _inputs(7, B, T, H, K, V, lengths, gate_bound)
    scale = K**-0.5
    xla = lambda *a: prepare_from_index(*a, sidx, scale=scale, chunk=CHUNK, precision="highest")
    outs, vjp = jax.vjp(xla, *(x.astype(jnp.float32) for x in args))
    keys = jax.random.split(jax.random.PRNGKey(1), len(outs))
    cts = tuple(jax.random.normal(key, o.shape, jnp.float32) for key, o in zip(keys, outs))
    want = vjp(cts)
    got = jax.jit(lambda c, *a: prepare_bwd_split(*a, sidx, c, scale=scale, interpret=interpret))(cts, *args)
    for name, x, a, b in zip(GRADS, args, got, want):
        assert a.shape == b.shape and a.dtype == x.dtype, (name, a.shape, b.shape, a.dtype)
        err = rel_rmse(a.astype(jnp.float32), b)
        assert err <= BF16_GRAD_RTOL, f"{name}: rel RMSE {err:.3e}"


@pytest.mark.parametrize("interpret", MODES)
def test_chunk_kda_gradients_with_split_prep_bwd(interpret):
    """The whole op through ``chunk_kda(gpu_prep_backward="split")`` against the fp32 chunked reference."""
    B, T, H, K, V = 1, 100, 1, 64, 64
    (q, k, v, g, beta), _, seg = _inputs(1, B, T, H, K, V, (40, 60))
    s0 = jax.random.normal(jax.random.PRNGKey(5), (B, H, K, V), jnp.float32)
    w_o, w_s = (jax.random.normal(jax.random.PRNGKey(i), s, jnp.float32) for i, s in ((6, v.shape), (7, s0.shape)))

    def grads(fn):
        def loss(*a):
            o, S = fn(*a)
            return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(S * w_s)
        return jax.jit(jax.grad(loss, argnums=tuple(range(6))))(q, k, v, g, beta, s0)

    ours = lambda *a: chunk_kda(*a[:5], initial_state=a[5], segment_ids=seg, output_final_state=True,
                                implementation="pallas", interpret="gpu" if interpret else False,
                                gpu_prep_backward="split")
    f32 = lambda x: x.astype(jnp.float32)
    ref = lambda q, k, v, g, beta, s0: chunk_kda_reference(f32(q), f32(k), f32(v), g, beta, initial_state=s0,
                                                           segment_ids=seg)
    for name, a, b in zip(GRADS + ("ds0",), grads(ours), grads(ref)):
        err = rel_rmse(a.astype(jnp.float32), b)
        assert err <= BF16_GRAD_RTOL, f"{name}: rel RMSE {err:.3e}"


def test_split_needs_the_fused_prep():
    assert KDAConfig(num_heads=1, head_dim=16, gpu_prep_backward="split").gpu_prep_backward == "split"
    (q, k, v, g, beta), _, _ = _inputs(2, 1, 20, 1, 64, 64, None)
    with pytest.raises(ValueError, match="prep_bwd"):
        chunk_kda_pallas(q, k, v, g, beta, scale=1.0, prep="xla", prep_bwd="split")


def _shapes(B, Tp, H, K, V):
    S, bf, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    C, BH = CHUNK, B * H
    tok = lambda d, dt: S((B, Tp, H, d), dt)
    common = dict(G=tok(K, f32), anchors=S((B, Tp // C * 8, H, K), f32), vecs=S((BH, 5, Tp), f32))
    return S, bf, f32, C, BH, tok, common


SM_SMEM_BYTES = 228 * 1024  # per H100/H200 SM, of which 1 KiB is reserved per CTA


@pytest.mark.parametrize("K,V", [(128, 128), (64, 128)])
def test_kernels_lower_for_cuda(K, V, monkeypatch):
    """Both kernels lower for CUDA on the CPU host: layouts resolve, and by Mosaic GPU's own
    shared-memory estimate two CTAs of each fit on one SM (the point of the split)."""
    from jax._src.pallas.mosaic_gpu import lowering

    smem_bytes = []
    estimate = lowering._estimate_resources

    def recording(*a, **kw):
        resources = estimate(*a, **kw)
        smem_bytes.append(resources.smem_scratch_bytes)
        return resources

    monkeypatch.setattr(lowering, "_estimate_resources", recording)
    B, Tp, H = 1, 128, 2
    S, bf, f32, C, BH, tok, common = _shapes(B, Tp, H, K, V)
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
    and bwd, the two prep backward kernels) and not to the one-kernel prep backward."""
    S, bf, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    B, T, H, K, V = 1, 200, 2, 128, 128

    def loss(*a):
        o, _ = chunk_kda_pallas(*a, scale=0.1, prep="fused", prep_bwd="split")
        return jnp.sum(o.astype(f32))

    args = (S((B, T, H, K), bf), S((B, T, H, K), bf), S((B, T, H, V), bf), S((B, T, H, K), f32), S((B, T, H), f32))
    text = jax.jit(jax.grad(loss, argnums=tuple(range(5)))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 5
    for name in ("kda_prep_fwd", "kda_prep_bwd_wy", "kda_prep_bwd_intra", "kda_scan_fwd", "kda_scan_bwd"):
        assert f"{name}_mosaic_gpu" in text, name
    assert "kda_prep_bwd_mosaic_gpu" not in text


def test_gradient_takes_the_split_kernels_only_when_asked():
    (q, k, v, g, beta), _, _ = _inputs(3, 1, 64, 1, 64, 64, None)
    for choice, expected in (("split", True), ("kernel", False), ("xla", False)):
        loss = lambda *a: jnp.sum(chunk_kda(*a, implementation="pallas", interpret="gpu",
                                            gpu_prep_backward=choice)[0].astype(jnp.float32))
        text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(q, k, v, g, beta))
        assert ("kda_prep_bwd_wy" in text and "kda_prep_bwd_intra" in text) == expected, choice
