"""KDA short causal depthwise conv: definition, decode steps == full pass, packed documents."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import causal_conv1d, causal_conv1d_step
from pallas_kernels.kda.conv import same_document_taps, short_convs
from pallas_kernels.kda.reference import segment_index
from tests.pallas_kernels.kda.conftest import segments_from_lengths
from tests.tolerances import F32_RTOL, F64_RTOL, rel_rmse


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


@pytest.mark.unchecked
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


# --- short_convs: the training op (conv, SiLU, per-head L2 norm, custom VJP) ----------------------

_DOCS = jnp.stack([segments_from_lengths((2, 9, 1, 7)), segments_from_lengths((12, 7), ids=(5, 5))
                   .at[12:].set(3)])  # row 1: an id that repeats after a change is a new document


def test_same_document_taps_match_segment_index():
    W = 4
    keep = same_document_taps(_DOCS, W)
    sidx = np.asarray(segment_index(_DOCS, *_DOCS.shape))
    T = _DOCS.shape[1]
    for j in range(W - 1):
        src = np.arange(T) - (W - 1) + j
        want = (src < 0) & (sidx == 0) | (src >= 0) & (sidx[:, np.clip(src, 0, None)] == sidx)
        np.testing.assert_array_equal(keep[..., j], want)
    assert same_document_taps(None, W) is None and same_document_taps(_DOCS, 1) is None


def _unfused(x, w, seg, group, eps=1e-6):
    """The layer's formulation before the fused op: SiLU(causal_conv1d), then the L2 norm per group."""
    y = jax.nn.silu(causal_conv1d(x, w, segment_ids=seg)[0])
    if group is None:
        return y
    B, T, C = y.shape
    y4 = y.reshape(B, T, C // group, group)
    return (y4 / jnp.sqrt(jnp.sum(y4 * y4, axis=-1, keepdims=True) + eps)).reshape(B, T, C)


@pytest.mark.parametrize("with_docs", [False, True])
def test_short_convs_equal_unfused_values_and_grads(x64, with_docs):
    seg = _DOCS if with_docs else None
    groups = (8, 8, None)
    ks = jax.random.split(jax.random.PRNGKey(3), 9)
    xs = tuple(jax.random.normal(ks[i], (2, 19, 24), jnp.float64) for i in range(3))
    ws = tuple(0.5 * jax.random.normal(ks[3 + i], (24, 4), jnp.float64) for i in range(3))
    cts = tuple(jax.random.normal(ks[6 + i], (2, 19, 24), jnp.float64) for i in range(3))
    fused = lambda xs, ws: short_convs(xs, ws, same_document_taps(seg, 4), l2_groups=groups)
    unfused = lambda xs, ws: tuple(_unfused(x, w, seg, g) for x, w, g in zip(xs, ws, groups))
    (out, vjp), (want, vjp_want) = jax.vjp(fused, xs, ws), jax.vjp(unfused, xs, ws)
    for a, b in zip(out, want):
        assert a.dtype == jnp.float64 and rel_rmse(a, b) <= F64_RTOL
    for a, b in zip(jax.tree.leaves(vjp(cts)), jax.tree.leaves(vjp_want(cts))):
        assert rel_rmse(a, b) <= F64_RTOL


def test_short_convs_bf16_io_fp32_compute():
    """bf16 in and out (the kernel's dtype) equals the fp32 computation rounded once."""
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 11, 16)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(1), (16, 4), jnp.float32)
    (y,) = short_convs((x,), (w,), l2_groups=(8,), out_dtype=jnp.bfloat16)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(y, _unfused(x.astype(jnp.float32), w, None, 8).astype(jnp.bfloat16))
    ct = jax.random.normal(jax.random.PRNGKey(2), y.shape)  # not along y: the norm's gradient cancels that
    loss = lambda y: jnp.sum(y.astype(jnp.float32) * ct)
    dx, dw = jax.grad(lambda x, w: loss(short_convs((x,), (w,), l2_groups=(8,), out_dtype=jnp.bfloat16)[0]),
                      argnums=(0, 1))(x, w)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    dw_want = jax.grad(lambda w: loss(_unfused(x.astype(jnp.float32), w, None, 8).astype(jnp.bfloat16)))(w)
    assert rel_rmse(dw, dw_want) <= F32_RTOL


@pytest.mark.unchecked
@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(weights=(jnp.ones((6, 4)),) * 3), "one entry per conv"),
        (dict(xs=(jnp.ones((2, 5, 6)), jnp.ones((2, 5)))), "each x must have shape"),
        (dict(weights=(jnp.ones((6, 4)), jnp.ones((7, 4)))), "each weight must have shape"),
        (dict(l2_groups=(4, None)), "l2_groups entries must divide"),
        (dict(keep=jnp.ones((2, 5, 4), bool)), "keep must have shape"),
    ],
)
def test_short_convs_bad_arguments_raise(kwargs, needle):
    args = dict(xs=(jnp.ones((2, 5, 6)),) * 2, weights=(jnp.ones((6, 4)),) * 2, keep=None, l2_groups=(3, None))
    args.update(kwargs)
    with pytest.raises(ValueError, match=needle):
        short_convs(args.pop("xs"), args.pop("weights"), args.pop("keep"), **args)
