"""Chunked KDA == step recurrence in float64: outputs, final state and every gradient."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import (
    chunk_kda_reference,
    chunk_kda_state,
    kda_transition,
    naive_recurrent_kda,
)
from tests.pallas_kernels.kda.conftest import kda_inputs, segments_from_lengths
from tests.tolerances import F64_RTOL, rel_rmse

ARG_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _loss_and_grads(fn, args, segment_ids, seed=7):
    """Value and gradients of a random linear functional of (o, final_state) w.r.t. all six inputs."""
    q, k, v, g, beta, s0 = args
    ko, ks = jax.random.split(jax.random.PRNGKey(seed))
    w_o = jax.random.normal(ko, v.shape, v.dtype)
    w_s = jax.random.normal(ks, s0.shape, s0.dtype)

    def loss(*a):
        o, S = fn(*a[:5], initial_state=a[5], segment_ids=segment_ids)
        return jnp.sum(o * w_o) + jnp.sum(S * w_s), (o, S)

    grad_fn = jax.jit(jax.grad(loss, argnums=tuple(range(6)), has_aux=True))
    return grad_fn(q, k, v, g, beta, s0)


def _assert_close(got, want, what):
    err = rel_rmse(got, want)
    assert err <= F64_RTOL, f"{what}: rel RMSE {err:.3e} > {F64_RTOL}"


def _unbounded_gate(shape):
    """Kimi-Linear's softplus gate has no lower bound: decays down to e^-40 per token."""
    return -jax.nn.softplus(8.0 * jax.random.normal(jax.random.PRNGKey(3), shape, jnp.float64))


@pytest.mark.parametrize(
    "B,T,H,K,V,chunk,lengths,unbounded",
    [
        # several chunks of the default size plus a tail; an unbounded gate (decays to e^-40 per
        # token) must neither overflow nor poison gradients, inside tiles or across them
        (1, 130, 2, 8, 4, 64, None, True),
        (2, 10, 3, 5, 7, 64, None, False),  # T < chunk
        # odd T and head dims; documents starting mid-chunk and at a chunk start, a 1-token one
        (2, 37, 3, 5, 7, 8, (5, 11, 1, 20), False),
    ],
)
def test_chunked_matches_recurrent_with_grads(x64, B, T, H, K, V, chunk, lengths, unbounded):
    q, k, v, g, beta, s0 = kda_inputs(0, B, T, H, K, V)
    if unbounded:
        g = _unbounded_gate(g.shape)
        assert float(g.min()) < -20.0
    seg = None if lengths is None else jnp.stack([segments_from_lengths(lengths)] * B)
    chunked = functools.partial(chunk_kda_reference, chunk_size=chunk)
    args = (q, k, v, g, beta, s0)
    g_chunk, (o_c, s_c) = _loss_and_grads(chunked, args, seg)
    g_rec, (o_r, s_r) = _loss_and_grads(naive_recurrent_kda, args, seg)
    chex.assert_type([o_c, s_c], jnp.float64)
    chex.assert_tree_all_finite(g_chunk)
    _assert_close(o_c, o_r, "o")
    _assert_close(s_c, s_r, "final state")
    for name, a, b in zip(ARG_NAMES, g_chunk, g_rec):
        _assert_close(a, b, f"d{name}")


def test_packed_documents_equal_separate_runs(x64):
    """The semantics of ``segment_ids`` (chunked == recurrent with documents is tested above)."""
    fn = functools.partial(chunk_kda_reference, chunk_size=8)
    lengths, ids = (6, 1, 13), (4, 2, 4)  # ids may repeat: only a *change* starts a document
    q, k, v, g, beta, s0 = kda_inputs(2, 1, sum(lengths), 2, 4, 3)
    seg = segments_from_lengths(lengths, ids)[None]
    o, S = jax.jit(lambda *a: fn(*a, initial_state=s0, segment_ids=seg))(q, k, v, g, beta)
    start, state = 0, s0
    for n in lengths:
        sl = slice(start, start + n)
        o_doc, S_doc = naive_recurrent_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=state)
        _assert_close(o[:, sl], o_doc, f"o of document at {start}")
        start, state = start + n, None
    _assert_close(S, S_doc, "final state (last document)")


