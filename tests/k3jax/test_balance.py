"""Quantile Balancing (k3jax.balance): SPEC §6 example, convergence, the per-update invariant,
histogram vs exact, the sign baseline, metrics and bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from k3jax import balance

# 8 tokens, 4 experts, k = 1. Plain top-1 sends 5/2/1/0 tokens; tokens 0 and 1 would rather
# move to expert 3 and token 2 to expert 2 than any other reassignment.
SPEC_SCORES = np.array(
    [
        [0.90, 0.20, 0.10, 0.60],
        [0.85, 0.10, 0.20, 0.55],
        [0.80, 0.10, 0.50, 0.20],
        [0.95, 0.30, 0.10, 0.10],
        [0.90, 0.20, 0.10, 0.15],
        [0.10, 0.90, 0.20, 0.10],
        [0.20, 0.85, 0.10, 0.20],
        [0.10, 0.20, 0.90, 0.30],
    ],
    np.float32,
)
# Same load pattern, but the cheapest rebalancing is a chain (expert 0 → 1 → 3), which the
# alternating update resolves over more steps (measured: balanced after 5 updates).
CHAIN_SCORES = np.array(
    [
        [0.90, 0.50, 0.20, 0.10],
        [0.80, 0.60, 0.30, 0.20],
        [0.85, 0.40, 0.50, 0.30],
        [0.70, 0.30, 0.20, 0.60],
        [0.95, 0.20, 0.10, 0.40],
        [0.30, 0.90, 0.20, 0.10],
        [0.20, 0.80, 0.30, 0.40],
        [0.10, 0.20, 0.90, 0.50],
    ],
    np.float32,
)


def _loads(scores, bias, k):
    ids, _ = balance.biased_topk(scores, bias, k)
    return np.asarray(balance.expert_loads(ids, scores.shape[1]))


def _skewed_scores(key, num_tokens, num_experts, skew=1.0):
    """Sigmoid scores with per-expert popularity offsets (plain top-k leaves experts empty)."""
    k_tok, k_exp = jax.random.split(key)
    logits = jax.random.normal(k_tok, (num_tokens, num_experts))
    logits = logits + skew * jax.random.normal(k_exp, (num_experts,))
    return jax.nn.sigmoid(logits)


def _updates_to_balance(scores, k, max_updates):
    bias = jnp.zeros(scores.shape[1], jnp.float32)
    for step in range(max_updates + 1):
        loads = _loads(scores, bias, k)
        if loads.min() == loads.max():
            return step, loads
        bias = balance.quantile_bias_exact(scores, bias, k)
    return None, loads


def test_spec_example_balances_within_three_updates():
    scores = jnp.asarray(SPEC_SCORES)
    np.testing.assert_array_equal(_loads(scores, jnp.zeros(4), 1), [5, 2, 1, 0])
    steps, loads = _updates_to_balance(scores, k=1, max_updates=3)
    assert steps is not None and steps <= 3, loads
    np.testing.assert_array_equal(loads, [2, 2, 2, 2])


def test_chain_example_balances():
    scores = jnp.asarray(CHAIN_SCORES)
    np.testing.assert_array_equal(_loads(scores, jnp.zeros(4), 1), [5, 2, 1, 0])
    steps, loads = _updates_to_balance(scores, k=1, max_updates=8)
    assert steps is not None, loads


@functools.partial(jax.jit, static_argnames=("k", "num_updates"))
def _run_exact(scores, k, num_updates):
    bias = jnp.zeros(scores.shape[1], jnp.float32)
    bias = jax.lax.fori_loop(
        0, num_updates, lambda _, b: balance.quantile_bias_exact(scores, b, k), bias
    )
    ids, _ = balance.biased_topk(scores, bias, k)
    return balance.expert_loads(ids, scores.shape[1])


@pytest.mark.parametrize("num_experts,k", [(64, 8), (896, 16)])
def test_exact_reaches_balance_within_20_updates(num_experts, k):
    scores = _skewed_scores(jax.random.PRNGKey(0), 16384, num_experts)
    assert _loads(scores, jnp.zeros(num_experts), k).min() == 0  # starts badly imbalanced
    loads = np.asarray(_run_exact(scores, k, 20))
    assert loads.max() / loads.min() <= 1.1, (loads.max(), loads.min())


def test_hist_with_default_config_reaches_balance_within_20_updates():
    cfg, k = balance.BalanceConfig(), 8
    scores = _skewed_scores(jax.random.PRNGKey(0), 16384, 64)

    @jax.jit
    def run(scores):
        update = functools.partial(
            balance.quantile_bias_hist, k=k, num_bins=cfg.num_bins, margin_range=cfg.margin_range
        )
        bias = jax.lax.fori_loop(0, 20, lambda _, b: update(scores, b), jnp.zeros(64))
        return balance.expert_loads(balance.biased_topk(scores, bias, k)[0], 64)

    loads = np.asarray(run(scores))
    assert loads.max() / loads.min() <= 1.1, (loads.max(), loads.min())


@pytest.mark.parametrize("num_experts,k", [(64, 8), (896, 16)])
def test_each_update_admits_exactly_n_tokens(num_experts, k):
    """Given the cutoffs an update was computed from, every expert's threshold admits n tokens."""
    num_tokens = 16384
    n = balance.admitted_per_expert(num_tokens, num_experts, k)
    assert n == round(k * num_tokens / num_experts)
    scores = _skewed_scores(jax.random.PRNGKey(1), num_tokens, num_experts)
    bias = 0.1 * jax.random.normal(jax.random.PRNGKey(2), (num_experts,))
    update = jax.jit(balance.quantile_bias_exact, static_argnames="k")
    for _ in range(2):
        margins = np.asarray(balance.routing_margins(scores, bias, k))
        theta = np.asarray(balance.quantile_thresholds(jnp.asarray(margins), k))
        above = np.sum(margins > theta, axis=0)
        at_or_above = np.sum(margins >= theta, axis=0)
        top = -np.partition(-margins, [n - 1, n], axis=0)
        untied = top[n - 1] > top[n]
        # An overloaded expert's n-th and (n+1)-th margins are both routed ones, which tie only
        # by fp32 rounding collisions (measured: a few of 896 experts).
        overloaded = _loads(scores, bias, k) > n
        assert overloaded.any() and untied[overloaded].mean() > 0.9
        np.testing.assert_array_equal(above[untied], n)
        assert np.all(above <= n) and np.all(at_or_above >= n)
        # Ties straddle rank n only at the (k+1)-th-choice margin, which is exactly 0.
        np.testing.assert_array_equal(theta[~untied], 0.0)
        new_bias = update(scores, bias, k=k)
        expected = bias - theta
        np.testing.assert_allclose(new_bias, expected - expected.mean(), rtol=0, atol=1e-6)
        assert abs(float(new_bias.mean())) < 1e-6  # centred
        bias = new_bias


