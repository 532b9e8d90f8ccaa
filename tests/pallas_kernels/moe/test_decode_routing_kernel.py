"""The decode kernels that route each token themselves (``pallas_kernels/moe/rank_routing.py``): the
gather kernel (``kernel_gpu_decode.routed_experts_pallas``) and the dense path's combine
(``kernel_gpu_decode_dense.routed_combine``) against ``k3jax.layers.routing.route`` followed by the
kernels given the ids, interpreted on CPU and compiled on the GPU; where ``moe_decode.routed_experts``
and the MoE layer take them; their errors.

The routing is exact: the gather kernel's expert blocks equal, bit for bit, those of the kernel given
``route``'s ids (same experts in the same slots, ties included), and its weights differ from
``route``'s only by the order of the fp32 sum of the k chosen scores.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from k3jax import config
from k3jax.layers import moe as moe_module
from k3jax.layers import moe_decode
from k3jax.layers.moe import MoE
from k3jax.layers.routing import RENORM_EPS, route
from pallas_kernels.moe.kernel_gpu_decode import expert_blocks, routed_experts_pallas
from pallas_kernels.moe.kernel_gpu_decode_dense import (DenseTiles, expert_outputs, routed_combine,
                                                       routed_dense_experts_pallas)
from pallas_kernels.moe.rank_routing import Routing
from pallas_kernels.target import Target, compile_for
from tests.pallas_kernels.moe.test_decode_kernel import _assert_within_ulps, _rounded_reference

H200 = Target("gpu", "NVIDIA H200", cuda=True)
WEIGHT_RTOL = 1e-6  # a few fp32 ulps: the k chosen scores summed in another order


def _inputs(seed, T, k, E, L, F, ties=True):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(T, L)), jnp.bfloat16)
    scores = rng.uniform(0.0, 1.0, size=(T, E)).astype(np.float32)
    bias = (rng.normal(size=E) * 0.05).astype(np.float32)
    if ties:  # equal keys across the k-th place (the lower index goes first) and among the chosen
        order = np.argsort(-(scores[0] + bias), kind="stable")
        for a, b in ((order[k - 1], order[k]), (order[0], order[1])):
            scores[0, max(a, b)], bias[max(a, b)] = scores[0, min(a, b)], bias[min(a, b)]
    ws = [jnp.asarray(rng.normal(size=s) * L ** -0.5, jnp.bfloat16) for s in ((E, L, F), (E, L, F), (E, F, L))]
    return x, jnp.asarray(scores), jnp.asarray(bias), ws


@pytest.mark.parametrize("T,k,E,L,F,renormalize,scaling", [
    (1, 8, 64, 128, 64, True, 1.0),     # small()'s routing at batch 1
    (3, 2, 16, 64, 32, False, 2.5),     # three tokens, unnormalised weights scaled
    (2, 8, 128, 64, 32, True, 1.0),     # four blocks of RANK_PAIRS / E = 32 experts
    (1, 8, 256, 64, 32, True, 2.827),   # 256 experts (Kimi-Linear's count), 16 blocks of 16
])
def test_interpreted_gather_routing_matches_route(T, k, E, L, F, renormalize, scaling):
    x, scores, bias, ws = _inputs(E + T, T, k, E, L, F)
    ids, weights = route(scores, bias, k, renormalize=renormalize, scaling=scaling, with_stats=False)
    routing = Routing(k, renormalize, scaling, RENORM_EPS)
    parts, got_weights = expert_blocks(x, (scores, bias), *ws, activation="situ", routing=routing, interpret=True)
    given = expert_blocks(x, ids, *ws, activation="situ", interpret=True)
    np.testing.assert_array_equal(np.asarray(parts), np.asarray(given))  # same experts, same slots
    np.testing.assert_allclose(np.asarray(got_weights), np.asarray(weights), rtol=WEIGHT_RTOL, atol=0)
    got = routed_experts_pallas(x, scores, bias, *ws, routing=routing, activation="situ", interpret=True)
    assert got.shape == x.shape and got.dtype == x.dtype
    _assert_within_ulps(got, _rounded_reference(x, ids, weights, ws, "situ"), max_fraction=0.02)


def _picked_sum(y, ids, weights) -> np.ndarray:
    """Each token's k rows of ``y [E, T, L]`` weighted and summed in fp64 (the combine's definition),
    rounded to bf16 (as float32)."""
    y, ids, w = np.asarray(y, np.float64), np.asarray(ids), np.asarray(weights, np.float64)
    out = np.stack([np.einsum("kL,k->L", y[ids[t], t], w[t]) for t in range(y.shape[1])])
    return out.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.mark.parametrize("T,k,E,L,renormalize,scaling", [
    (16, 8, 64, 128, True, 1.0),   # small()'s routing, 16 tokens (the dense path's smallest batch)
    (5, 2, 16, 64, False, 2.5),    # unnormalised weights scaled
    (3, 8, 256, 64, True, 1.0),    # 256 experts
])
def test_interpreted_dense_combine_matches_route(T, k, E, L, renormalize, scaling):
    """The combine picks ``route``'s experts with its weights: within an fp32 rounding of the exact
    weighted sum, then rounded to bf16 as the reference's fusion rounds it."""
    x, scores, bias, _ = _inputs(E + T, T, k, E, 16, 16)
    y = jnp.asarray(np.random.default_rng(T).normal(size=(E, T, L)), jnp.bfloat16)
    ids, weights = route(scores, bias, k, renormalize=renormalize, scaling=scaling, with_stats=False)
    routing = Routing(k, renormalize, scaling, RENORM_EPS)
    got = routed_combine(y, scores, bias, routing=routing, interpret=True)
    assert got.shape == (T, L) and got.dtype == y.dtype
    _assert_within_ulps(got, _picked_sum(y, ids, weights), max_fraction=0.02)
    moved = jnp.roll(scores, 1, axis=1)  # another routing: not what the kernel was given
    assert not np.array_equal(np.asarray(routed_combine(y, moved, bias, routing=routing, interpret=True)),
                              np.asarray(got))


