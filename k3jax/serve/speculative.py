"""Speculative decoding in the engine: the draft proposes ``γ`` tokens per decoding slot, one
target call verifies all of them, each slot keeps what it accepted.

Per step, one program over all ``num_slots`` lanes (``spec_decode``, one per page bucket):

1. Draft: each slot's draft catches up on the ``u`` positions its target verified last step
   (their true features, ``k3jax.infer.speculative.draft_tokens``), then drafts ``γ`` tokens from
   its own warped distribution (the request's temperature / top-k / top-p; greedy: its argmax).
2. Verify: the target reads ``[x, d_1..d_γ]`` (``x`` the slot's last token) with ``keep_steps``;
   ``verify`` accepts a prefix per row (greedy rows: exact argmax match; sampled rows: rejection
   sampling, so every token is distributed as the engine's plain sampler would draw it).
3. Keep: ``keep = min(accepted + 1, limit)``, cut after a stop id. ``limit`` is the request's
   remaining ``max_tokens`` and the distance to its next snapshot boundary, so a run never
   passes either (cutting an exact run anywhere is still exact: each token, given everything
   before it, follows the target). Only the ``keep`` rows are scattered into the MLA pages
   (rejected rows never reach a page) and each slot's KDA state becomes the one after its
   ``keep`` tokens (``select_step``): the state a plain decode would have, so snapshots taken at
   boundaries are exact.

The draft's state per slot (``DraftSlots``): its own MLA rows (one layer), their count, and the
target features of the positions it has not read yet. Draft rows are numbered from the request's
first computed token (RoPE is relative, so the shift changes nothing): a prefix reused from the
index was never seen by this slot's draft, which then starts without that context (correct, but
it accepts less until it has read some tokens). Prefill chunks feed the draft too
(``spec_prefill``), so a cold prompt arrives at decode with a full draft context.
"""

from __future__ import annotations

import typing

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from k3jax.config import ModelConfig
from k3jax.infer.cache import MLACache, select_step
from k3jax.infer.decode import decode_program, forward_cached
from k3jax.infer.draft import check_draft, draft_features
from k3jax.infer.speculative import draft_call, draft_tokens, fuse, verify
from k3jax.serve.pages import MLAPages, PagedCache, gather, scatter
from k3jax.serve.params import MAX_STOP_IDS
from k3jax.serve.step import RowSampling, lanes_forward, warp_rows


@typing.no_type_check
@flax.struct.dataclass
class DraftSlots:
    latent: Float[Array, "S L C"]  # the draft's MLA rows per slot (+1 scratch slot)
    lengths: Int[Array, "S"]  # rows each slot's draft has read
    features: Float[Array, "S G 3 D"]  # target features of the positions it has still to read


def init_draft_slots(cfg: ModelConfig, num_slots: int, max_len: int, gamma: int) -> DraftSlots:
    dt = cfg.compute_dtype
    return DraftSlots(latent=jnp.zeros((num_slots + 1, max_len, cfg.mla.cache_width), dt),
                      lengths=jnp.zeros((num_slots + 1,), jnp.int32),
                      features=jnp.zeros((num_slots + 1, gamma + 1, 3, cfg.hidden), dt))


def _draft_cache(d: DraftSlots, slot_ids: Int[Array, "B"], width: int, lengths: Int[Array, "B"]) -> MLACache:
    return MLACache(latent=d.latent[slot_ids, :width], lengths=lengths)


def _put_draft(d: DraftSlots, cache: MLACache, slot_ids: Int[Array, "B"], features) -> DraftSlots:
    """Write the lanes' draft rows, counts and pending features back to their slots."""
    width = cache.latent.shape[1]
    return d.replace(latent=d.latent.at[slot_ids, :width].set(cache.latent),
                     lengths=d.lengths.at[slot_ids].set(cache.lengths), features=features)


def _row_keys(s: RowSampling, salt: int):
    """Per-row keys from the request's seed and position (a request's draws never depend on its batch)."""
    return jax.vmap(lambda seed, pos: jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), pos), salt))(
        s.seed, s.position)


