"""Shared inputs and checks of the GPU prep-backward tests (the split backward, the scan layouts).

Each backward must equal ``jax.vjp`` of the fp32 XLA prep (``kernel_gpu_intra``) on the same cases,
and the whole op built on it must match the fp32 chunked reference's gradients.
"""

import os

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.kda import chunk_kda_reference
from pallas_kernels.kda.kernel_gpu import chunk_kda_pallas
from pallas_kernels.kda.kernel_gpu_intra import prepare_from_index
from pallas_kernels.kda.kernel_gpu_prep import CHUNK
from pallas_kernels.kda.reference import segment_index
from tests.pallas_kernels.kda.conftest import kda_inputs, segments_from_lengths
from tests.tolerances import BF16_GRAD_RTOL, rel_rmse

MODES = [
    pytest.param(True, id="interpret"),
    pytest.param(False, id="compiled", marks=pytest.mark.gpu),
]


def xla_cpu_threads() -> int:
    """Threads of XLA:CPU's intra-op pool, as the CPU client sizes it: PJRT_NPROC, else NPROC, else
    the CPUs this process may run on."""
    for name in ("PJRT_NPROC", "NPROC"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# shared_v kernels run one interpreter thread per warpgroup, whose barrier waits block XLA:CPU
# intra-op pool threads (tests/conftest.py): with the kernel's own callback and one free thread
# that takes 2 + 1 + 1. A smaller pool can deadlock, so there their interpret runs are opt-in.
SHARED_INTERPRET_MARKS = () if xla_cpu_threads() >= 4 else (pytest.mark.slow,)
SHARED_MODES = [
    pytest.param(True, id="interpret", marks=SHARED_INTERPRET_MARKS),
    pytest.param(False, id="compiled", marks=pytest.mark.gpu),
]
GRADS = ("dq", "dk", "dv", "dg", "dbeta")
# (B, T, H, K, V, document lengths, gates at the bound)
CASES = [
    (1, 100, 1, 128, 128, (30, 1, 69), False),  # 2 chunks, 2 slabs, documents mid-chunk, padded last chunk
    (2, 64, 2, 64, 128, None, False),  # K != V, one slab, one full chunk, several batches and heads
    (1, 80, 1, 128, 64, (50, 30), True),  # K != V the other way, gates at the bound
]


def prep_inputs(seed, B, T, H, K, V, lengths, gate_bound=False):
    """``((q, k, v, g, beta), document index, segment ids)`` with bf16 q/k/v."""
    q, k, v, g, beta, _ = kda_inputs(seed, B, T, H, K, V, dtype=jnp.float32, state=False)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    if gate_bound:  # every gate at the -5 bound: the anchored factors reach e^{±75}
        g = jnp.full_like(g, -5.0 + 1e-6)
    seg = None if lengths is None else jnp.stack([segments_from_lengths(lengths)] * B)
    return (q, k, v, g, beta), segment_index(seg, B, T), seg


def cotangents(outs):
    keys = jax.random.split(jax.random.PRNGKey(1), len(outs))
    return tuple(jax.random.normal(key, o.shape, jnp.float32) for key, o in zip(keys, outs))


def xla_prep_vjp(args, sidx, scale):
    """``(outputs, cotangents, input gradients)`` of the fp32 XLA prep."""
    xla = lambda *a: prepare_from_index(*a, sidx, scale=scale, chunk=CHUNK, precision="highest")
    outs, vjp = jax.vjp(xla, *(x.astype(jnp.float32) for x in args))
    cts = cotangents(outs)
    return outs, cts, vjp(cts)


def assert_grads_close(args, got, want):
    """Each gradient has its input's shape and dtype and is within the bf16 gradient tolerance."""
    for name, x, a, b in zip(GRADS, args, got, want):
        assert a.shape == b.shape and a.dtype == x.dtype, (name, a.shape, b.shape, a.dtype)
        err = rel_rmse(a.astype(jnp.float32), b)
        assert err <= BF16_GRAD_RTOL, f"{name}: rel RMSE {err:.3e}"


def assert_whole_op_grads(ours, K, V):
    """``ours(q, k, v, g, beta, s0, segment_ids) -> (o, S)`` against the fp32 chunked reference:
    every gradient (inputs and initial state), one row of two documents, 2 chunks."""
    B, T, H = 1, 100, 1
    (q, k, v, g, beta), _, seg = prep_inputs(1, B, T, H, K, V, (40, 60))
    s0 = jax.random.normal(jax.random.PRNGKey(5), (B, H, K, V), jnp.float32)
    w_o, w_s = (jax.random.normal(jax.random.PRNGKey(i), s, jnp.float32) for i, s in ((6, v.shape), (7, s0.shape)))

    def grads(fn):
        def loss(*a):
            o, S = fn(*a, seg)
            return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(S * w_s)
        return jax.jit(jax.grad(loss, argnums=tuple(range(6))))(q, k, v, g, beta, s0)

    f32 = lambda x: x.astype(jnp.float32)
    ref = lambda q, k, v, g, beta, s0, seg: chunk_kda_reference(f32(q), f32(k), f32(v), g, beta, initial_state=s0,
                                                                segment_ids=seg)
    for name, a, b in zip(GRADS + ("ds0",), grads(ours), grads(ref)):
        err = rel_rmse(a.astype(jnp.float32), b)
        assert err <= BF16_GRAD_RTOL, f"{name}: rel RMSE {err:.3e}"


def cuda_gradient_text(prep_bwd: str) -> str:
    """StableHLO of the differentiated op at K = V = 128 (the largest shared memory), lowered for
    CUDA on this host with the fused prep forward and the given prep backward."""
    S, bf, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    B, T, H, K, V = 1, 200, 2, 128, 128

    def loss(*a):
        o, _ = chunk_kda_pallas(*a, scale=0.1, prep="fused", prep_bwd=prep_bwd)
        return jnp.sum(o.astype(f32))

    args = (S((B, T, H, K), bf), S((B, T, H, K), bf), S((B, T, H, V), bf), S((B, T, H, K), f32), S((B, T, H), f32))
    return jax.jit(jax.grad(loss, argnums=tuple(range(5)))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def kernel_shapes(B, Tp, H, K, V):
    """Abstract operands of the prep backward kernels: ``(S, bf16, f32, C, B·H, tok(d, dtype), common)``."""
    S, bf, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float32
    C, BH = CHUNK, B * H
    tok = lambda d, dt: S((B, Tp, H, d), dt)
    common = dict(G=tok(K, f32), anchors=S((B, Tp // C * 8, H, K), f32), vecs=S((BH, 5, Tp), f32))
    return S, bf, f32, C, BH, tok, common


SM_SMEM_BYTES = 228 * 1024  # per H100/H200 SM, of which 1 KiB is reserved per CTA
CTA_SMEM_BYTES = 227 * 1024  # the most dynamic shared memory one CTA may take on an H100/H200


def record_smem(monkeypatch):
    """A list that collects Mosaic GPU's shared-memory estimate (bytes) of every kernel lowered after this."""
    from jax._src.pallas.mosaic_gpu import lowering

    smem_bytes = []
    estimate = lowering._estimate_resources

    def recording(*a, **kw):
        resources = estimate(*a, **kw)
        smem_bytes.append(resources.smem_scratch_bytes)
        return resources

    monkeypatch.setattr(lowering, "_estimate_resources", recording)
    return smem_bytes