def _normed_combine_case(L, block_n, T=16, k=8, E=64, interpret=True):
    """``routed_combine`` with ``norm_scale`` against the latent MoE's ``RMSNorm`` of the exact pick (``rms_norm``
    of the bf16 sum in fp32, times the scale, rounded), over the row's column blocks."""
    _, scores, bias, _ = _inputs(7, T, k, E, 16, 16)
    rng = np.random.default_rng(L)
    y = jnp.asarray(rng.normal(size=(E, T, L)), jnp.bfloat16)
    scale = jnp.asarray(rng.uniform(0.5, 1.5, size=L), jnp.float32)
    ids, weights = route(scores, bias, k, renormalize=True, scaling=1.0, with_stats=False)
    got = routed_combine(y, scores, bias, routing=Routing(k), norm_scale=scale, norm_eps=1e-5,
                         tiles=DenseTiles(block_n=block_n), interpret=interpret)
    assert got.shape == (T, L) and got.dtype == y.dtype
    h = _picked_sum(y, ids, weights)
    want = h / np.sqrt(np.mean(h * h, axis=1, keepdims=True) + 1e-5) * np.asarray(scale)
    _assert_within_ulps(got, want.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32),
                        max_fraction=0.03)


@pytest.mark.parametrize("L,block_n", [(128, 128), (192, 64)])  # one column block; three
def test_interpreted_dense_combine_norms(L, block_n):
    _normed_combine_case(L, block_n)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [16, 64])
def test_compiled_dense_combine_norms(T):
    _normed_combine_case(512, 128, T=T, interpret=False)  # small()'s latent at batches 16 and 64


