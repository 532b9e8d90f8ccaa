"""The continuous-batching engine on tiny(): prefix reuse never changes a greedy token, nothing
compiles after warm-up, eviction under a small budget keeps outputs right, cancellation frees
pages, and bad requests are refused before they are queued."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from k3jax.layout import is_scanned
from k3jax.serve import SamplingParams, compilations
from k3jax.serve.request import State

GREEDY = SamplingParams(max_tokens=3, temperature=0.0)


def _pages_accounted(engine) -> None:
    """Every page is free, owned by exactly one index node, or owned by exactly one running request."""
    in_index = [n.page for n in engine.index.nodes()]
    owned = [p for r in engine.slots if r is not None for p in r.owned]
    everything = sorted(engine.alloc.free_pages + in_index + owned)
    assert everything == list(range(1, engine.budget.num_pages)), "a page leaked or is owned twice"


def _turns(engine, common, a, b, extra):
    """Three prompts sharing ``common``, then a second turn continuing the first conversation."""
    first, second = engine.generate([common + a, common + b], GREEDY)
    (third,) = engine.generate([common + a + first + extra], GREEDY)
    return first, second, third


tokens = st.lists(st.integers(0, 255), min_size=1, max_size=4)


@settings(max_examples=6, deadline=None)
@given(common=st.lists(st.integers(0, 255), min_size=1, max_size=20), a=tokens, b=tokens,
       extra=st.lists(st.integers(0, 255), min_size=1, max_size=2))
def test_prefix_reuse_gives_the_same_greedy_tokens(make_engine, common, a, b, extra):
    # Shared prefixes of every length: inside the first page, exactly one page, and mid-page.
    reuse, cold = make_engine(True), make_engine(False)
    assert _turns(reuse, common, a, b, extra) == _turns(cold, common, a, b, extra)
    assert reuse.stats["hit_tokens"] > 0  # the second turn resumed from the first one's tail
    assert cold.stats["hit_tokens"] == 0
    _pages_accounted(reuse)


def test_hits_shorter_than_a_page_and_mid_page(make_engine):
    engine = make_engine()
    (out,) = engine.generate([[5, 6, 7]], GREEDY)  # cached: 5 tokens, all inside page 0 (a tail)
    engine.generate([[5, 6, 7] + out + [9]], GREEDY)
    assert engine.stats["hit_tokens"] == 5
    (out2,) = engine.generate([list(range(10, 27))], GREEDY)  # cached: a full page (+ snapshot) and 3 more
    engine.generate([list(range(10, 27)) + out2 + [1]], GREEDY)  # shares page 0, copies the tail page
    assert engine.stats["hit_tokens"] == 5 + 19


def test_nothing_compiles_after_warm_up(make_engine):
    engine = make_engine()
    # built from the scanned tiny() tree, it decodes on per-layer weights (k3jax.infer.decode.decode_layout)
    assert not engine.cfg.scan_layers and not any(map(is_scanned, engine.variables.values()))
    before = compilations()
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 256, n)) for n in (1, 15, 16, 17, 24, 28)]
    params = [SamplingParams(max_tokens=3, temperature=t, top_k=k, top_p=p, seed=i)
              for i, (t, k, p) in enumerate([(0, 0, 1), (0.7, 5, 1), (1.0, 0, 0.9), (0, 0, 1), (1.3, 3, 0.5), (0, 0, 1)])]
    outs = engine.generate(prompts, params)
    engine.generate([prompts[1] + outs[1] + [3]], GREEDY)  # a tail hit: page copy + snapshot load
    assert compilations() == before, "an engine step compiled after warm_up()"


def test_sampling_does_not_depend_on_the_batch(make_engine):
    engine = make_engine()
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=20, top_p=0.9, seed=7)
    alone = engine.generate([[1, 2, 3]], params)
    together = engine.generate([[4, 5], [1, 2, 3], [9] * 9], [GREEDY, params, GREEDY])
    assert together[1] == alone[0]


def test_eviction_under_memory_pressure_keeps_outputs_right(make_engine):
    reuse, cold = make_engine(True), make_engine(False)
    rng = np.random.default_rng(1)
    systems = [list(rng.integers(0, 256, 16)) for _ in range(3)]  # a shared page each
    prompts = [systems[i % 3] + list(rng.integers(0, 256, 1 + i % 4)) for i in range(18)]
    for start in range(0, len(prompts), 6):  # waves of 6 on 4 slots: joins, leaves, waiting
        assert reuse.generate(prompts[start:start + 6], GREEDY) == cold.generate(prompts[start:start + 6], GREEDY)
        _pages_accounted(reuse)
    m = reuse.metrics()
    assert m["evicted_pages"] > 0 and m["dropped_snapshots"] > 0
    assert 0 < m["hit_rate"] < 1


def test_cancelled_requests_free_their_pages(make_engine):
    engine = make_engine()
    params = SamplingParams(max_tokens=6, temperature=0.0)
    keep, drop, queued = (engine.submit(p, params) for p in ([1, 2, 3], [4, 5, 6, 7, 8, 9], [7, 7]))
    engine.step()
    engine.step()
    engine.cancel(drop)
    engine.cancel(queued)
    while keep.state is not State.DONE:
        engine.step()
    assert drop.finish_reason == "cancelled" and queued.finish_reason == "cancelled"
    assert drop.slot is not None and engine.slots == [None] * 4
    _pages_accounted(engine)
    assert keep.generated == make_engine(False).generate([[1, 2, 3]], params)[0]


@pytest.mark.parametrize("prompt, params, match", [
    ([], GREEDY, "non-empty"),
    ([1] * 30, GREEDY, "must fit the context of 32"),
    ([300], GREEDY, "vocab_size=256"),
    ([1], SamplingParams(max_tokens=1, stop_token_ids=(256,)), "stop_token_ids"),
])
def test_bad_requests_are_refused(make_engine, prompt, params, match):
    engine = make_engine()
    with pytest.raises(ValueError, match=match):
        engine.submit(prompt, params)
    assert not engine.busy


@pytest.mark.parametrize("field, value", [("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
                                          ("max_tokens", 0), ("max_tokens", True), ("seed", -1), ("stop", ("",))])
def test_invalid_sampling_parameters(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_decode_blocks_that_run_past_a_stop_string_cache_nothing_wrong(make_engine):
    from k3jax.data.tokenizer import ByteTokenizer

    decode = ByteTokenizer().decode
    prompt, params = [40, 41, 42, 43], SamplingParams(max_tokens=6, temperature=0.0)
    (full,) = make_engine(False).generate([prompt], params)
    # A character a token after the first (the third if it can) adds and no earlier token has: the
    # device block runs past it. (Random-init tokens are arbitrary bytes; most decode to U+FFFD.)
    stop = next(c for i in (3, 2, 4, 5) for c in decode(full[:i])[len(decode(full[:i - 1])):]
                if c not in decode(full[:i - 1]))
    reuse, cold = make_engine(True, decode=decode), make_engine(False, decode=decode)
    stopped = dict(max_tokens=6, temperature=0.0, stop=(stop,))
    req = reuse.submit(prompt, SamplingParams(**stopped))
    while req.state is not State.DONE:
        reuse.step()
    out = req.generated
    assert len(out) < len(full) and out == full[:len(out)] and req.finish_reason == "stop"
    assert req.device_length > req.length  # the block ran on: its final state was not cached
    turn2 = prompt + out + [7]
    assert reuse.generate([turn2], params) == cold.generate([turn2], params)
    _pages_accounted(reuse)
