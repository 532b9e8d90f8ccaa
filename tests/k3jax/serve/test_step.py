"""Per-row sampling on the device: greedy rows are the argmax, top-k / top-p keep only their
tokens, the draws follow the warped distribution, and a row's draw depends only on its own key."""

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.infer.decode import warp
from k3jax.serve.step import RowSampling, sample_rows, warp_rows

N = 4096
LOGITS = jnp.log(jnp.asarray([0.05, 0.4, 0.1, 0.3, 0.15], jnp.float32))


def _draw(temperature, top_k, top_p, seeds=None):
    seeds = np.arange(N, dtype=np.uint32) if seeds is None else np.resize(seeds, N)  # one shape: one compile
    rows = N
    s = RowSampling(jnp.full((rows,), temperature, jnp.float32), jnp.full((rows,), top_k, jnp.int32),
                    jnp.full((rows,), top_p, jnp.float32), jnp.asarray(seeds), jnp.full((rows,), 5, jnp.int32))
    return np.asarray(jax.jit(sample_rows)(jnp.broadcast_to(LOGITS, (rows, 5)), s))


def test_greedy_and_degenerate_filters_are_the_argmax():
    assert set(_draw(0.0, 0, 1.0)) == {1}
    assert set(_draw(1.0, 1, 1.0)) == {1}
    assert set(_draw(1.0, 0, 0.3)) == {1}


def test_draws_follow_the_warped_distribution():
    counts = np.bincount(_draw(1.0, 0, 1.0), minlength=5) / N
    np.testing.assert_allclose(counts, np.exp(LOGITS), atol=0.03)
    top2 = np.bincount(_draw(1.0, 2, 1.0), minlength=5) / N  # tokens 1 and 3: 0.4 / 0.3 renormalised
    np.testing.assert_allclose(top2, [0, 4 / 7, 0, 3 / 7, 0], atol=0.03)
    nucleus = np.bincount(_draw(1.0, 0, 0.75), minlength=5) / N  # 0.4 + 0.3 < 0.75: token 4 joins
    np.testing.assert_allclose(nucleus, [0, 0.4 / 0.85, 0, 0.3 / 0.85, 0.15 / 0.85], atol=0.03)


def test_a_rows_draw_depends_only_on_its_own_key():
    alone = _draw(1.0, 0, 1.0, seeds=np.asarray([7, 7, 9], np.uint32))
    assert alone[0] == alone[1] == _draw(1.0, 0, 1.0, seeds=np.asarray([3, 7, 5], np.uint32))[1]


def test_warp_rows_is_each_rows_own_warp():
    # What speculative verification compares: row b's log-probabilities are warp() with row b's
    # parameters (greedy, temperature, top-k, top-p), whatever the other rows ask for.
    rows = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.5, 0, 1.0), (1.0, 2, 1.0), (1.0, 0, 0.75), (2.0, 3, 0.6)]
    logits = jnp.broadcast_to(LOGITS, (len(rows), 5))
    s = RowSampling(*(jnp.asarray(c) for c in zip(*rows)), jnp.zeros((len(rows),), jnp.uint32),
                    jnp.zeros((len(rows),), jnp.int32))
    got = np.exp(np.asarray(jax.jit(warp_rows)(logits, s.replace(top_k=jnp.asarray(s.top_k, jnp.int32)))))
    for b, (t, k, p) in enumerate(rows):
        want = np.exp(np.asarray(warp(LOGITS[None], t, k or None, p)))[0]
        np.testing.assert_allclose(got[b], want, atol=1e-6, err_msg=f"row {b}: {rows[b]}")
