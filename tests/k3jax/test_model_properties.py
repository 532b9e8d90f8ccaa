"""Model properties over generated inputs (chex + hypothesis) on tiny(), each shown to catch a break.

- packing: a packed row equals each of its documents run alone, for generated document layouts;
- decode == forward: rows prefilled with generated prompt lengths, then decoded token by token for a
  generated continuation, give the forward's logits at every position.

Both reuse the session's compiled [2, 16] forward (``tiny_model``) and one prefill/decode program:
what hypothesis varies is data (layouts, lengths, tokens), never shapes. Chunk edges of the KDA
kernels inside a row are the kernel property tests' (``tests/pallas_kernels/kda/test_properties.py``).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3jax.infer.cache import KDACache, init_cache
from k3jax.infer.decode import decode_step, prefill_jit
from tests.strategies import doc_starts, documents, segment_row

B, T = 2, 16
TOL = dict(rtol=1e-4, atol=1e-4)  # float32 logits, full-precision matmuls, different summation orders
PROPERTY = settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _tokens(seed, vocab):
    return jax.random.randint(jax.random.PRNGKey(seed), (B, T), 0, vocab, dtype=jnp.int32)


def check_packed_equals_alone(forward, tokens, layouts):
    """Row b packs documents at ``layouts[b]``; each document alone is rotated to the start of an
    unsegmented row (causality makes what follows it irrelevant)."""
    seg = jnp.asarray(np.stack([segment_row(T, s) for s in layouts]))
    (packed, _), _ = forward(tokens, seg)
    for b, starts in enumerate(layouts):
        for s, e in documents(T, starts):
            (alone, _), _ = forward(jnp.roll(tokens, -s, axis=1))
            chex.assert_trees_all_close(packed[b, s:e], alone[b, : e - s], **TOL)


@PROPERTY
@given(layouts=st.tuples(doc_starts(T, 8), doc_starts(T, 8)), seed=st.integers(0, 2**16))
def test_packed_row_equals_documents_alone(tiny_model, layouts, seed):
    check_packed_equals_alone(tiny_model.forward, _tokens(seed, tiny_model.cfg.vocab_size), layouts)


def test_packing_property_catches_a_model_that_ignores_documents(tiny_model):
    ignores = lambda tokens, seg=None: tiny_model.forward(tokens)
    with pytest.raises(AssertionError):
        check_packed_equals_alone(ignores, _tokens(0, tiny_model.cfg.vocab_size), ((5,), (9, 12)))


MAX_LEN, PREFILL_CHUNK = 24, 7  # the ragged-prefill decode test's program (test_decode.py)


def check_decode_equals_forward(forward, decode, variables, cfg, tokens, lengths, steps):
    """Prefill row b with ``tokens[b, :lengths[b]]``, decode ``steps`` more tokens of the row; the
    logits after each token equal the forward's at that position."""
    with jax.default_matmul_precision("highest"):
        (want, _), _ = forward(tokens)
        padded = jnp.where(jnp.arange(T)[None] < lengths[:, None], tokens, 0)
        last, cache = prefill_jit(variables, cfg, padded, lengths, init_cache(cfg, B, MAX_LEN), chunk=PREFILL_CHUNK)
        got = [last]
        for i in range(steps):
            nxt = jnp.take_along_axis(tokens, jnp.minimum(lengths + i, T - 1)[:, None], axis=1)
            logits, cache = decode(variables, cfg, nxt, cache)
            got.append(logits[:, 0])
    got = np.stack([np.asarray(g) for g in got], axis=1)  # [B, steps + 1, V]
    for b in range(B):
        n = int(lengths[b])
        m = min(steps + 1, T - n + 1)  # positions n-1 .. n-1+m-1 exist in the forward
        chex.assert_trees_all_close(got[b, :m], np.asarray(want)[b, n - 1 : n - 1 + m], **TOL)


@PROPERTY
@given(lengths=st.tuples(st.integers(1, T), st.integers(1, T)), steps=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_decode_equals_forward_for_generated_splits(tiny_model, lengths, steps, seed):
    cfg = tiny_model.cfg
    check_decode_equals_forward(tiny_model.forward, decode_step, tiny_model.variables, cfg,
                                _tokens(seed, cfg.vocab_size), jnp.asarray(lengths, jnp.int32), steps)


def test_decode_property_catches_a_decode_that_drops_the_kda_state(tiny_model):
    def drops_state(variables, cfg, tokens, cache):
        zero = lambda c: c.replace(state=jnp.zeros_like(c.state)) if isinstance(c, KDACache) else c
        return decode_step(variables, cfg, tokens, cache.replace(layers=tuple(map(zero, cache.layers))))
    cfg = tiny_model.cfg
    with pytest.raises(AssertionError):
        check_decode_equals_forward(tiny_model.forward, drops_state, tiny_model.variables, cfg,
                                    _tokens(0, cfg.vocab_size), jnp.asarray([6, 9], jnp.int32), 2)
