"""Per-head Muon / AdamW routing, the update each gets, schedules and QK-Clip."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers

from k3jax.train.config import OptimizerConfig, ScheduleConfig
from k3jax.train.optimizer import logical_axes, make_optimizer, muon_dimension_numbers, optimizer_labels
from k3jax.train.schedule import make_schedule
from tests.k3jax.train import toy
from tests.tolerances import F32_RTOL, rel_rmse



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


def _setup(muon=True, lr=0.01, wd=0.0):
    boxed = toy.boxed_params()
    params, axes = nn.unbox(boxed), logical_axes(boxed)
    cfg = OptimizerConfig(learning_rate=lr, weight_decay=wd, grad_clip_norm=None, muon=muon)
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


def test_each_head_block_is_orthogonalised_independently():
    params, _, tx = _setup()
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
        assert rel_rmse(u[:, h, :], -scale * _newton_schulz(g[:, h, :])) < F32_RTOL
    norms = [np.linalg.norm(u[:, h, :]) for h in range(toy.H)]
    assert max(norms) / min(norms) < 1.3


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