def test_interpreted_dense_routing_matches_route():
    """The dense path end to end (16 tokens, small()'s 64 experts of 64 × 64): the two kernels and the
    combine against ``route`` then the kernels given the ids."""
    T, k, E, L, F = 16, 8, 64, 64, 64
    x, scores, bias, ws = _inputs(3, T, k, E, L, F)
    ids, weights = route(scores, bias, k, renormalize=True, scaling=1.0, with_stats=False)
    got = routed_dense_experts_pallas(x, scores, bias, *ws, routing=Routing(k), activation="situ", interpret=True)
    y = expert_outputs(x, *ws, activation="situ", interpret=True)
    _assert_within_ulps(got, _picked_sum(y, ids, weights), max_fraction=0.02)
    _assert_within_ulps(got, _rounded_reference(x, ids, weights, ws, "situ"))


def _kernels(fn, *args) -> str:
    # a fresh function per trace: a traced function's jaxpr is cached regardless of the target
    return str(jax.make_jaxpr(lambda *a: fn(*a))(*args))


@pytest.mark.parametrize("path,T,routed,given", [
    ("gather", 1, "moe_decode_route_gather", "moe_decode_gather"),
    ("dense", 16, "moe_decode_dense_combine", "moe_decode_dense_down"),
])
def test_routed_experts_picks_the_routing_kernels(path, T, routed, given):
    """None: the routing kernels on a CUDA target where they take the inputs; for 96 experts (no power of
    two) XLA routes and the kernels take the ids; on a CPU target XLA throughout, equal to the
    kernels' values; ``implementation="pallas"`` with ``interpret`` runs them anywhere."""
    kw = dict(path=path, top_k=4, renormalize=True, scaling=1.0, activation="situ")
    call = lambda *a: moe_decode.routed_experts(*a, **kw)
    fits, wide = _inputs(0, T, 4, 32, 64, 64), _inputs(0, T, 4, 96, 64, 64)
    with compile_for(H200):
        assert routed in _kernels(call, *fits[:3], *fits[3])
        jaxpr = _kernels(call, *wide[:3], *wide[3])
        assert given in jaxpr and routed not in jaxpr
    with compile_for("cpu"):
        assert "pallas_call" not in _kernels(call, *fits[:3], *fits[3])
    xla = call(*fits[:3], *fits[3])
    kernel = moe_decode.routed_experts(*fits[:3], *fits[3], **kw, implementation="pallas", interpret=True)
    _assert_within_ulps(kernel, xla)
    with pytest.raises(ValueError, match="path must be 'gather' or 'dense', got 'grouped'"):
        moe_decode.routed_experts(*fits[:3], *fits[3], **dict(kw, path="grouped"))


@pytest.mark.parametrize("path", ["gather", "dense"])
def test_moe_layer_routes_in_the_kernels_at_decode(path):
    """The MoE layer's decode call takes the path's routing kernel on a CUDA target, and not when it sows
    the balance statistics (they need ``route``'s top-(k+1))."""
    base = config.tiny()  # latent and experts widened to 64: the dense kernels' tile
    cfg = dataclasses.replace(base, moe=dataclasses.replace(base.moe, latent_dim=64, expert_intermediate=64))
    T = 1 if path == "gather" else 2 * cfg.moe.num_experts // cfg.moe.top_k
    assert moe_decode.decode_path(T, cfg.moe.top_k, cfg.moe.num_experts) == path
    routed = {"gather": "moe_decode_route_gather", "dense": "moe_decode_dense_combine"}[path]
    x = jnp.asarray(np.random.default_rng(0).normal(size=(T, 1, cfg.hidden)), jnp.bfloat16)
    variables = nn.meta.unbox(jax.jit(MoE(cfg).init)(jax.random.key(0), x))
    with compile_for(H200):
        assert routed in _kernels(lambda v, x: MoE(cfg).apply(v, x, decode=True), variables, x)
        stats = _kernels(lambda v, x: MoE(cfg).apply(v, x, decode=True, mutable=["stats"]), variables, x)
        assert "pallas_call" in stats and routed not in stats


