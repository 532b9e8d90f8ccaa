"""Quantile Balancing properties over generated score matrices (chex + hypothesis), each shown to
catch a broken update.

- the exact threshold admits n tokens: #{m > θ} ≤ n ≤ #{m ≥ θ} per expert (n = k·T/E rounded),
  for generated scores with ties (scores on a coarse grid) and biases;
- the histogram threshold lies within its documented bound of the exact one,
  |θ_hist − θ_exact| ≤ w + (m_(n) − m_(n+1)) / 2, whenever the margins fit the histogram's range.

psum over 8 fake devices == unsharded is ``test_balance_sharded.py`` (its worker sets the devices
with ``chex.set_n_cpu_devices``). Shapes are fixed: one compile per function for every example.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from k3jax import balance

T, E, TOPK, BINS, RANGE = 48, 8, 2, 64, (-0.5, 0.5)
N = balance.admitted_per_expert(T, E, TOPK)
WIDTH = (RANGE[1] - RANGE[0]) / BINS


@st.composite
def scores_and_bias(draw):
    """Sigmoid-like scores in [0, 1], on a grid of ``levels`` values (coarse grids force ties)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    levels = draw(st.sampled_from([4, 32, 2**20]))
    popularity = rng.normal(size=E) * draw(st.sampled_from([0.0, 1.0]))
    scores = np.round(1 / (1 + np.exp(-(rng.normal(size=(T, E)) + popularity))) * levels) / levels
    bias = rng.normal(size=E) * draw(st.sampled_from([0.0, 0.05]))
    return jnp.asarray(scores, jnp.float32), jnp.asarray(bias - bias.mean(), jnp.float32)


@jax.jit
def _exact(scores, bias):
    margins = balance.routing_margins(scores, bias, TOPK)
    return margins, balance.quantile_thresholds(margins, TOPK)


@jax.jit
def _hist_thresholds(scores, bias):
    hist = balance.margin_histogram(scores, bias, TOPK, num_bins=BINS, margin_range=RANGE)
    return balance.histogram_thresholds(hist, T, TOPK, margin_range=RANGE)


def check_admits_n(thresholds_fn, scores, bias):
    margins, theta = thresholds_fn(scores, bias)
    chex.assert_shape(theta, (E,))
    chex.assert_type(theta, jnp.float32)
    above = np.sum(np.asarray(margins) > np.asarray(theta), axis=0)
    at_or_above = np.sum(np.asarray(margins) >= np.asarray(theta), axis=0)
    assert np.all(above <= N) and np.all(N <= at_or_above), (above, at_or_above, N)


@settings(max_examples=25, deadline=None)
@given(inputs=scores_and_bias())
def test_exact_threshold_admits_n_tokens(inputs):
    check_admits_n(_exact, *inputs)


def test_quantile_property_catches_an_off_by_one_threshold():
    """θ from the (n+1)-th and (n+2)-th margins: one token too many per expert."""
    def off_by_one(scores, bias):
        margins = balance.routing_margins(scores, bias, TOPK)
        top, _ = jax.lax.top_k(margins.T, N + 2)
        return margins, jnp.mean(top[:, N : N + 2], axis=1)
    scores, bias = _fixed_inputs()
    with pytest.raises(AssertionError):
        check_admits_n(off_by_one, scores, bias)


def _fixed_inputs():
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.random((T, E)), jnp.float32), jnp.zeros((E,), jnp.float32)


def check_histogram_bound(hist_fn, scores, bias):
    margins, exact = _exact(scores, bias)
    got = np.asarray(hist_fn(scores, bias))
    ordered = -np.sort(-np.asarray(margins), axis=0)  # [T, E], largest first
    gap = ordered[N - 1] - ordered[N]  # m_(n) - m_(n+1)
    chex.assert_tree_all_finite(got)
    assert np.all(np.abs(got - np.asarray(exact)) <= WIDTH + gap / 2 + 1e-6), (got, exact)


def _in_range(scores, bias):
    margins, _ = _exact(scores, bias)
    return bool(np.all((np.asarray(margins) > RANGE[0]) & (np.asarray(margins) <= RANGE[1])))


@settings(max_examples=25, deadline=None)
@given(inputs=scores_and_bias())
def test_histogram_threshold_within_its_bin_bound(inputs):
    scores, bias = inputs
    scores = 0.5 + (scores - 0.5) / 4  # margins inside the range: no clipped edge bins
    assume(_in_range(scores, bias))
    check_histogram_bound(_hist_thresholds, scores, bias)


def test_histogram_property_catches_a_half_width_bin_read():
    """Thresholds read as if the bins were half as wide."""
    broken = jax.jit(lambda s, b: _hist_thresholds(s, b) / 2 - 2 * WIDTH)
    scores = 0.5 + (_fixed_inputs()[0] - 0.5) / 4
    with pytest.raises(AssertionError):
        check_histogram_bound(broken, scores, jnp.zeros((E,), jnp.float32))