def test_causality_exact(x64):
    """d o[t] / d (inputs at s > t) is exactly zero, also across chunk and document boundaries."""
    q, k, v, g, beta, s0 = kda_inputs(4, 1, 20, 2, 3, 3)
    seg = segments_from_lengths((7, 13))[None]
    t = 9

    def out_t(q, k, v, g, beta):
        o, _ = chunk_kda_reference(q, k, v, g, beta, initial_state=s0, segment_ids=seg, chunk_size=8)
        return o[:, t].sum()

    grads = jax.jit(jax.grad(out_t, argnums=range(5)))(q, k, v, g, beta)
    for name, gr in zip(ARG_NAMES, grads):
        assert np.all(np.asarray(gr[:, t + 1 :]) == 0.0), f"d o[{t}] / d {name}[>{t}] != 0"
        assert np.any(np.asarray(gr[:, 7 : t + 1]) != 0.0)
    assert np.all(np.asarray(grads[1][:, :7]) == 0.0), "document 2 must not see document 1"


def _explicit_transition(k, g, beta):
    """prod_t (I - beta_t k_t k_t^T) Diag(exp g_t), later factors on the left, in numpy."""
    k, g, beta = map(np.asarray, (k, g, beta))
    B, T, H, K = k.shape
    M = np.broadcast_to(np.eye(K), (B, H, K, K)).copy()
    for t in range(T):
        kt = k[:, t]  # [B,H,K]
        A = np.eye(K) - beta[:, t, :, None, None] * kt[..., :, None] * kt[..., None, :]
        M = np.einsum("bhij,bhjl->bhil", A * np.exp(g[:, t])[..., None, :], M)
    return M


def test_transition_identity(x64):
    """S_final = M @ S_0 + N with M from kda_transition and N the zero-state scan (context parallel).

    Row 0 is one document; row 1 has a document start inside the span, which cuts S_0 off (M = 0).
    """
    q, k, v, g, beta, s0 = kda_inputs(5, 2, 33, 2, 4, 3)
    seg = jnp.stack([segments_from_lengths((33,)), segments_from_lengths((12, 21))])
    M = jax.jit(lambda k, g, b: kda_transition(k, g, b, seg, chunk_size=8))(k, g, beta)
    N = jax.jit(lambda *a: chunk_kda_state(*a, segment_ids=seg, chunk_size=16))(k, v, g, beta)
    _, S = jax.jit(lambda *a: naive_recurrent_kda(*a, initial_state=s0, segment_ids=seg))(q, k, v, g, beta)
    _assert_close(jnp.einsum("bhij,bhjv->bhiv", M, s0) + N, S, "M S0 + N")
    _assert_close(M[:1], _explicit_transition(k[:1], g[:1], beta[:1]), "M vs explicit product")
    assert np.all(np.asarray(M[1]) == 0.0)


def test_state_only_scan_gradients(x64):
    """``chunk_kda_state`` (the CP increment, no output) differentiates like the recurrence."""
    _, k, v, g, beta, s0 = kda_inputs(6, 2, 29, 2, 3, 4)
    seg = jnp.stack([segments_from_lengths((29,)), segments_from_lengths((9, 20))])
    w = jax.random.normal(jax.random.PRNGKey(8), s0.shape, jnp.float64)

    def loss(fn, *a):
        return jnp.sum(fn(*a) * w)

    chunked = lambda k, v, g, b, s: chunk_kda_state(k, v, g, b, initial_state=s, segment_ids=seg, chunk_size=16)
    recurrent = lambda k, v, g, b, s: naive_recurrent_kda(
        k, k, v, g, b, initial_state=s, segment_ids=seg)[1]  # q does not reach the state
    args = (k, v, g, beta, s0)
    got = jax.jit(jax.grad(functools.partial(loss, chunked), argnums=range(5)))(*args)
    want = jax.jit(jax.grad(functools.partial(loss, recurrent), argnums=range(5)))(*args)
    for name, a, b in zip(("k", "v", "g", "beta", "initial_state"), got, want):
        _assert_close(a, b, f"d{name}")