@pytest.mark.parametrize("num_experts,k", [(64, 8), (896, 16)])
def test_hist_tracks_exact_within_bin_width(num_experts, k):
    num_tokens, num_bins, margin_range = 16384, 512, (-0.5, 0.5)
    width = (margin_range[1] - margin_range[0]) / num_bins
    scores = _skewed_scores(jax.random.PRNGKey(3), num_tokens, num_experts)
    bias = jnp.zeros(num_experts)
    for _ in range(4):
        margins = balance.routing_margins(scores, bias, k)
        exact = np.asarray(balance.quantile_thresholds(margins, k))
        hist = balance.margin_histogram(
            scores, bias, k, num_bins=num_bins, margin_range=margin_range
        )
        approx = balance.histogram_thresholds(hist, num_tokens, k, margin_range=margin_range)
        n = balance.admitted_per_expert(num_tokens, num_experts, k)
        pivot_rank = int(k * num_tokens / num_experts)  # 0-based rank of the (⌊q⌋+1)-th largest
        top = -np.partition(-np.asarray(margins), [n - 1, n, pivot_rank], axis=0)
        gap = top[n - 1] - top[n]
        pivot = top[pivot_rank]
        interior = (pivot > margin_range[0] + width) & (pivot <= margin_range[1] - width)
        assert interior.mean() > 0.5  # the bound is tested on most experts, not vacuously
        err = np.abs(np.asarray(approx) - exact)
        bound = width + gap / 2 + 1e-6
        assert np.all(err[interior] <= bound[interior]), (err - bound).max()
        bias = balance.bias_from_histogram(hist, num_tokens, k, bias, margin_range=margin_range)


def test_histogram_is_additive_over_micro_batches():
    scores = _skewed_scores(jax.random.PRNGKey(4), 4096, 64)
    bias = 0.05 * jax.random.normal(jax.random.PRNGKey(5), (64,))
    hist = functools.partial(balance.margin_histogram, k=8, num_bins=128, margin_range=(-1, 1))
    whole = hist(scores, bias)
    parts = sum(hist(part, bias) for part in jnp.split(scores, 4))
    np.testing.assert_array_equal(whole, parts)
    np.testing.assert_array_equal(whole.sum(axis=1), 4096)


