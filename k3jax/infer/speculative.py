"""Speculative decoding with the draft (Leviathan et al. arXiv 2211.17192; Chen et al. arXiv 2302.01318).

One cycle per sequence, all sequences in lockstep but each with its own acceptance:

1. The draft catches up on the positions the target verified last cycle (their true features),
   then drafts ``γ`` tokens ``d_j ~ q_j`` on its own outputs.
2. The target scores ``[x, d_1..d_γ]`` (``x`` the last emitted token) in one call: ``p_0..p_γ``.
3. ``d_j`` is accepted with probability ``min(1, p_{j-1}(d_j) / q_j(d_j))``, left to right; at the
   first rejection the next token is drawn from ``norm(max(0, p_{j-1} − q_j))``, and if all ``γ`` pass
   a bonus token from ``p_γ``. Every emitted token is then distributed exactly as the target's
   (warped) distribution, whatever the draft.
4. Rollback: the KDA state and conv tails cannot be rewound, so the verification call keeps each
   KDA layer's state after every one of the ``γ+1`` tokens (``keep_steps``: ``γ+1`` fp32 states
   ``[B,H,K,V]`` per KDA layer, and the conv inputs of all of them) and each row takes the one after
   its ``accepted + 1`` tokens (``select_step``); MLA caches, the target's and the MLA-only draft's,
   just rewind their lengths. One target call per cycle, whatever the rows accepted.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig
from k3jax.infer.cache import MLACache, cache_length, init_cache, select_step
from k3jax.infer.decode import check_sampling, chunked, decode_program, forward_cached, warp
from k3jax.infer.draft import Draft, draft_features, embed, target_head
from k3jax.infer.generate import DONE, as_variables, check_prompts, check_stop_tokens


def verify(key, p_logp, q_logp, drafts):
    """Accept a prefix of ``drafts [B,γ]``; returns ``(accepted [B], next_token [B])``.

    ``p_logp [B,γ+1,V]`` are the target's log-probabilities after ``x, d_1..d_γ``; ``q_logp [B,γ,V]``
    the draft's, from which ``drafts`` were sampled.
    """
    B, G = drafts.shape
    k_u, k_y = jax.random.split(key)
    p, q = jnp.exp(p_logp), jnp.exp(q_logp)
    pd = jnp.take_along_axis(p[:, :G], drafts[..., None], -1)[..., 0]  # [B, γ]
    qd = jnp.take_along_axis(q, drafts[..., None], -1)[..., 0]
    u = jax.random.uniform(k_u, (B, G))
    ok = u * qd < pd  # u < p/q without dividing by q
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # [B]
    p_k = jnp.take_along_axis(p, accepted[:, None, None], 1)[:, 0]  # [B, V]
    q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # all accepted: the bonus uses p_γ
    residual = jnp.maximum(p_k - jnp.take_along_axis(q_pad, accepted[:, None, None], 1)[:, 0], 0.0)
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_k)  # p == q: nothing rejected
    next_token = jax.random.categorical(k_y, jnp.log(residual), axis=-1).astype(jnp.int32)
    return accepted, next_token


def draft_call(draft_params, cfg, h, tokens, target_params, cache, valid=None):
    draft = Draft(cfg)
    emb = embed(target_params, tokens, cfg.compute_dtype)
    return draft.apply({"params": draft_params}, h, emb, target_head(cfg, target_params), cache=cache, valid=valid)


def fuse(draft_params, cfg, features):
    return Draft(cfg).apply({"params": draft_params}, features, method=Draft.fuse)


def _prefill(variables, draft_params, cfg, tokens, lengths, t_cache, d_cache, chunk):
    """Target over ``t_0..t_{n-2}``, draft over positions ``0..n-3``; returns the caches and the
    pending draft input (features at ``n-2``)."""
    B, T = tokens.shape
    targets, nexts = chunked(tokens[:, :-1], chunk), chunked(tokens[:, 1:], chunk)  # [N, B, C] each

    def body(carry, pieces):
        t_cache, d_cache, pend, s = carry
        piece, nxt = pieces
        C = piece.shape[1]
        n_t = jnp.clip(lengths - 1 - s, 0, C)
        (_, hidden, blocks), t_cache = forward_cached(variables, cfg, piece, t_cache, num_new=n_t,
                                                      return_hidden=True)
        feats = draft_features(cfg, hidden, blocks)  # [B, C, 3, D]
        valid = jnp.arange(C)[None] < jnp.clip(lengths - 2 - s, 0, C)[:, None]
        _, _, d_cache = draft_call(draft_params, cfg, fuse(draft_params, cfg, feats), nxt, variables["params"],
                                    d_cache, valid)
        at = jnp.clip(lengths - 2 - s, 0, C - 1)
        here = (lengths - 2 >= s) & (lengths - 2 < s + C)
        pend = jnp.where(here[:, None, None], jnp.take_along_axis(feats, at[:, None, None, None], 1)[:, 0], pend)
        return (t_cache, d_cache, pend, s + C), None

    pend = jnp.zeros((B, 3, cfg.hidden), cfg.compute_dtype)
    (t_cache, d_cache, pend, _), _ = jax.lax.scan(body, (t_cache, d_cache, pend, jnp.int32(0)), (targets, nexts))
    return t_cache, d_cache, pend


def draft_tokens(draw, draft_params, cfg, params, d_cache, pend_feat, pend_tok, u, gamma):
    """Catch up on the ``u`` pending positions, then draft ``γ`` tokens: ``(drafts, q_logp, d_cache)``;
    ``draw(j, logits) -> (token, q_logp)`` samples the j-th draft token from the draft's logits."""
    valid = jnp.arange(pend_tok.shape[1])[None] < u[:, None]
    start = d_cache.lengths
    logits, xs, d_cache = draft_call(draft_params, cfg, fuse(draft_params, cfg, pend_feat), pend_tok, params,
                                      d_cache, valid)
    pick = lambda a: jnp.take_along_axis(a, (u - 1)[:, None, None], 1)[:, 0]
    logit, o = pick(logits), pick(xs)
    drafts, q_logps = [], []
    for j in range(gamma):
        d, q_logp = draw(j, logit)
        drafts.append(d)
        q_logps.append(q_logp)
        if j + 1 < gamma:
            logits, xs, d_cache = draft_call(draft_params, cfg, o[:, None], d[:, None], params, d_cache)
            logit, o = logits[:, 0], xs[:, 0]
    return jnp.stack(drafts, 1), jnp.stack(q_logps, 1), d_cache.replace(lengths=start + u)


