"""KDA properties over generated inputs (chex + hypothesis), each shown to catch a broken op.

- packing: a packed row equals each of its documents run alone, for generated boundaries (chunk
  edges and their neighbours included), on the XLA path and the TPU kernel in its interpreter;
- a state carried across a split equals one pass, for generated split points;
- gradients stay finite with generated gates at K3's bound (g = -5, the most decay per token).

Chunked == recurrent over generated shapes and boundaries is ``test_ops.py``; float64 exactness is
the reference tests'. Shapes are fixed per test so every example reuses one compiled function.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels.kda import chunk_kda
from tests.pallas_kernels.kda.conftest import kda_inputs
from tests.strategies import doc_starts, documents, segment_row

B, T, H, K, V, CHUNK = 1, 40, 2, 8, 8, 16
GATE_BOUND = -5.0  # config.KDAConfig.gate_lower_bound
TOL = dict(rtol=1e-4, atol=1e-5)  # float32 against float32: chunk vs token order of the same sums
PROPERTY = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@functools.cache
def op(implementation: str):
    """One compiled ``(q, k, v, g, beta, segment_ids) -> o`` per path, shared by every example."""
    interpret = implementation == "pallas"
    return jax.jit(lambda q, k, v, g, beta, seg: chunk_kda(
        q, k, v, g, beta, segment_ids=seg, implementation=implementation, interpret=interpret, chunk_size=CHUNK)[0])


def _inputs(seed):
    return kda_inputs(seed, B, T, H, K, V, dtype=jnp.float32, state=False)[:5]


def check_packed_equals_alone(run, inputs, starts):
    """``run``'s packed row against each document alone: the document rotated to the row's start
    with one segment (what follows it cannot reach it: the op is causal)."""
    packed = run(*inputs, jnp.asarray(segment_row(T, starts))[None])
    one_doc = jnp.zeros((B, T), jnp.int32)
    for s, e in documents(T, starts):
        alone = run(*(jnp.roll(x, -s, axis=1) for x in inputs), one_doc)
        chex.assert_trees_all_close(packed[:, s:e], alone[:, : e - s], **TOL)


@PROPERTY
@given(starts=doc_starts(T, CHUNK), seed=st.integers(0, 2**16))
def test_packed_row_equals_documents_alone(starts, seed):
    check_packed_equals_alone(op("xla"), _inputs(seed), starts)


@settings(PROPERTY, max_examples=3)  # the interpreted kernel runs ~10x slower than the XLA path
@given(starts=doc_starts(T, CHUNK), seed=st.integers(0, 2**16))
def test_packed_row_equals_documents_alone_tpu_kernel(starts, seed):
    check_packed_equals_alone(op("pallas"), _inputs(seed), starts)


def test_packing_property_catches_an_op_that_ignores_documents():
    ignores_documents = lambda *a: op("xla")(*a[:-1], jnp.zeros((B, T), jnp.int32))
    with pytest.raises(AssertionError):
        check_packed_equals_alone(ignores_documents, _inputs(0), (CHUNK, CHUNK + 7))


@functools.cache
def _with_state():
    return jax.jit(lambda q, k, v, g, beta, s0: chunk_kda(
        q, k, v, g, beta, initial_state=s0, output_final_state=True, implementation="xla", chunk_size=CHUNK))


def check_split_equals_one_pass(run, inputs, s0, split):
    """Running ``[:split]`` then ``[split:]`` from the carried state == one pass (outputs, state)."""
    o, s = run(*inputs, s0)
    o1, s1 = run(*(x[:, :split] for x in inputs), s0)
    o2, s2 = run(*(x[:, split:] for x in inputs), s1)
    chex.assert_trees_all_close((jnp.concatenate([o1, o2], axis=1), s2), (o, s), **TOL)


@settings(max_examples=3, deadline=None)
@given(split=st.sampled_from([CHUNK, CHUNK - 1, CHUNK + 1, 2 * CHUNK, 5]), seed=st.integers(0, 2**16))
def test_state_across_a_split_equals_one_pass(split, seed):
    q, k, v, g, beta, s0 = kda_inputs(seed, B, T, H, K, V, dtype=jnp.float32)
    check_split_equals_one_pass(_with_state(), (q, k, v, g, beta), s0, split)


def test_split_property_catches_a_dropped_state():
    q, k, v, g, beta, s0 = kda_inputs(0, B, T, H, K, V, dtype=jnp.float32)
    drops_state = lambda *a: _with_state()(*a[:-1], jnp.zeros_like(a[-1]))
    with pytest.raises(AssertionError):
        check_split_equals_one_pass(drops_state, (q, k, v, g, beta), s0, CHUNK)


@functools.cache
def _grads(implementation: str):
    def loss(q, k, v, g, beta):
        o, _ = chunk_kda(q, k, v, g, beta, implementation=implementation, interpret=implementation == "pallas",
                         chunk_size=CHUNK)
        return jnp.sum(o * o)
    return jax.jit(jax.grad(loss, argnums=tuple(range(5))))


def check_grads_finite(grad_fn, inputs, at_bound):
    q, k, v, g, beta = inputs
    grads = grad_fn(q, k, v, jnp.where(at_bound, GATE_BOUND, g), beta)
    chex.assert_tree_all_finite(grads)
    chex.assert_trees_all_equal_shapes_and_dtypes(grads, inputs)


@settings(max_examples=3, deadline=None)
@given(fraction=st.sampled_from([1.0, 0.9, 0.5]), seed=st.integers(0, 2**16))
def test_gradients_finite_at_the_gate_bound(fraction, seed):
    """The XLA path; the kernels' gradients equal its gradients (``test_tpu_bwd``, ``test_kernel_gpu*``)."""
    at_bound = np.random.default_rng(seed).random((B, T, H, K)) < fraction
    check_grads_finite(_grads("xla"), _inputs(seed), at_bound)


def test_finite_gradient_property_catches_an_unanchored_decay():
    """The chunk's decay taken as exp(G_i) · exp(-G_j) (not exp(G_i - G_j)) overflows at the bound."""
    def unanchored(q, k, v, g, beta):
        G = jnp.cumsum(g, axis=1)
        return jnp.sum(jnp.einsum("bihk,bjhk->bhij", q * jnp.exp(G), k * jnp.exp(-G)) ** 2)
    grad_fn = jax.jit(jax.grad(unanchored, argnums=tuple(range(5))))
    with pytest.raises(AssertionError):
        check_grads_finite(grad_fn, _inputs(0), np.ones((B, T, H, K), bool))