@decode_program(static_argnames=("cfg",), donate_argnames=("paged", "drafts"))
def spec_prefill(variables: dict, draft: dict, paged: PagedCache, drafts: DraftSlots, tokens: Int[Array, "B T"],
                 num_new: Int[Array, "B"], draft_ids: Int[Array, "B T"], draft_count: Int[Array, "B"],
                 resume: Int[Array, "B"], slot_ids: Int[Array, "B"], page_table: Int[Array, "B N"],
                 lengths: Int[Array, "B"], sampling: RowSampling, *, cfg: ModelConfig):
    """A prefill chunk (``model_step``) that also feeds the draft: draft row ``i`` reads the
    features at ``i`` and token ``i + 1``. With ``resume``, the slot's pending features (the
    previous chunk's last position) pair with this chunk's first token; without it (a request's
    first chunk) the draft starts afresh. The chunk's last features become pending."""
    sampled, paged, (hidden, blocks) = lanes_forward(variables, paged, tokens, num_new, slot_ids, page_table,
                                                     lengths, sampling, cfg=cfg)
    feats = draft_features(cfg, hidden, blocks)  # [B, T, 3, D]
    shifted = jnp.concatenate([drafts.features[slot_ids, :1], feats[:, :-1]], axis=1)
    h = jnp.where(resume[:, None, None, None] > 0, shifted, feats)
    width = page_table.shape[1] * _page_size(paged)
    cache = _draft_cache(drafts, slot_ids, width, jnp.where(resume > 0, drafts.lengths[slot_ids], 0))
    valid = jnp.arange(tokens.shape[1])[None] < draft_count[:, None]
    _, _, cache = draft_call(draft, cfg, fuse(draft, cfg, h), draft_ids, variables["params"], cache, valid)
    last = jnp.take_along_axis(feats, jnp.maximum(num_new - 1, 0)[:, None, None, None], axis=1)[:, 0]
    drafts = _put_draft(drafts, cache, slot_ids, drafts.features.at[slot_ids, 0].set(last))
    return sampled, paged, drafts


def _page_size(paged: PagedCache) -> int:
    return next(c.pages.shape[-2] for c in jax.tree.leaves(paged.layers, is_leaf=lambda x: isinstance(x, MLAPages))
                if isinstance(c, MLAPages))


def _verify_cycle(variables: dict, draft: dict, paged: PagedCache, drafts: DraftSlots, pending: Int[Array, "B G"],
                  num_pending: Int[Array, "B"], limit: Int[Array, "B"], stop_ids: Int[Array, "B S"],
                  slot_ids: Int[Array, "B"], page_table: Int[Array, "B N"], lengths: Int[Array, "B"],
                  sampling: RowSampling, *, cfg: ModelConfig, gamma: int):
    """One draft-and-verify cycle (module docstring). ``pending[b, :num_pending[b]]`` are the tokens
    after the slot's pending features, the last of them ``x``; ``limit[b] >= 1`` caps the tokens
    kept. Returns ``(kept [B, γ+1] (-1 past them), accepted drafts [B], keep [B], paged, drafts)``."""
    B, G = pending.shape
    u = jnp.maximum(num_pending, 1)
    width = page_table.shape[1] * _page_size(paged)
    d_cache = _draft_cache(drafts, slot_ids, width, drafts.lengths[slot_ids])
    keys = _row_keys(sampling, 1)

    def draw(j, logit):
        q_logp = warp_rows(logit, sampling)
        d = jax.vmap(jax.random.categorical)(jax.vmap(lambda k: jax.random.fold_in(k, j))(keys), q_logp)
        return d.astype(jnp.int32), q_logp

    proposed, q_logp, d_cache = draft_tokens(draw, draft, cfg, variables["params"], d_cache,
                                             drafts.features[slot_ids], pending, u, gamma)
    x = jnp.take_along_axis(pending, (u - 1)[:, None], axis=1)
    tokens = jnp.concatenate([x, proposed], axis=1)  # [B, γ+1]
    (logits, hidden, blocks), steps = forward_cached(variables, cfg, tokens, gather(paged, slot_ids, page_table, lengths),
                                                     return_hidden=True, keep_steps=True)
    per_token = jax.tree.map(lambda a: jnp.repeat(a, G, axis=0), sampling)
    p_logp = warp_rows(logits.reshape(B * G, -1), per_token).reshape(B, G, -1)
    accepted, y = jax.vmap(lambda k, p, q, d: verify(k, p[None], q[None], d[None]))(
        _row_keys(sampling, 2), p_logp, q_logp, proposed)
    accepted, y = accepted[:, 0], y[:, 0]
    emitted = jnp.concatenate([proposed, jnp.zeros((B, 1), jnp.int32)], 1).at[jnp.arange(B), accepted].set(y)
    at = jnp.arange(G)[None]
    stops = jnp.any(emitted[..., None] == stop_ids[:, None], axis=-1)
    keep = jnp.minimum(jnp.minimum(accepted + 1, limit), jnp.where(stops, at + 1, G).min(axis=1))
    paged = scatter(paged, select_step(steps, jnp.maximum(keep, 1)), slot_ids, page_table, lengths, keep, G)
    drafts = _put_draft(drafts, d_cache, slot_ids,
                        drafts.features.at[slot_ids].set(draft_features(cfg, hidden, blocks)))
    return jnp.where(at < keep[:, None], emitted, -1), accepted, keep, paged, drafts