def _cycle(variables, draft_params, cfg, gamma, warp_args, stop_ids, max_new, carry):
    t_cache, d_cache, pend_feat, pend_tok, u, x, out, n_out, alive, key, stats = carry
    B = x.shape[0]
    key, k_draft, k_verify = jax.random.split(key, 3)
    keys = []
    for _ in range(gamma):
        k_draft, sub = jax.random.split(k_draft)
        keys.append(sub)

    def draw(j, logit):
        q_logp = warp(logit, *warp_args)
        return jax.random.categorical(keys[j], q_logp, axis=-1).astype(jnp.int32), q_logp

    drafts, q_logp, d_cache = draft_tokens(draw, draft_params, cfg, variables["params"], d_cache, pend_feat,
                                            pend_tok, u, gamma)
    tokens = jnp.concatenate([x[:, None], drafts], axis=1)  # [B, γ+1]
    (logits, hidden, blocks), steps = forward_cached(variables, cfg, tokens, t_cache, return_hidden=True,
                                                     keep_steps=True)
    p_logp = warp(logits.reshape(B * (gamma + 1), -1), *warp_args).reshape(B, gamma + 1, -1)
    accepted, y = verify(k_verify, p_logp, q_logp, drafts)
    t_cache = select_step(steps, accepted + 1)
    emitted = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], 1).at[jnp.arange(B), accepted].set(y)
    count = accepted + 1
    stop_at = jnp.where(jnp.isin(emitted, stop_ids) & (jnp.arange(gamma + 1)[None] < count[:, None]),
                        jnp.arange(gamma + 1)[None], gamma + 1).min(axis=1)
    n_emit = jnp.minimum(jnp.minimum(count, stop_at + 1), max_new - n_out) * alive
    slots = n_out[:, None] + jnp.arange(gamma + 1)[None]
    write = jnp.where(jnp.arange(gamma + 1)[None] < n_emit[:, None], slots, out.shape[1])  # else dropped
    out = out.at[jnp.arange(B)[:, None], write].set(emitted, mode="drop")
    stats = stats + jnp.stack([jnp.sum(count * alive), jnp.sum(alive)])
    n_out = n_out + n_emit
    alive = alive & (stop_at >= count) & (n_out < max_new)
    pend_feat = draft_features(cfg, hidden, blocks)
    return t_cache, d_cache, pend_feat, emitted, count, y, out, n_out, alive, key, stats


