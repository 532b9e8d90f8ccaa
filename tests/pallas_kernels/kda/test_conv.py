"""KDA short causal depthwise conv: definition, decode steps == full pass, packed documents."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import causal_conv1d, causal_conv1d_step
from tests.pallas_kernels.kda.conftest import segments_from_lengths
from tests.tolerances import F64_RTOL, rel_rmse


def _inputs(B=2, T=19, C=6, W=4, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(k1, (B, T, C), jnp.float64)
    w = jax.random.normal(k2, (C, W), jnp.float64)
    h0 = jax.random.normal(k3, (B, W - 1, C), jnp.float64)
    return x, w, h0


def _direct(x, w, h0, seg):
    """y[t] = sum_j w[:, j] x[t - (W-1) + j] over same-document positions (history = document 0)."""
    x, w, h0, seg = map(np.asarray, (x, w, h0, seg))
    B, T, C = x.shape
    W = w.shape[1]
    doc = np.concatenate([np.zeros((B, 1), int), np.cumsum(seg[:, 1:] != seg[:, :-1], axis=1)], axis=1)
    y = np.zeros((B, T, C))
    for b in range(B):
        for t in range(T):
            for j in range(W):
                s = t - (W - 1) + j
                if s >= 0 and doc[b, s] == doc[b, t]:
                    y[b, t] += w[:, j] * x[b, s]
                elif s < 0 and doc[b, t] == 0:
                    y[b, t] += w[:, j] * h0[b, W - 1 + s]
    return y


def test_matches_definition_with_history_and_documents(x64):
    x, w, h0 = _inputs()
    seg = jnp.stack([segments_from_lengths((2, 9, 8)), segments_from_lengths((19,))])
    y, state = causal_conv1d(x, w, initial_state=h0, segment_ids=seg)
    assert y.dtype == jnp.float64 and state.shape == h0.shape
    assert rel_rmse(y, _direct(x, w, h0, seg)) <= F64_RTOL
    # Row 0's last document has 8 >= W-1 tokens, so its state is just the last inputs.
    np.testing.assert_array_equal(state, x[:, -3:])


def test_steps_equal_full_pass(x64):
    x, w, h0 = _inputs(T=13)
    y_full, s_full = causal_conv1d(x, w, initial_state=h0)
    ys, state, start = [], h0, 0
    for n in (1, 2, 1, 5, 4):  # pieces shorter than the W-1 history included
        y, state = causal_conv1d_step(x[:, start : start + n], w, state)
        ys.append(y)
        start += n
    assert rel_rmse(jnp.concatenate(ys, axis=1), y_full) <= F64_RTOL
    assert rel_rmse(state, s_full) <= F64_RTOL


def test_short_last_document_state_drops_old_history(x64):
    x, w, h0 = _inputs(B=1, T=9)
    seg = segments_from_lengths((8, 1))[None]
    _, state = causal_conv1d(x, w, initial_state=h0, segment_ids=seg)
    np.testing.assert_array_equal(state[:, :2], 0.0)
    np.testing.assert_array_equal(state[:, 2], x[:, 8])


def test_fp32_compute_for_bf16_inputs():
    x = jnp.ones((1, 5, 3), jnp.bfloat16)
    w = jnp.full((3, 4), 0.1, jnp.bfloat16)
    y, state = causal_conv1d(x, w)
    assert y.dtype == jnp.float32 and state.dtype == jnp.float32


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(x=jnp.ones((2, 5))), "x must have shape"),
        (dict(weight=jnp.ones((7, 4))), "weight must have shape"),
        (dict(initial_state=jnp.ones((2, 4, 6))), "initial_state must have shape"),
        (dict(segment_ids=jnp.ones((2, 5), jnp.float32)), "segment_ids must have an integer dtype"),
        (dict(segment_ids=jnp.ones((2, 4), jnp.int32)), "segment_ids must have shape"),
    ],
)
def test_bad_arguments_raise(kwargs, needle):
    args = dict(x=jnp.ones((2, 5, 6)), weight=jnp.ones((6, 4)), initial_state=None, segment_ids=None)
    args.update(kwargs)
    x, w = args.pop("x"), args.pop("weight")
    with pytest.raises(ValueError, match=needle):
        causal_conv1d(x, w, **args)
