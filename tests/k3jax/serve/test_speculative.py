"""Speculative decoding in the engine: greedy tokens equal the plain engine's token for token
(shared prefixes, max_tokens and stop ids inside an accepted run, a second turn resuming from a
prefix hit), sampling with top_k=1 equals greedy, pages all come back, nothing compiles after
warm-up, and bad drafts are refused.

A random draft accepts almost nothing, which would test only the rejection path. So the target
here is tiny() with its embedding scaled up (``bigram``): the residual stream is dominated by the
current token's embedding, so its greedy next token is close to a function of the current token,
and ``copy_draft`` (input = the next token's normalised embedding, attention and MLP outputs
zeroed) predicts exactly that function: drafts are accepted often but not always.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import config
from k3jax.infer.cache import KDACache
from k3jax.infer.draft import init_draft, load_draft, save_draft
from k3jax.serve import Engine, EngineConfig, SamplingParams, compilations
from k3jax.serve.pages import MLAPages

from .conftest import engine_config
from .test_engine import _pages_accounted

GAMMA = 3


def bigram(variables: dict, scale: float = 5.0) -> dict:
    params = dict(variables["params"])
    params["embed"] = {"embedding": params["embed"]["embedding"] * scale}
    return {**variables, "params": params}


def copy_draft(cfg) -> dict:
    draft = init_draft(cfg, jax.random.key(1))
    D = cfg.hidden
    draft["inp"]["kernel"] = jnp.zeros((2 * D, D), jnp.float32).at[D:].set(jnp.eye(D))
    draft["mla"]["o_proj"]["kernel"] = jnp.zeros_like(draft["mla"]["o_proj"]["kernel"])
    draft["mlp"]["down"]["kernel"] = jnp.zeros_like(draft["mlp"]["down"]["kernel"])
    return draft


@pytest.fixture(scope="module")
def engines(tiny_model):
    """``make(speculative, prefix_cache=True)``: a warmed-up engine on the bigram target (the
    speculative one with ``draft_tokens = GAMMA``; max_context leaves room for the drafts in the
    same two-page bucket)."""
    cfg, variables = tiny_model.cfg, bigram(tiny_model.variables)

    def make(speculative: bool, prefix_cache: bool = True) -> Engine:
        spec = dict(draft_tokens=GAMMA) if speculative else {}
        ecfg = engine_config(cfg, max_context=32 - GAMMA, prefix_cache=prefix_cache, **spec)
        engine = Engine(variables, cfg, ecfg, draft=copy_draft(cfg) if speculative else None)
        engine.warm_up()
        return engine

    return make


def _cached_state(engine) -> dict:
    """Per index node (keyed by its tokens from the root): its MLA latent rows and KDA snapshot."""
    pages = [c.pages for c in jax.tree.leaves(engine.paged.layers, is_leaf=lambda c: isinstance(c, MLAPages))
             if isinstance(c, MLAPages)]
    snaps = [c.state for c in jax.tree.leaves(engine.paged.snapshots, is_leaf=lambda c: isinstance(c, KDACache))
             if isinstance(c, KDACache)]
    out = {}
    for node in engine.index.nodes():
        if node.page is None:
            continue
        path, n = [], node
        while n.parent is not None:
            path[:0], n = n.key, n.parent
        rows = [np.take(np.asarray(p), node.page, axis=p.ndim - 3)[..., :len(node.key), :] for p in pages]
        state = None if node.snapshot is None else [np.take(np.asarray(x), node.snapshot, axis=x.ndim - 4)
                                                     for x in snaps]
        out[tuple(path)] = (rows, state)
    return out


def _assert_same_cache(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        (rows_a, state_a), (rows_b, state_b) = a[key], b[key]
        for x, y in zip(rows_a, rows_b):
            np.testing.assert_allclose(x, y, atol=1e-4, err_msg=f"latent rows of {key}")
        assert (state_a is None) == (state_b is None), f"snapshot of {key}"
        for x, y in zip(state_a or [], state_b or []):
            np.testing.assert_allclose(x, y, atol=1e-4, err_msg=f"KDA snapshot of {key}")


def _workload(rng):
    system = list(rng.integers(0, 256, 17))  # a page and a token shared by three of them
    return [system + list(rng.integers(0, 256, n)) for n in (1, 3, 5)] + [list(rng.integers(0, 256, 3))]


def test_greedy_speculative_equals_plain(engines):
    plain, spec, plain_again = engines(False), engines(True), engines(False)
    before = compilations()
    prompts = _workload(np.random.default_rng(0))
    lengths = [9, 8, 4, 20]  # the last one runs several cycles per device call
    reference = plain.generate(prompts, [SamplingParams(max_tokens=m, temperature=0.0) for m in lengths])
    # a stop id in the middle of request 0's output, and request 1 ending mid-run (max_tokens 5)
    stop = reference[0][5]
    params = [SamplingParams(max_tokens=m, temperature=0.0, stop_token_ids=(stop,) if i == 0 else ())
              for i, m in enumerate([9, 5, 4, 20])]
    want = plain_again.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert got == want
    # the cache the runs leave is the same too: latent rows at their positions, snapshots at boundaries
    _assert_same_cache(_cached_state(spec), _cached_state(plain_again))
    assert got[0][-1] == stop and len(got[0]) == reference[0].index(stop) + 1 and len(got[1]) == 5
    metrics = spec.metrics()
    assert spec.stats["draft_accepted"] > 0 and metrics["draft_mean_accepted"] > 0.3
    assert metrics["draft_acceptance_rate"] == pytest.approx(metrics["draft_mean_accepted"] / GAMMA)
    # a second turn resumes from the first one's cached tail (the draft has not seen the prefix)
    turn, short = [prompts[3] + got[3] + [7]], SamplingParams(max_tokens=4, temperature=0.0)
    assert spec.generate(turn, short) == plain.generate(turn, short)
    assert spec.stats["hit_tokens"] > 0
    assert compilations() == before, "a speculative step compiled after warm_up()"
    _pages_accounted(spec)


def test_sampled_speculative_keeps_to_its_pages(engines):
    spec = engines(True, prefix_cache=False)
    prompts = _workload(np.random.default_rng(1))
    sampled = [SamplingParams(max_tokens=m, temperature=t, top_k=k, top_p=p, seed=i)
               for i, (m, t, k, p) in enumerate([(9, 1.0, 0, 1.0), (6, 0.7, 5, 0.9), (7, 1.3, 0, 0.8), (3, 1.0, 3, 1.0)])]
    outs = spec.generate(prompts, sampled)
    assert [len(o) for o in outs] == [9, 6, 7, 3]
    assert all(0 <= t < 256 for o in outs for t in o)
    assert spec.alloc.pages_in_use == 0 and not any(spec.slots)  # every page back, no cache kept
    # top_k = 1 makes the sampled distribution one-hot: rejection sampling must then give greedy
    one_hot = [SamplingParams(max_tokens=6, temperature=1.0, top_k=1, seed=3)] * 4
    assert spec.generate(prompts, one_hot) == spec.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))
    assert spec.alloc.pages_in_use == 0


@pytest.mark.unchecked
def test_bad_speculative_settings_are_refused(tiny_model):
    cfg, variables = tiny_model.cfg, tiny_model.variables
    with pytest.raises(ValueError, match="draft_tokens"):
        EngineConfig(draft_tokens=-1)
    with pytest.raises(ValueError, match="draft_tokens"):
        Engine(variables, cfg, engine_config(cfg, draft_tokens=2, max_context=30))  # no draft given
    with pytest.raises(ValueError, match="draft"):
        Engine(variables, cfg, engine_config(cfg), draft=init_draft(cfg, jax.random.key(0)))  # draft_tokens = 0
    narrow = dataclasses.replace(config.tiny(), hidden=32)
    with pytest.raises(ValueError, match="draft parameter"):
        Engine(variables, cfg, engine_config(cfg, draft_tokens=2, max_context=30),
               draft=jax.eval_shape(lambda: init_draft(narrow, jax.random.key(0))))


@pytest.mark.unchecked
def test_draft_file_round_trip(tiny_model, tmp_path):
    cfg = tiny_model.cfg
    draft = copy_draft(cfg)
    save_draft(tmp_path / "draft.npz", draft)
    loaded = load_draft(tmp_path / "draft.npz", cfg)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), draft, loaded))
    with pytest.raises(ValueError, match="draft .*draft.npz parameter"):
        load_draft(tmp_path / "draft.npz", dataclasses.replace(cfg, hidden=32))
    with pytest.raises(FileNotFoundError, match="nope.npz"):
        load_draft(tmp_path / "nope.npz", cfg)