@decode_program(static_argnames=("cfg", "gamma", "max_new", "warp_args", "stop", "chunk"))
def _run(variables, draft_params, tokens, lengths, t_cache, d_cache, key, *, cfg, gamma, max_new, warp_args,
         stop, chunk):
    B = tokens.shape[0]
    t_cache, d_cache, pend0 = _prefill(variables, draft_params, cfg, tokens, lengths, t_cache, d_cache, chunk)
    x = jnp.take_along_axis(tokens, (lengths - 1)[:, None], 1)[:, 0]
    pend_feat = jnp.zeros((B, gamma + 1, 3, cfg.hidden), cfg.compute_dtype).at[:, 0].set(pend0)
    pend_tok = jnp.zeros((B, gamma + 1), jnp.int32).at[:, 0].set(x)
    stop_ids = jnp.asarray(stop if stop else (-2,), jnp.int32)
    carry = (t_cache, d_cache, pend_feat, pend_tok, jnp.ones((B,), jnp.int32), x,
             jnp.full((B, max_new), DONE, jnp.int32), jnp.zeros((B,), jnp.int32), jnp.ones((B,), bool), key,
             jnp.zeros((2,), jnp.int32))
    body = functools.partial(_cycle, variables, draft_params, cfg, gamma, warp_args, stop_ids, max_new)
    carry = jax.lax.while_loop(lambda c: jnp.any(c[8]), body, carry)
    return carry[6], carry[10]


def speculative_generate(params_or_variables: dict, cfg: ModelConfig, draft_params: dict, prompts, *,
                         max_new_tokens: int, gamma: int = 4, temperature: float = 1.0, top_k: int | None = None,
                         top_p: float = 1.0, stop_tokens=(), seed: int = 0, prefill_chunk: int = 2048):
    """Like ``generate`` (same sampling distribution), drafting ``gamma`` tokens per target call.

    Returns ``(token lists, mean accepted length)``: the tokens emitted per target verification,
    averaged over cycles (1 = nothing accepted, ``gamma + 1`` = everything).
    """
    rows = check_prompts(cfg, prompts, max_new_tokens, None)
    check_sampling(temperature, top_k, top_p)
    stop = check_stop_tokens(cfg, stop_tokens)
    if not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"gamma={gamma!r} must be an int >= 1")
    if min(map(len, rows)) < 2:
        raise ValueError("prompts must hold >= 2 tokens each for speculative decoding (the draft reads the "
                         "target's features at the second-to-last prompt token)")
    B, longest = len(rows), max(map(len, rows))
    tokens = np.zeros((B, longest), np.int32)
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = r
    # Verification overruns a row's emitted tokens by up to γ+1 per cycle, a finished row keeps cycling.
    max_len = longest + (max_new_tokens + 1) * (gamma + 1)
    t_cache = init_cache(cfg, B, max_len)
    d_cache = MLACache(latent=jnp.zeros((B, cache_length(max_len), cfg.mla.cache_width), cfg.compute_dtype),
                       lengths=jnp.zeros((B,), jnp.int32))
    out, stats = _run(as_variables(params_or_variables, cfg), draft_params, jnp.asarray(tokens),
                      jnp.asarray([len(r) for r in rows], jnp.int32), t_cache, d_cache, jax.random.key(seed),
                      cfg=cfg, gamma=gamma, max_new=max_new_tokens,
                      warp_args=(float(temperature), top_k, float(top_p)), stop=stop,
                      chunk=max(1, min(prefill_chunk, longest - 1)))
    stats = np.asarray(stats)
    return [[int(t) for t in row if t != DONE] for row in np.asarray(out)], float(stats[0] / max(stats[1], 1))