@pytest.mark.parametrize("method", ["qb_hist", "qb_exact", "sign", "none"])
def test_update_bias_from_accumulated_step_statistics(method):
    cfg = balance.BalanceConfig(method=method)
    k, scores = 8, _skewed_scores(jax.random.PRNGKey(6), 4096, 64)
    bias = 0.05 * jax.random.normal(jax.random.PRNGKey(7), (64,))
    micro = [balance.step_statistics(cfg, part, bias, k) for part in jnp.split(scores, 2)]
    stats = balance.combine_statistics(*micro)
    new = balance.update_bias(cfg, bias, stats, k)
    expected = {
        "qb_hist": balance.quantile_bias_hist(
            scores, bias, k, num_bins=cfg.num_bins, margin_range=cfg.margin_range
        ),
        "qb_exact": balance.quantile_bias_exact(scores, bias, k),
        "sign": balance.sign_bias_update(bias, jnp.asarray(_loads(scores, bias, k)), cfg.sign_rate),
        "none": bias,
    }[method]
    np.testing.assert_allclose(new, expected, rtol=0, atol=1e-6)


def test_sign_update_moves_each_bias_by_rate():
    bias = jnp.array([0.3, -0.1, 0.0, -0.2])
    loads = jnp.array([5, 2, 1, 0])  # mean 2: over, equal, under, under
    new = balance.sign_bias_update(bias, loads, 1e-3)
    step = np.array([-1e-3, 0.0, 1e-3, 1e-3])
    np.testing.assert_allclose(new, bias + step - step.mean(), rtol=0, atol=1e-7)


def test_load_metrics_per_layer():
    loads = jnp.array([[4, 2, 2, 0], [3, 3, 1, 1]])  # two layers
    m = balance.load_metrics(loads)
    np.testing.assert_array_equal(m["max_min_ratio"], [np.inf, 3.0])
    np.testing.assert_allclose(m["max_mean_ratio"], [2.0, 1.5])
    np.testing.assert_allclose(m["cv"], [np.std([4, 2, 2, 0]) / 2, 1.0 / 2], rtol=1e-6)
    np.testing.assert_array_equal(m["zero_experts"], [1, 0])


@pytest.mark.unchecked
def test_bad_input_raises_value_error():
    scores, bias = jnp.full((8, 4), 0.5), jnp.zeros(4)
    with pytest.raises(ValueError, match="k=4"):
        balance.quantile_bias_exact(scores, bias, 4)
    with pytest.raises(ValueError, match="k=0"):
        balance.quantile_bias_exact(scores, bias, 0)
    with pytest.raises(ValueError, match="num_bins=1"):
        balance.margin_histogram(scores, bias, 1, num_bins=1, margin_range=(-1, 1))
    with pytest.raises(ValueError, match="num_bins=1"):
        balance.BalanceConfig(num_bins=1)
    with pytest.raises(ValueError, match="margin_range"):
        balance.quantile_bias_hist(scores, bias, 1, num_bins=8, margin_range=(1.0, -1.0))
    with pytest.raises(ValueError, match="0 on a bin edge"):
        balance.BalanceConfig(num_bins=4, margin_range=(-0.25, 0.5))
    with pytest.raises(ValueError, match="lo < 0 < hi"):
        balance.margin_histogram(scores, bias, 1, num_bins=8, margin_range=(0.1, 0.5))
    with pytest.raises(ValueError, match="method"):
        balance.BalanceConfig(method="aux_loss")
    with pytest.raises(ValueError, match="qb_exact"):
        cfg = balance.BalanceConfig(method="qb_exact")
        stats = balance.step_statistics(cfg, scores, bias, 1)
        balance.update_bias(cfg, bias, stats, 1, axis_names=("data",))
    with pytest.raises(ValueError, match=r"scores must have shape \[T, E\]"):
        balance.quantile_bias_exact(jnp.zeros((2, 8, 4)), bias, 1)
    with pytest.raises(ValueError, match=r"bias must have shape \[E\]"):
        balance.quantile_bias_exact(scores, jnp.zeros(5), 1)
    with pytest.raises(ValueError, match="k=4"):  # at trace time under jit too
        jax.jit(balance.quantile_bias_exact, static_argnames="k")(scores, bias, k=4)


def test_non_finite_scores():
    bad = jnp.full((8, 4), 0.5).at[3, 1].set(jnp.nan)
    with pytest.raises(ValueError, match="scores must be finite, got 1"):
        balance.quantile_bias_exact(bad, jnp.zeros(4), 1)  # concrete input: checked eagerly
    checked = checkify.checkify(
        jax.jit(functools.partial(balance.quantile_bias_hist, k=1, num_bins=8, check_values=True))
    )
    err, _ = checked(bad, jnp.zeros(4))
    with pytest.raises(checkify.JaxRuntimeError, match="scores must be finite"):
        err.throw()
    err, _ = checked(jnp.full((8, 4), 0.5), jnp.zeros(4))
    err.throw()
