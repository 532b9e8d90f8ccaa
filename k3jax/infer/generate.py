"""Batched text generation: ragged prompts → chunked prefill → a jitted decode loop.

``generate(variables, cfg, prompts, max_new_tokens=…, temperature=…, top_k=…, top_p=…,
stop_tokens=…, seed=…, stream=…)``:

1. Validate everything on the host (``ValueError`` before anything compiles).
2. Right-pad the prompts; each row keeps its own length, so every sequence decodes exactly as its
   own full forward would (``tests/k3jax/infer/test_decode.py``).
3. Prefill in chunks, sample the first token from each row's last prompt position.
4. ``lax.while_loop`` decodes one token per row per step until every row has hit a stop token or
   ``max_new_tokens``; ``stream(step, tokens [B], alive [B])`` is called from inside the loop.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jaxtyping import Array, Float

from k3jax.config import ModelConfig
from k3jax.infer.cache import Cache, init_cache
from k3jax.infer.decode import check_sampling, decode_layout, decode_program, forward_cached, prefill, sample
from k3jax.model import Transformer

DONE = -1  # output slot of a row that has already stopped


def as_variables(params_or_variables: dict, cfg: ModelConfig) -> dict:
    """``{"params", "balance"}``; bare params get zero router biases (what a fresh init holds)."""
    if "params" in params_or_variables:
        return params_or_variables
    shapes = jax.eval_shape(Transformer(cfg).init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32))
    balance = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes.get("balance", {}))
    return {"params": params_or_variables, "balance": balance}


def check_prompts(cfg: ModelConfig, prompts, max_new_tokens, max_len: int | None) -> list[list[int]]:
    """The prompts as lists of ints, or ``ValueError`` naming what is wrong."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1")
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    rows = []
    for i, p in enumerate(prompts):
        ids = np.asarray(p)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"prompts[{i}] must be a non-empty 1-D list of token ids, got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompts[{i}] must hold integer token ids, got dtype {ids.dtype}")
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ValueError(f"prompts[{i}] ids must lie in [0, vocab_size={cfg.vocab_size}), "
                             f"got [{ids.min()}, {ids.max()}]")
        rows.append([int(t) for t in ids])
    longest = max(map(len, rows))
    limit = cfg.max_position if max_len is None else max_len
    if longest + max_new_tokens > limit:
        raise ValueError(f"the longest prompt ({longest} tokens) plus max_new_tokens={max_new_tokens} must fit "
                         f"the cache length {limit} (max_len, or the model's max_position)")
    return rows