@decode_program(static_argnames=("cfg", "gamma", "max_cycles"), donate_argnames=("paged", "drafts"))
def spec_decode(variables: dict, draft: dict, paged: PagedCache, drafts: DraftSlots, pending: Int[Array, "B G"],
                num_pending: Int[Array, "B"], budget: Int[Array, "B"], cycles: Int[Array, ""],
                stop_ids: Int[Array, "B S"], slot_ids: Int[Array, "B"], page_table: Int[Array, "B N"],
                lengths: Int[Array, "B"], sampling: RowSampling, *, cfg: ModelConfig, gamma: int, max_cycles: int):
    """Up to ``cycles <= max_cycles`` draft-and-verify cycles in one device loop (as ``decode_block``
    runs plain steps): lane ``b`` keeps at most ``budget[b]`` tokens in all (0: idle) and stops
    after a stop id; a stopped lane's slot id becomes the scratch slot. Returns ``[K, B, γ + 2]``:
    per cycle the kept tokens (-1 past them) and, last, the drafts accepted (-1: the lane was done)."""
    B, G = pending.shape
    scratch = drafts.lengths.shape[0] - 1

    def body(carry):
        i, pending, num_pending, budget, lengths, paged, drafts, out = carry
        alive = budget > 0
        kept, accepted, keep, paged, drafts = _verify_cycle(
            variables, draft, paged, drafts, pending, num_pending, jnp.clip(budget, 1, G), stop_ids,
            jnp.where(alive, slot_ids, scratch), page_table, lengths, sampling.replace(position=lengths + 1),
            cfg=cfg, gamma=gamma)
        keep = jnp.where(alive, keep, 0)
        kept = jnp.where(alive[:, None], kept, -1)
        out = out.at[i].set(jnp.concatenate([kept, jnp.where(alive, accepted, -1)[:, None]], axis=1))
        stopped = jnp.any((kept[..., None] == stop_ids[:, None]) & (kept[..., None] >= 0), axis=(1, 2))
        budget = jnp.where(stopped, 0, budget - keep)
        pending = jnp.where(alive[:, None], jnp.maximum(kept, 0), pending)
        num_pending = jnp.where(alive, keep, num_pending)
        return i + 1, pending, num_pending, budget, lengths + keep, paged, drafts, out

    def cond(carry):
        return (carry[0] < cycles) & jnp.any(carry[3] > 0)

    out = jnp.full((max_cycles, B, G + 1), -1, jnp.int32)
    carry = (jnp.int32(0), pending, num_pending, budget, lengths, paged, drafts, out)
    _, _, _, _, _, paged, drafts, out = jax.lax.while_loop(cond, body, carry)
    return out, paged, drafts


