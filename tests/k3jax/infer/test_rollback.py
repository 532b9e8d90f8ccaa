"""Rollback of a multi-token decode call without a re-run (``keep_steps`` + ``select_step``), and
speculative decoding's one target call per cycle; tiny() K3 and the tiny Kimi-Linear-shaped model
(the ``model`` fixture, conftest.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.infer import speculative
from k3jax.infer.cache import KDACache, MLACache, StepCache, init_cache, select_step
from k3jax.infer.decode import forward_cached
from k3jax.infer.draft import init_draft
from k3jax.layers.kda import KDASteps
from tests.tolerances import F32_RTOL, rel_rmse

PROMPT, STEPS = 6, 5  # cached tokens, then one call of STEPS = γ+1 tokens


@functools.partial(jax.jit, static_argnames=("cfg",))
def _rollback_and_rerun(variables, cfg, prompt, tokens, n):
    """The prompt's cache, then ``tokens`` with per-step states rolled back to ``n`` per row, and the
    same cache fed exactly those ``n`` tokens (a ragged call)."""
    with jax.default_matmul_precision("highest"):
        _, cache = forward_cached(variables, cfg, prompt, init_cache(cfg, prompt.shape[0], PROMPT + STEPS + 2))
        logits, steps = forward_cached(variables, cfg, tokens, cache, keep_steps=True)
        ref_logits, ref = forward_cached(variables, cfg, tokens, cache, num_new=n)
    return logits, steps, select_step(steps, n), ref_logits, ref


def test_select_step_equals_feeding_n_tokens(model):
    cfg, variables = model
    B = 4
    keys = jax.random.split(jax.random.key(0))
    prompt = jax.random.randint(keys[0], (B, PROMPT), 0, cfg.vocab_size, jnp.int32)
    tokens = jax.random.randint(keys[1], (B, STEPS), 0, cfg.vocab_size, jnp.int32)
    n = jnp.asarray([1, 3, STEPS, 2], jnp.int32)
    logits, steps, rolled, ref_logits, ref = _rollback_and_rerun(variables, cfg, prompt, tokens, n)

    assert isinstance(steps, StepCache)
    np.testing.assert_array_equal(np.asarray(rolled.lengths), PROMPT + np.asarray(n))
    np.testing.assert_array_equal(np.asarray(ref.lengths), PROMPT + np.asarray(n))
    H, K, W = cfg.kda.num_heads, cfg.kda.head_dim, cfg.kda.conv_size
    kinds = set()
    # Per layer; the scanned run's caches are stacked on a leading [repeats] axis (k3jax.infer.cache).
    per_layer = lambda c: jax.tree.leaves(c.layers, is_leaf=lambda x: isinstance(x, (KDACache, MLACache, KDASteps)))
    for got, want, stepped in zip(per_layer(rolled), per_layer(ref), per_layer(steps)):
        assert type(got) is type(want)
        if isinstance(want, KDACache):
            kinds.add("kda")
            assert isinstance(stepped, KDASteps)  # the documented memory: γ+1 states, W-1+γ+1 conv inputs
            assert stepped.states.shape[-5:] == (B, STEPS, H, K, K) and stepped.states.dtype == jnp.float32
            assert stepped.window.shape[-4:] == (3, B, W - 1 + STEPS, H * K)
            assert got.state.shape == want.state.shape and got.conv.shape == want.conv.shape
            assert rel_rmse(got.state, want.state) <= F32_RTOL
            assert rel_rmse(got.conv, want.conv) <= F32_RTOL
        else:
            kinds.add("mla")
            assert isinstance(want, MLACache)
            np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))
            for b in range(B):  # rows past a sequence's length are stale by design
                m = PROMPT + int(n[b])
                assert rel_rmse(got.latent[..., b, :m, :], want.latent[..., b, :m, :]) <= F32_RTOL, b
    assert kinds == {"kda", "mla"}
    for b in range(B):  # keeping the steps changes nothing the call computes
        m = int(n[b])
        assert rel_rmse(logits[b, :m], ref_logits[b, :m]) <= F32_RTOL, b


def test_one_target_call_per_cycle(tiny_model, monkeypatch):
    """Trace the speculative program and count the target calls inside a cycle (the earlier rollback
    traced two: the verification and the re-run)."""
    cfg, variables = tiny_model.cfg, tiny_model.variables
    calls, where = {"prefill": 0, "cycle": 0}, ["prefill"]
    real_forward, real_cycle, real_run = speculative.forward_cached, speculative._cycle, speculative._run

    def counted_forward(*args, **kwargs):
        calls[where[-1]] += 1
        return real_forward(*args, **kwargs)

    def marked_cycle(*args):
        where.append("cycle")
        try:
            return real_cycle(*args)
        finally:
            where.pop()

    def trace_only(*args, **kwargs):  # the program is traced, never compiled nor run
        real_run.trace(*args, **kwargs)
        B = args[2].shape[0]
        return jnp.zeros((B, kwargs["max_new"]), jnp.int32), jnp.ones((2,), jnp.int32)

    monkeypatch.setattr(speculative, "forward_cached", counted_forward)
    monkeypatch.setattr(speculative, "_cycle", marked_cycle)
    monkeypatch.setattr(speculative, "_run", trace_only)
    draft = init_draft(cfg, jax.random.key(0))
    # gamma=5 and 3 prompts: shapes no other test traces, so the trace is not served from a cache
    speculative.speculative_generate(variables, cfg, draft, [[1, 2, 3], [4, 5], [6, 7, 8, 9]], max_new_tokens=3,
                                     gamma=5)
    assert calls == {"prefill": 1, "cycle": 1}, calls
