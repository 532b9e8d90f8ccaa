"""Shared KDA test inputs: L2-normalised q/k, K3's bounded gate g = -5*sigmoid(.), beta = sigmoid(.)."""

import jax
import jax.numpy as jnp
import pytest


@pytest.fixture
def x64():
    """float64 end to end for exactness tests (chunked == recurrent to rounding)."""
    with jax.enable_x64(True):
        yield


def l2norm(x):
    return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))


def kda_inputs(seed, B, T, H, K, V, dtype=jnp.float64, gate_shift=-2.0, state=True):
    """``(q, k, v, g, beta, s0)``; ``gate_shift`` < 0 keeps decays mild so long memory is exercised
    while the spread (std 2) still reaches the -5 bound."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    f = jnp.float64 if dtype == jnp.float64 else jnp.float32
    q = l2norm(jax.random.normal(ks[0], (B, T, H, K), f)).astype(dtype)
    k = l2norm(jax.random.normal(ks[1], (B, T, H, K), f)).astype(dtype)
    v = jax.random.normal(ks[2], (B, T, H, V), f).astype(dtype)
    g = -5.0 * jax.nn.sigmoid(gate_shift + 2.0 * jax.random.normal(ks[3], (B, T, H, K), f))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H), f))
    s0 = jax.random.normal(ks[5], (B, H, K, V), f) if state else None
    return q, k, v, g, beta, s0


def segments_from_lengths(lengths, ids=None):
    """One row of segment ids from document lengths (ids default 0, 1, 2, ...)."""
    ids = range(len(lengths)) if ids is None else ids
    return jnp.concatenate([jnp.full((n,), i, jnp.int32) for i, n in zip(ids, lengths)])


def assert_grads_match(ours, reference, args, tol):
    """Gradients of ``Σ o·w_o + Σ S·w_s`` (random weights) w.r.t. ``(q, k, v, g, beta, s0)``:
    ``ours`` against ``reference`` (both ``fn(*args) -> (o, S)``), rel. RMSE <= ``tol`` each."""
    from tests.tolerances import rel_rmse

    f32 = jnp.float32
    w_o, w_s = (jax.random.normal(jax.random.PRNGKey(i), s, f32) for i, s in ((6, args[2].shape), (7, args[5].shape)))

    def grads(fn):
        def loss(*a):
            o, S = fn(*a)
            return jnp.sum(o.astype(f32) * w_o) + jnp.sum(S * w_s)
        return jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*args)

    for name, a, b in zip(("q", "k", "v", "g", "beta", "s0"), grads(ours), grads(reference)):
        err = rel_rmse(a.astype(f32), b)
        assert err <= tol, f"d{name}: rel RMSE {err:.3e}"


def bf16_qkv_inputs(seed, B, T, H, K, V):
    """``kda_inputs`` with bf16 q, k, v (fp32 g, beta, s0): the kernels' operand dtypes."""
    q, k, v, g, beta, s0 = kda_inputs(seed, B, T, H, K, V, dtype=jnp.float32)
    return (*(x.astype(jnp.bfloat16) for x in (q, k, v)), g, beta, s0)


def pallas_scan_op(interpret, shared_v):
    """``chunk_kda_pallas`` with the fp32 XLA prep, so what differs from the reference is the scans."""
    from pallas_kernels.kda.kernel_gpu import chunk_kda_pallas

    def fn(q, k, v, g, beta, s0):
        return chunk_kda_pallas(q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=s0, interpret=interpret,
                                prep="xla", prep_precision="highest", shared_v=shared_v)
    return fn


def fp32_reference(q, k, v, g, beta, s0):
    """The chunked reference on fp32 copies of the inputs."""
    from pallas_kernels.kda import chunk_kda_reference

    f = lambda x: x.astype(jnp.float32)
    return chunk_kda_reference(f(q), f(k), f(v), g, beta, initial_state=s0)


def run_race_watched(monkeypatch, fn, operands, watch: bool, label: str):
    """``jax.jit(fn)(*operands)`` traced afresh; with ``watch``, under the Mosaic GPU interpreter's
    race detector, asserting it found no race (``label`` names the case)."""
    import functools

    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if watch:
        monkeypatch.setattr(plgpu, "InterpretGPUParams", functools.partial(plgpu.InterpretGPUParams, detect_races=True))
    outs = jax.block_until_ready(jax.jit(fn)(*operands))
    if watch:
        assert not gpu_callbacks.get_races().races_found, f"race in {label}"
    return outs
