"""One engine model call: a batch of lanes, each continuing one slot by up to ``T`` tokens, and the
next token of every lane sampled on the device with that lane's own parameters.

Shapes are static per (lanes, T, pages-per-lane bucket), so the engine compiles a handful of
programs at warm-up and none afterwards. A lane with ``num_new = 0`` is idle: its KDA state and
pages are left as they were (its padding rows land in the trash page).

Sampling is per row (requests in one batch ask for different things): temperature (0: greedy,
the argmax, lowest id on ties, as ``k3jax.infer.decode.sample``), then top-k (0: off), then
nucleus top-p, each row drawing from its own key ``fold_in(key(seed), position)`` so a request's
tokens do not depend on what else shares its batch.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, UInt32

from k3jax.config import ModelConfig
from k3jax.infer.decode import decode_program, forward_cached, head
from k3jax.serve.pages import PagedCache, gather, scatter


@flax.struct.dataclass
class RowSampling:
    temperature: Float[ArrayLike, "B"]  # 0: greedy
    top_k: Int[ArrayLike, "B"]  # 0: all tokens
    top_p: Float[ArrayLike, "B"]  # in (0, 1]
    seed: UInt32[ArrayLike, "B"]  # uint32 seed of the row's request
    position: Int[ArrayLike, "B"]  # the sampled token's position (folded into the key)


def sample_rows(logits: Float[Array, "B V"], s: RowSampling) -> Int[Array, "B"]:
    """One token per row from its warped distribution (see the module docstring)."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # The sort over the vocabulary is skipped when every row is greedy.
    return jax.lax.cond(jnp.any(s.temperature > 0), lambda: _draw(logits, s, greedy), lambda: greedy)


def warp_rows(logits: Float[Array, "B V"], s: RowSampling) -> Float[Array, "B V"]:
    """Each row's sampling distribution as log-probabilities (a greedy row: one-hot on its argmax),
    what speculative verification compares (``k3jax.infer.decode.warp`` with per-row parameters)."""
    logits = logits.astype(jnp.float32)
    hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=bool)
    greedy = jnp.where(hot, 0.0, -jnp.inf)
    sampled = lambda: jnp.where((s.temperature > 0)[:, None], jax.nn.log_softmax(_warped(logits, s), axis=-1), greedy)
    return jax.lax.cond(jnp.any(s.temperature > 0), sampled, lambda: greedy)


def _warped(logits: Float[Array, "B V"], s: RowSampling) -> Float[Array, "B V"]:
    """Tempered logits, -inf outside each row's top-k and nucleus."""
    V = logits.shape[-1]
    z = logits / jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    ranked = -jnp.sort(-z, axis=-1)  # [B, V] descending
    rank = jnp.arange(V)[None]
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, V), V)[:, None]
    in_k = rank < k
    probs = jax.nn.softmax(jnp.where(in_k, ranked, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each ranked token
    kept = jnp.sum(in_k & (before < s.top_p[:, None]), axis=-1, keepdims=True)  # >= 1: the top token
    threshold = jnp.take_along_axis(ranked, kept - 1, axis=-1)  # [B, 1]
    return jnp.where(z >= threshold, z, -jnp.inf)


def _draw(logits: Float[Array, "B V"], s: RowSampling, greedy: Int[Array, "B"]) -> Int[Array, "B"]:
    z = _warped(logits, s)
    keys = jax.vmap(lambda seed, pos: jax.random.fold_in(jax.random.key(seed), pos))(s.seed, s.position)
    drawn = jax.vmap(jax.random.categorical)(keys, z).astype(jnp.int32)
    return jnp.where(s.temperature > 0, drawn, greedy)


def _model_step(variables: dict, paged: PagedCache, tokens: Int[Array, "B T"], num_new: Int[Array, "B"],
               slot_ids: Int[Array, "B"], page_table: Int[Array, "B N"], lengths: Int[Array, "B"],
               sampling: RowSampling, *, cfg: ModelConfig) -> tuple[Int[Array, "B"], PagedCache]:
    """Feed ``tokens[b, :num_new[b]]`` to slot ``slot_ids[b]`` (``lengths[b]`` tokens cached, in the
    pages ``page_table[b]``); returns the token sampled after each lane's last new token."""
    sampled, paged, _ = lanes_forward(variables, paged, tokens, num_new, slot_ids, page_table, lengths, sampling,
                                      cfg=cfg)
    return sampled, paged


def lanes_forward(variables: dict, paged: PagedCache, tokens: Int[Array, "B T"], num_new: Int[Array, "B"],
                  slot_ids: Int[Array, "B"], page_table: Int[Array, "B N"], lengths: Int[Array, "B"],
                  sampling: RowSampling, *, cfg: ModelConfig):
    """``_model_step``'s body, also returning ``(hidden, blocks)`` of every new position (the
    speculative draft reads them as its features; unused, XLA drops them)."""
    cache = gather(paged, slot_ids, page_table, lengths)
    (_, hidden, blocks), cache = forward_cached(variables, cfg, tokens, cache, num_new=num_new, return_hidden=True)
    # Only each lane's last position needs the output head (the [B, T, V] logits are dead code).
    at = jnp.take_along_axis(hidden, jnp.maximum(num_new - 1, 0)[:, None, None], axis=1)  # [B, 1, D]
    logits = head(variables, cfg, at)[:, 0]  # [B, V]
    paged = scatter(paged, cache, slot_ids, page_table, lengths, num_new, tokens.shape[1])
    return sample_rows(logits, sampling), paged, (hidden, blocks)


model_step = decode_program(static_argnames=("cfg",), donate_argnames=("paged",))(_model_step)


@decode_program(static_argnames=("cfg", "max_steps"), donate_argnames=("paged",))
def decode_block(variables: dict, paged: PagedCache, tokens: Int[Array, "B"], limit: Int[Array, "B"],
                 stop_ids: Int[Array, "B S"], slot_ids: Int[Array, "B"], page_table: Int[Array, "B N"],
                 lengths: Int[Array, "B"], sampling: RowSampling, *, cfg: ModelConfig,
                 max_steps: int) -> tuple[Int[Array, "K B"], PagedCache]:
    """Up to ``limit[b] <= max_steps`` decode steps per lane in one device loop: a lane stops after
    its limit or a token of ``stop_ids[b]`` (pad with -1). Returns the sampled tokens ``[K, B]``,
    -1 where a lane had stopped; the loop ends as soon as every lane has.

    One call per step from the host costs a sync and a dispatch per token (on the H200 a Python
    loop of decode steps was 3x slower than the same loop on the device); ``limit = 1`` is a
    plain step, for when prompts are waiting to be prefilled between steps.
    """
    B = tokens.shape[0]

    def body(carry):
        i, tok, alive, lengths, paged, out = carry
        n = alive.astype(jnp.int32)
        rows = sampling.replace(position=sampling.position + i)
        new, paged = _model_step(variables, paged, tok[:, None], n, slot_ids, page_table, lengths, rows, cfg=cfg)
        out = out.at[i].set(jnp.where(alive, new, -1))
        stopped = jnp.any(new[:, None] == stop_ids, axis=1)
        alive = alive & ~stopped & (i + 1 < limit)
        return i + 1, jnp.where(alive, new, tok), alive, lengths + n, paged, out

    def cond(carry):
        return (carry[0] < max_steps) & jnp.any(carry[2])

    out = jnp.full((max_steps, B), -1, jnp.int32)
    carry = (jnp.int32(0), tokens, limit > 0, lengths, paged, out)
    _, _, _, _, paged, out = jax.lax.while_loop(cond, body, carry)
    return out, paged