def test_moe_layer_norms_the_latent_in_the_dense_combine(monkeypatch):
    """Decoding with the glue kernels on the dense path, the latent norm runs in the combine kernel (no
    ``mixed_norm`` of its own before ``up_proj``) and the layer's output is XLA's path's (the kernels
    interpreted, on CPU). (At batch 1, the gather path, it stays in ``up_proj``'s kernel: test_mixed_input.py.)"""
    base = config.tiny()
    cfg = dataclasses.replace(base, moe=dataclasses.replace(base.moe, latent_dim=64, expert_intermediate=64))
    assert cfg.moe.latent_norm
    T = 2 * cfg.moe.num_experts // cfg.moe.top_k
    x = jnp.asarray(np.random.default_rng(1).normal(size=(T, 1, cfg.hidden)), jnp.bfloat16)
    variables = nn.meta.unbox(jax.jit(MoE(cfg).init)(jax.random.key(0), x))
    step = lambda v, x: MoE(cfg).apply(v, x, decode=True)
    with compile_for(H200):
        jaxpr = _kernels(step, variables, x)
        assert "moe_decode_dense_combine" in jaxpr and "mixed_norm" not in jaxpr
    want = step(variables, x)  # CPU: XLA's path, the latent_norm module
    run = moe_decode.routed_experts
    monkeypatch.setattr(moe_module, "kernel_runs", lambda implementation: True)
    monkeypatch.setattr(moe_decode, "routed_experts",
                        lambda *a, **kw: run(*a, **{**kw, "implementation": "pallas"}, interpret=True))
    got = step(variables, x)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=0.05, atol=0.02)


@pytest.mark.unchecked
def test_bad_routing_inputs_raise():
    x, scores, bias, ws = _inputs(0, 1, 4, 32, 64, 32, ties=False)
    run = lambda *a, routing=Routing(4): routed_experts_pallas(*a, routing=routing, activation="situ", interpret=True)
    with pytest.raises(ValueError, match=r"scores must be \[T, E\] and bias \[E\]"):
        run(x, scores[:, :16], bias, *ws)
    with pytest.raises(ValueError, match="float32 scores and bias"):
        run(x, scores.astype(jnp.bfloat16), bias, *ws)
    with pytest.raises(ValueError, match=r"routing.top_k=32 must lie in \(0, E=32\)"):
        run(x, scores, bias, *ws, routing=Routing(32))
    big = _inputs(0, 1, 4, 512, 64, 32, ties=False)
    with pytest.raises(ValueError, match=r"E \(w1.shape\[0\]\) a power of two in \[16, 256\], got 512"):
        run(*big[:3], *big[3])
    with pytest.raises(ValueError, match="block_f=32 must be a power of two >= 16 dividing F=48"):
        odd = _inputs(0, 1, 4, 32, 64, 48, ties=False)
        run(*odd[:3], *odd[3])
    with pytest.raises(ValueError, match="F=48 must be a multiple of tiles.block_n=64"):
        odd = _inputs(0, 16, 4, 32, 64, 48, ties=False)
        routed_dense_experts_pallas(*odd[:3], *odd[3], routing=Routing(4), activation="situ", interpret=True)
    y = jnp.zeros((32, 16, 48), jnp.bfloat16)  # the combine alone: 48 columns fit no block (an empty grid before)
    with pytest.raises(ValueError, match="y's L=48 must be a multiple of tiles.block_n=64"):
        routed_combine(y, *_inputs(0, 16, 4, 32, 64, 64, ties=False)[1:3], routing=Routing(4), interpret=True)
    with pytest.raises(ValueError, match=r"norm_scale must have shape \(64,\) \(y's L\), got \(63,\)"):
        routed_combine(jnp.zeros((32, 16, 64), jnp.bfloat16),
                       *_inputs(0, 16, 4, 32, 64, 64, ties=False)[1:3], routing=Routing(4),
                       norm_scale=jnp.ones((63,), jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="float32 scores and bias"):
        dense = _inputs(0, 16, 4, 32, 64, 64, ties=False)
        routed_dense_experts_pallas(dense[0], dense[1], dense[2].astype(jnp.bfloat16), *dense[3], routing=Routing(4),
                                    activation="situ", interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4])