def check_stop_tokens(cfg: ModelConfig, stop_tokens) -> tuple[int, ...]:
    stop = tuple(int(t) for t in (stop_tokens or ()))
    bad = [t for t in stop if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ValueError(f"stop_tokens must lie in [0, vocab_size={cfg.vocab_size}), got {bad}")
    return stop


@decode_program(static_argnames=("cfg", "max_new", "temperature", "top_k", "top_p", "stop", "streaming", "chunk"))
def _run(variables, tokens, lengths, cache: Cache, key, embeddings=None, *, cfg, max_new, temperature, top_k, top_p,
         stop, streaming, chunk):
    """Prefill, then the decode loop; returns ``[B, max_new]`` tokens with ``DONE`` after a stop."""
    B = tokens.shape[0]
    stop_ids = jnp.asarray(stop if stop else (-2,), jnp.int32)
    last, cache = prefill(variables, cfg, tokens, lengths, cache, chunk=chunk, embeddings=embeddings)

    def emit(i, tok, alive):
        if streaming:
            io_callback(_stream_hook, None, i, tok, alive, ordered=True)
        return tok, alive & ~jnp.isin(tok, stop_ids)

    key, sub = jax.random.split(key)
    alive = jnp.ones((B,), bool)
    tok, still = emit(0, sample(sub, last, temperature, top_k, top_p), alive)
    out = jnp.full((B, max_new), DONE, jnp.int32).at[:, 0].set(tok)

    def cond(carry):
        i, _, alive, *_ = carry
        return (i < max_new) & jnp.any(alive)

    def body(carry):
        i, tok, alive, out, cache, key = carry
        key, sub = jax.random.split(key)
        if temperature == 0:  # the argmax only: the greedy head never stores the logits
            tok, cache = forward_cached(variables, cfg, tok[:, None], cache, greedy=True)
            tok = tok[:, 0]
        else:
            logits, cache = forward_cached(variables, cfg, tok[:, None], cache)
            tok = sample(sub, logits[:, 0], temperature, top_k, top_p)
        tok, still = emit(i, tok, alive)
        out = out.at[:, i].set(jnp.where(alive, tok, DONE))
        return i + 1, tok, still, out, cache, key

    carry = (jnp.int32(1), tok, still, out, cache, key)
    return jax.lax.while_loop(cond, body, carry)[3]


_STREAM: list[Callable | None] = [None]


def _stream_hook(i, tok, alive):
    if _STREAM[0] is not None:
        _STREAM[0](int(i), np.asarray(tok), np.asarray(alive))


def generate(params_or_variables: dict, cfg: ModelConfig, prompts: Sequence[Sequence[int | np.integer] | np.ndarray],
             *, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0,
             stop_tokens: Sequence[int] = (), seed: int = 0,
             stream: Callable[[int, np.ndarray, np.ndarray], None] | None = None,
             max_len: int | None = None, prefill_chunk: int = 2048,
             embeddings: Float[Array, "B T D"] | None = None) -> list[list[int]]:
    """Continue each prompt by up to ``max_new_tokens`` tokens (a stop token is kept, then the row ends).

    ``temperature == 0`` is greedy; ``top_k`` / ``top_p`` restrict the sampling distribution.
    ``stream(step, tokens, alive)`` sees each step's sampled tokens ``[B]`` and which rows were still
    running before it (rows that had stopped earlier are not alive). ``embeddings`` ``[B, T, D]``
    (T the longest prompt, rows right-padded) replace the prompts' token embeddings at prefill: the
    prompts with their images' features spliced in (``MultimodalTransformer.embed``).
    Decoding runs on per-layer weights (``decode_layout``): a scanned tree is converted on every
    call, one copy of its stacked weights; callers that generate often pass the converted pair.
    """
    rows = check_prompts(cfg, prompts, max_new_tokens, max_len)
    check_sampling(temperature, top_k, top_p)
    stop = check_stop_tokens(cfg, stop_tokens)
    if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk={prefill_chunk!r} must be an int >= 1")
    B, longest = len(rows), max(map(len, rows))
    tokens = np.zeros((B, longest), np.int32)
    for b, r in enumerate(rows):
        tokens[b, :len(r)] = r
    lengths = jnp.asarray([len(r) for r in rows], jnp.int32)
    if embeddings is not None and tuple(embeddings.shape) != (B, longest, cfg.hidden):
        raise ValueError(f"embeddings must have shape [B, T, D] = {(B, longest, cfg.hidden)} (T the longest "
                         f"prompt), got {tuple(embeddings.shape)}")
    variables, cfg = decode_layout(as_variables(params_or_variables, cfg), cfg)
    cache = init_cache(cfg, B, max_len or longest + max_new_tokens)
    _STREAM[0] = stream
    try:
        out = _run(variables, jnp.asarray(tokens), lengths, cache,
                   jax.random.key(seed), embeddings, cfg=cfg, max_new=max_new_tokens, temperature=float(temperature),
                   top_k=top_k, top_p=float(top_p), stop=stop, streaming=stream is not None,
                   chunk=min(prefill_chunk, longest))
        out = np.asarray(out)
    finally:
        _STREAM[0] = None
    return [[int(t) for t in row if t != DONE] for row in out]