class Speculator:
    """The engine's speculative side: the draft, its per-slot state, and the host half of a step."""

    def __init__(self, engine, draft: dict):
        ecfg = engine.ecfg
        check_draft(engine.cfg, draft)
        self.engine, self.draft, self.gamma = engine, draft, ecfg.draft_tokens
        self.drafts: DraftSlots | None = None  # allocated by reset(), with the engine's cache

    def reset(self) -> None:
        ecfg = self.engine.ecfg
        self.drafts = init_draft_slots(self.engine.cfg, ecfg.num_slots, ecfg.max_pages * ecfg.page_size, self.gamma)

    def prefill(self, tokens, num_new, lanes: dict, slot_ids, table, lengths, sampling):
        """Dispatch a prefill chunk that feeds the draft as well: the sampled tokens on the device."""
        e = self.engine
        draft_ids, count = np.zeros_like(tokens), np.zeros_like(num_new)
        resume = np.zeros_like(num_new)
        for lane, r in lanes.items():
            n, s = int(num_new[lane]), r.length
            resume[lane] = r.draft_pending > 0
            ids = r.prompt[s:s + n] if resume[lane] else r.prompt[s + 1:s + n]
            draft_ids[lane, :len(ids)], count[lane] = ids, len(ids)
            r.draft_pending = 1  # the chunk's last features wait for the next token
        out, e.paged, self.drafts = spec_prefill(e.variables, self.draft, e.paged, self.drafts, tokens, num_new,
                                                 draft_ids, count, resume, slot_ids, table, lengths, sampling,
                                                 cfg=e.cfg)
        return out

    def decode(self, reqs: list):
        """Dispatch draft-and-verify cycles for ``reqs`` (up to ``decode_steps`` of them while no
        prompt waits, else one): ``(tokens on the device, what to do with them)``."""
        e, G = self.engine, self.gamma + 1
        S, every = e.ecfg.num_slots, e.ecfg.snapshot_every * e.ecfg.page_size
        cycles = e.ecfg.decode_steps if e.quiet() else 1
        slot_ids, budget = np.full((S,), S, np.int32), np.zeros((S,), np.int32)
        pending, num_pending = np.zeros((S, G), np.int32), np.zeros((S,), np.int32)
        stop = np.full((S, MAX_STOP_IDS), -1, np.int32)
        for r in reqs:
            slot_ids[r.slot] = r.slot
            to_snapshot = (r.length // every + 1) * every - r.length  # runs end where snapshots are taken
            budget[r.slot] = min(G * cycles, r.params.max_tokens - len(r.generated), to_snapshot)
            u = r.draft_pending
            pending[r.slot, :u], num_pending[r.slot] = r.tokens[r.length - u + 1:r.length + 1], u
            stop[r.slot, :len(r.params.stop_token_ids)] = r.params.stop_token_ids
        lanes = {r.slot: r for r in reqs}
        # the last cycle reads γ+1 positions from at most length + budget - 1
        lengths, sampling, table = e.lane_rows(slot_ids, budget + G, lanes, decode=True)
        out, e.paged, self.drafts = spec_decode(e.variables, self.draft, e.paged, self.drafts, pending, num_pending,
                                                budget, np.int32(cycles), stop, slot_ids, table, lengths, sampling,
                                                cfg=e.cfg, gamma=self.gamma, max_cycles=e.ecfg.decode_steps)

        def done(out):
            for r in reqs:
                for row in out[:, r.slot]:
                    if row[G] < 0 or self._take(r, [int(t) for t in row[:G] if t >= 0], int(row[G])):
                        break
        return out, done

    def _take(self, r, new: list[int], accepted: int) -> bool:
        """One cycle's kept tokens into ``r``; True when ``r`` finished (a stop string may end it early)."""
        e = self.engine
        e.stats["draft_verifies"] += 1
        e.stats["draft_accepted"] += accepted
        r.device_length, r.draft_pending = r.length + len(new), len(new)
        for t in new:
            r.length += 1
            if e._advance(r, t):
                return True
        return False
