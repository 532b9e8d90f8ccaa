"""Per-head Muon / AdamW routing, the update each gets (Newton–Schulz in bf16 or fp32), schedules."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers

from k3jax.train.batched_calls import batch_scans
from k3jax.train.config import OptimizerConfig, ScheduleConfig
from k3jax.train.optimizer import (DECAYED_ADAMW_AXES, _decoupled_decay, logical_axes, make_optimizer,
                                   muon_dimension_numbers, optimizer_labels)
from k3jax.train.schedule import make_schedule
from tests.k3jax.train import toy
from tests.tolerances import BF16_NS_RTOL, F32_RTOL, rel_rmse


def _newton_schulz(g, steps=5, coeffs=(3.4445, -4.7750, 2.0315)):
    """Independent float64 reference of the quintic iteration (Jordan 2024) on one matrix."""
    x = np.asarray(g, np.float64)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (np.linalg.norm(x) + 1e-8)
    a, b, c = coeffs
    for _ in range(steps):
        m = x @ x.T
        x = a * x + (b * m + c * m @ m) @ x
    return x.T if tall else x


_boxed_params = functools.cache(toy.boxed_params)  # op-by-op draws: seconds per call on a loaded CPU


def _setup(muon=True, lr=0.01, wd=0.0, ns_dtype="bfloat16", clip=None):
    boxed = _boxed_params()
    params, axes = nn.unbox(boxed), logical_axes(boxed)
    cfg = OptimizerConfig(learning_rate=lr, weight_decay=wd, grad_clip_norm=clip, muon=muon, ns_dtype=ns_dtype)
    tx = make_optimizer(cfg, optax.constant_schedule(lr), params, axes)
    return params, axes, tx


def test_dimension_numbers_follow_logical_axes():
    params, axes, _ = _setup()
    dims = muon_dimension_numbers(params, axes)
    kda, moe, mla = dims["layers_0"]["kda"], dims["layers_0"]["moe"], dims["layers_1"]["mla"]
    assert kda["q_proj"]["kernel"] == MuonDimensionNumbers((0,), (2,))  # heads batched
    assert kda["o_proj"]["kernel"] == MuonDimensionNumbers((1,), (2,))
    assert kda["b_proj"]["kernel"] == MuonDimensionNumbers((0,), (1,))  # [D, H] stays one matrix
    assert moe["router"]["kernel"] == MuonDimensionNumbers((0,), (1,))
    assert moe["w1"] == MuonDimensionNumbers((1,), (2,))  # per expert
    assert mla["q_b"]["kernel"] == MuonDimensionNumbers((0,), (2,))
    assert mla["kv_a"]["kernel"] == MuonDimensionNumbers((0,), (1,))
    labels = optimizer_labels(params, axes)
    adamw = [labels["embed"]["embedding"], labels["head"]["kernel"], kda["A_log"], kda["dt_bias"],
             kda["q_conv"], labels["layers_0"]["attn_norm"]["scale"], labels["layers_0"]["attn_res"]["query"]]
    assert adamw[:2] == ["adamw", "adamw"] and all(d is None for d in adamw[2:5])
    assert adamw[5:] == ["adamw", "adamw"]


@pytest.mark.parametrize("ns_dtype, rtol", [(None, F32_RTOL), ("bfloat16", BF16_NS_RTOL)])
def test_each_head_block_is_orthogonalised_independently(ns_dtype, rtol):
    params, _, tx = _setup(ns_dtype=ns_dtype)
    grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(1), p.shape), params)
    g = grads["layers_0"]["kda"]["q_proj"]["kernel"]
    g = g * jnp.asarray([1000.0, 1.0, 0.01, 1.0])[None, :, None]  # one loud head, one quiet one
    grads["layers_0"]["kda"]["q_proj"]["kernel"] = g
    updates, _ = tx.update(grads, tx.init(params), params)
    u = np.asarray(updates["layers_0"]["kda"]["q_proj"]["kernel"])  # [D, H, K]
    scale = 0.01 * 0.2 * np.sqrt(max(toy.D, toy.K))
    for h in range(toy.H):
        sv = np.linalg.svd(u[:, h, :] / -scale, compute_uv=False)
        # quintic NS leaves singular values in roughly [0.7, 1.2], whatever the head's gradient size
        assert 0.6 < sv.min() and sv.max() < 1.3, (h, sv)
        assert rel_rmse(u[:, h, :], -scale * _newton_schulz(g[:, h, :])) < rtol
    norms = [np.linalg.norm(u[:, h, :]) for h in range(toy.H)]
    assert max(norms) / min(norms) < 1.3


def _grads(params, seed):
    return jax.tree.map(lambda p: jax.random.normal(jax.random.key(seed), p.shape), params)


def test_fp32_newton_schulz_is_optax_contrib_muon_bit_for_bit():
    """ns_dtype=None: the same state tree, updates and states as the optax.contrib.muon chain it replaces."""
    lr, wd = 0.01, 0.1
    params, axes, tx = _setup(wd=wd, ns_dtype=None, clip=1.0)
    decay_mask = jax.tree.map(lambda names: any(n in DECAYED_ADAMW_AXES for n in names), axes,
                              is_leaf=lambda x: isinstance(x, tuple))
    sched = optax.constant_schedule(lr)
    ref = optax.chain(optax.clip_by_global_norm(1.0), optax.contrib.muon(
        learning_rate=sched, ns_steps=5, beta=0.95, eps=1e-8, weight_decay=wd, adam_b1=0.9, adam_b2=0.95,
        adam_weight_decay=0.0, adam_learning_rate=sched,
        muon_weight_dimension_numbers=muon_dimension_numbers(params, axes), consistent_rms=0.2),
        _decoupled_decay(sched, wd, decay_mask))
    state, ref_state = tx.init(params), ref.init(params)
    assert jax.tree.structure(state) == jax.tree.structure(ref_state)  # old checkpoints restore
    for step in range(3):
        grads = _grads(params, step)
        got = jax.jit(tx.update)(grads, state, params)
        want = jax.jit(ref.update)(grads, ref_state, params)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)
        (_, state), (_, ref_state) = got, want


def _eqns(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            yield from _eqns(sub)


@pytest.mark.parametrize("ns_dtype, want", [("bfloat16", jnp.bfloat16), (None, jnp.float32)])
def test_newton_schulz_products_and_carries_are_ns_dtype(ns_dtype, want):
    """Every NS matmul takes and returns ``ns_dtype`` (accumulating in fp32 under ns_precision) and
    every NS scan carries it (its fp32 coefficients stay scalars), also once `batch_scans` stacks the scans; momentum and updates stay fp32."""
    params, _, tx = _setup(ns_dtype=ns_dtype)
    state = tx.init(params)
    grads = _grads(params, 0)
    scans = {}
    for name, update in (("plain", tx.update), ("batched", batch_scans(tx.update))):
        with jax.default_matmul_precision("BF16_BF16_F32"):
            eqns = list(_eqns(jax.make_jaxpr(update)(grads, state, params).jaxpr))
        dots = [e for e in eqns if e.primitive.name == "dot_general"]  # the AdamW leaves have none
        assert dots and {v.aval.dtype for e in dots for v in (*e.invars, *e.outvars)} == {jnp.dtype(want)}
        assert {str(e.params["precision"]) for e in dots} == {"BF16_BF16_F32"}  # fp32 accumulation
        scans[name] = [e for e in eqns if e.primitive.name == "scan"]
        floats = {v.aval.dtype for e in scans[name] for v in e.outvars if jnp.issubdtype(v.aval.dtype, jnp.floating)}
        assert floats == {jnp.dtype(want)}, name
        # what else a scan reads in another float dtype is its scalar coefficients (kept fp32 by ours;
        # one per stacked leaf once batched)
        assert all(v.aval.ndim <= 1 for e in scans[name] for v in e.invars
                   if jnp.issubdtype(v.aval.dtype, jnp.floating) and v.aval.dtype != want), name
    assert len(scans["batched"]) < len(scans["plain"])
    updates, new_state = jax.eval_shape(tx.update, grads, state, params)
    floats = {x.dtype for x in jax.tree.leaves((updates, new_state)) if jnp.issubdtype(x.dtype, jnp.floating)}
    assert floats == {jnp.dtype(jnp.float32)}


def test_bf16_newton_schulz_agrees_with_fp32():
    params, axes, tx16 = _setup(ns_dtype="bfloat16", wd=0.1, clip=1.0)
    _, _, tx32 = _setup(ns_dtype=None, wd=0.1, clip=1.0)
    muon = [label == "muon" for label in jax.tree.leaves(optimizer_labels(params, axes))]
    s16, s32 = tx16.init(params), tx32.init(params)
    for step in range(2):
        grads = _grads(params, step)
        u16, s16 = jax.jit(tx16.update)(grads, s16, params)
        u32, s32 = jax.jit(tx32.update)(grads, s32, params)
        pairs = list(zip(jax.tree.leaves(u16), jax.tree.leaves(u32), muon, strict=True))
        flat = lambda i: np.concatenate([np.ravel(p[i]) for p in pairs if p[2]])
        assert rel_rmse(flat(0), flat(1)) < BF16_NS_RTOL, step
        for a, b, _ in (p for p in pairs if not p[2]):  # AdamW leaves do not see ns_dtype
            np.testing.assert_array_equal(a, b)
        for a, b in zip(jax.tree.leaves(s16), jax.tree.leaves(s32), strict=True):  # momentum is fp32 either way
            np.testing.assert_array_equal(a, b)


def test_float64_runs_keep_float64_newton_schulz():
    boxed = {"o_proj": _boxed_params()["layers_0"]["kda"]["o_proj"]}  # one per-head Muon leaf
    with jax.enable_x64(True):
        params = jax.tree.map(lambda p: p.astype(jnp.float64), nn.unbox(boxed))
        grads = jax.tree.map(lambda p: jnp.cos(7.0 * p), params)
        got = []
        for ns_dtype in ("bfloat16", None):
            cfg = OptimizerConfig(grad_clip_norm=None, ns_dtype=ns_dtype)
            tx = make_optimizer(cfg, optax.constant_schedule(0.01), params, logical_axes(boxed))
            got.append(jax.jit(tx.update)(grads, tx.init(params), params)[0]["o_proj"]["kernel"])
    assert got[0].dtype == jnp.float64
    np.testing.assert_array_equal(got[0], got[1])


def test_one_dimensional_params_get_adamw():
    params, _, tx = _setup()
    grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(2), p.shape), params)
    updates, _ = tx.update(grads, tx.init(params), params)
    ref = optax.adamw(0.01, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.0, nesterov=True)
    for path in (("layers_0", "kda", "A_log"), ("layers_0", "attn_norm", "scale"), ("embed", "embedding")):
        p, g, u = params, grads, updates
        for k in path:
            p, g, u = p[k], g[k], u[k]
        want, _ = ref.update(g, ref.init(p), p)
        assert rel_rmse(u, want) < F32_RTOL, path


def test_weight_decay_reaches_matrices_and_embeddings_only():
    params, _, tx = _setup(wd=0.5)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    emb = params["embed"]["embedding"]
    assert rel_rmse(updates["embed"]["embedding"], -0.01 * 0.5 * emb) < F32_RTOL
    q = params["layers_0"]["kda"]["q_proj"]["kernel"]
    assert rel_rmse(updates["layers_0"]["kda"]["q_proj"]["kernel"], -0.01 * 0.5 * q) < F32_RTOL
    assert np.all(np.asarray(updates["layers_0"]["attn_norm"]["scale"]) == 0)


def test_adamw_only_baseline_runs():
    params, _, tx = _setup(muon=False)
    grads = jax.tree.map(jnp.ones_like, params)
    updates, _ = tx.update(grads, tx.init(params), params)
    assert all(np.all(np.isfinite(np.asarray(u))) for u in jax.tree.leaves(updates))


def test_params_stay_fp32_under_updates():
    params, _, tx = _setup()
    grads = jax.tree.map(lambda p: jnp.ones(p.shape, jnp.bfloat16), params)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    new = optax.apply_updates(params, updates)
    assert {x.dtype for x in jax.tree.leaves(new)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)} == {
        jnp.dtype(jnp.float32)}


@pytest.mark.parametrize("kind", ["cosine", "wsd"])
def test_schedules_warm_up_then_decay(kind):
    sched = make_schedule(ScheduleConfig(kind=kind, warmup_fraction=0.1, final_lr_ratio=0.1), 1.0, 100)
    lrs = np.asarray([sched(s) for s in range(101)])
    assert lrs[0] == 0 and abs(lrs[10] - 1.0) < 1e-6
    assert np.all(np.diff(lrs[:11]) > 0) and np.all(np.diff(lrs[10:]) <= 1e-7)
    assert abs(lrs[100] - 0.1) < 1e-6
    if kind == "wsd":
        assert np.all(lrs[10:80] == 1.0)


def test_bad_optimizer_config_names_the_field():
    with pytest.raises(ValueError, match="learning_rate"):
        OptimizerConfig(learning_rate=0.0)
    with pytest.raises(ValueError, match="kind"):
        ScheduleConfig(kind="linear")
    with pytest.raises(ValueError, match=r"ns_dtype='float16' must be None or one of \('bfloat16', 'float32'\)"):
        OptimizerConfig(ns_dtype="float16")