def test_compiled_gather_routing_kernel(T):
    """Compiled for the GPU at ``small()``'s experts (64 of 512 × 512, k = 8): same experts and weights
    as ``route``, output within the exact-rounding reference's ulps."""
    x, scores, bias, ws = _inputs(T, T, 8, 64, 512, 512)
    ids, weights = route(scores, bias, 8, renormalize=True, scaling=1.0, with_stats=False)
    routing = Routing(8, True, 1.0, RENORM_EPS)
    parts, got_weights = jax.jit(lambda *a: expert_blocks(a[0], a[1:3], *a[3:], activation="situ",
                                                          routing=routing))(x, scores, bias, *ws)
    given = jax.jit(lambda *a: expert_blocks(*a, activation="situ"))(x, ids, *ws)
    np.testing.assert_array_equal(np.asarray(parts), np.asarray(given))
    np.testing.assert_allclose(np.asarray(got_weights), np.asarray(weights), rtol=WEIGHT_RTOL, atol=0)
    got = jax.jit(lambda *a: routed_experts_pallas(*a, routing=routing, activation="situ"))(x, scores, bias, *ws)
    _assert_within_ulps(got, _rounded_reference(x, ids, weights, ws, "situ"), max_fraction=0.02)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [16, 64])
def test_compiled_dense_routing(T):
    """The dense path compiled for the GPU at ``small()``'s experts against the exact-rounding reference.
    Every element within the ulp bound; at most 4 % differ at all (the tensor cores' fp32 sums in another
    order flip a few of the 3 roundings per expert output: 2.16 % at T = 16 on the H200, stop 52)."""
    x, scores, bias, ws = _inputs(T, T, 8, 64, 512, 512)
    ids, weights = route(scores, bias, 8, renormalize=True, scaling=1.0, with_stats=False)
    got = jax.jit(lambda *a: routed_dense_experts_pallas(*a, routing=Routing(8), activation="situ"))(
        x, scores, bias, *ws)
    _assert_within_ulps(got, _rounded_reference(x, ids, weights, ws, "situ"), max_fraction=0.04)


def test_nan_scores_stay_within_the_experts():
    """A NaN router score makes ranks collide; every slot's expert still lies in [0, E) (on the GPU a
    larger one would read past the weights) and the NaN reaches the weights."""
    from jax.experimental import pallas as pl
    from pallas_kernels.moe.rank_routing import slots

    E, k = 16, 4
    scores = jnp.asarray(np.random.default_rng(0).uniform(size=(1, E)), jnp.float32)
    scores = scores.at[0, E - 2].set(2.0).at[0, E - 1].set(jnp.nan)  # both rank 0: ids summed to 29
    bias = jnp.zeros((E,), jnp.float32)

    def kernel(scores_ref, bias_ref, e_ref, w_ref):
        for s, (e, w) in enumerate(slots(scores_ref, bias_ref, 0, Routing(k), range(k))):
            e_ref[s], w_ref[s] = e, w

    e, w = pl.pallas_call(kernel, out_shape=(jax.ShapeDtypeStruct((k,), jnp.int32),
                                             jax.ShapeDtypeStruct((k,), jnp.float32)), interpret=True)(scores, bias)
    assert np.all((np.asarray(e) >= 0) & (np.asarray(e) < E)), e
    assert np.isnan(np.asarray(w)).any()
