"""Speculative decoding preserves the target distribution; greedy speculative == greedy plain;
the draft's [0 0 I] init and its acceptance-loss training."""

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.infer.decode import warp
from k3jax.infer.draft import acceptance_loss, init_draft, train_draft
from k3jax.infer.generate import generate
from k3jax.infer.speculative import speculative_generate, verify
from k3jax.model import Transformer

# Chi-square critical values at p = 0.001 (df: value), from the chi-square table.
CHI2_999 = {5: 20.515, 7: 24.322}


def _chi2(counts, probs):
    expected = probs * counts.sum()
    return float(np.sum((counts - expected) ** 2 / expected))


def test_verify_first_token_is_target_distributed():
    """A fixed target p and a poor draft q (mass on the wrong tokens): the first emitted token
    (the accepted d_1, or the residual resample) follows p_0."""
    V, G, N = 6, 3, 40000
    p = jnp.asarray([[0.4, 0.25, 0.15, 0.1, 0.07, 0.03]] * (G + 1))
    q = jnp.asarray([[0.02, 0.03, 0.05, 0.1, 0.3, 0.5]] * G)
    keys = jax.random.split(jax.random.key(0), N)

    def one(key):
        k_d, k_v = jax.random.split(key)
        drafts = jax.random.categorical(k_d, jnp.log(q))[None].astype(jnp.int32)  # [1, G]
        accepted, y = verify(k_v, jnp.log(p)[None], jnp.log(q)[None], drafts)
        return jnp.where(accepted[0] > 0, drafts[0, 0], y[0]), accepted[0]

    first, accepted = jax.jit(jax.vmap(one))(keys)
    counts = np.bincount(np.asarray(first), minlength=V)
    assert _chi2(counts, np.asarray(p[0])) < CHI2_999[V - 1], counts
    rate = float(np.mean(np.asarray(accepted) > 0))
    assert abs(rate - float(jnp.sum(jnp.minimum(p[0], q[0])))) < 0.01  # alpha = sum min(p, q)


def test_speculative_end_to_end_distribution(tiny_model):
    """Many copies of one prompt, one token each through a random (poor) draft: the emitted token's
    histogram matches the target's top-8 distribution."""
    cfg, variables = tiny_model.cfg, tiny_model.variables
    prompt, n, k = [3, 1, 4, 1, 5], 3000, 8
    draft = init_draft(cfg, jax.random.key(7))
    out, tau = speculative_generate(variables, cfg, draft, [prompt] * n, max_new_tokens=1, gamma=2,
                                    temperature=1.0, top_k=k, seed=1)
    logits = jax.jit(Transformer(cfg).apply)(variables, jnp.asarray([prompt]))[:, -1]
    probs = np.exp(np.asarray(warp(logits, 1.0, k, 1.0)))[0]
    support = np.flatnonzero(probs > 0)
    first = np.asarray([o[0] for o in out])
    assert np.isin(first, support).all()
    counts = np.asarray([(first == t).sum() for t in support])
    assert _chi2(counts, probs[support]) < CHI2_999[k - 1], (counts, probs[support])
    assert 1.0 <= tau <= 3.0


def test_greedy_speculative_equals_greedy(tiny_model):
    cfg, variables = tiny_model.cfg, tiny_model.variables
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1]]
    draft = init_draft(cfg, jax.random.key(3))
    with jax.default_matmul_precision("highest"):
        plain = generate(variables, cfg, prompts, max_new_tokens=7, temperature=0.0)
        spec, tau = speculative_generate(variables, cfg, draft, prompts, max_new_tokens=7, gamma=3, temperature=0.0)
    assert spec == plain
    assert 1.0 <= tau <= 4.0


def test_draft_init_and_training(tiny_model):
    cfg, variables = tiny_model.cfg, tiny_model.variables
    D = cfg.hidden
    fuse = init_draft(cfg, jax.random.key(0))["fuse"]
    np.testing.assert_array_equal(np.asarray(fuse), np.concatenate([np.zeros((2 * D, D)), np.eye(D)]))
    p = jnp.asarray([[0.7, 0.2, 0.1]])
    np.testing.assert_allclose(acceptance_loss(jnp.log(p), jnp.log(jnp.asarray([[0.1, 0.2, 0.7]]))), -np.log(0.4),
                               rtol=1e-6)
    # Learn to agree with the target on a fixed batch: the unrolled loss falls.
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (4, 24), 0, 256), np.int32)
    losses = []
    train_draft(variables, cfg, iter([tokens] * 30), num_steps=30, learning_rate=3e-3, steps=3,
                log=lambda i, loss, rates: losses.append(loss))
    assert losses[-1] < 0.8 * losses[0], losses
