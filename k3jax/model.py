"""The Kimi-family decoder-only language model (SPEC §1-5), one code path for K3, Kimi-Linear and K2.

``Transformer(cfg).apply(variables, tokens, segment_ids=None, return_hidden=False)``:

1. Embed the tokens (untied embedding, no scaling).
2. Run the decoder layers in order (KDA or MLA mixer, dense MLP or MoE), the residual stream
   being Block AttnRes (K3) or the plain pre-norm residual (the others).
3. Output mix (AttnRes only), final RMSNorm, untied head → fp32 logits ``[B, T, V]``.

Decode: ``Transformer(cfg).apply(variables, tokens, caches, method=Transformer.decode)`` continues
per-layer caches (``k3jax.infer.cache``; prefill is the same call on a fresh cache) and returns
``(logits, new_caches)``; the cache-free ``__call__`` is the full forward.

Where the layer pattern repeats (``cfg.scan_layers``, ``k3jax.layout``), each run of the scan plan
is one ``nn.scan`` (``k3jax.layers.stack``, module ``stack_{start}``); the other layers run one by one.

``variables = {"params": …, "balance": …}`` (docs/params.md); run with ``mutable=["stats"]`` to
collect router loads, QB histograms and MLA max logits. ``remat`` ("none" | "layer" | "moe") is a
training choice, not part of the model config.
"""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify
from jaxtyping import Array, ArrayLike, Float, Int

from k3jax.config import ModelConfig
from k3jax.layers.attn_res import ResidualStream, attn_res
from k3jax.layers.block import DecoderLayer
from k3jax.layers.embed import TokenEmbed
from k3jax.layers.linear import constrain, einsum, proj
from k3jax.layers.mixed_input import kernel_runs, mixed_input
from k3jax.layers.norm import norm
from k3jax.layers.stack import layer_stack, run_stack
from k3jax.layout import scan_plan
from pallas_kernels.head_argmax import kernel_gpu as head_argmax

REMAT = ("none", "layer", "moe")
_DEVICE_ID_CHECKS = [False]


@contextlib.contextmanager
def device_id_checks():
    """Inside it, a traced call of the model stages its token-range check (a ``checkify.debug_check``,
    reported when the call is wrapped in ``checkify.checkify``) — for functions traced inside (jit traces
    on the first call). Off by default: the check's effect marks the program as effectful, and jax then
    dispatches every call of it in Python, not C++ (a ``small()`` decode loop's ~330 arrays: milliseconds
    a call; benchmarks/RESULTS.md, stop 74). The train step and ``generate`` check ids on the host."""
    _DEVICE_ID_CHECKS.append(True)
    try:
        yield
    finally:
        _DEVICE_ID_CHECKS.pop()


def validate_inputs(cfg: ModelConfig, tokens, segment_ids) -> tuple[Array, Array | None]:
    """Raise ``ValueError`` (at trace time) for tokens/segment_ids the model cannot run; else return them
    as jax arrays (host arrays, e.g. the data pipeline's numpy batches, are accepted)."""
    if not hasattr(tokens, "shape") or tokens.ndim != 2:
        raise ValueError(f"tokens must be a [B, T] integer array, got {getattr(tokens, 'shape', type(tokens))}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must have an integer dtype (int32), got {tokens.dtype}")
    if not isinstance(tokens, jax.core.Tracer):
        ids = np.asarray(tokens)
        if ids.size and (ids.min() < 0 or ids.max() >= cfg.vocab_size):
            raise ValueError(f"tokens must lie in [0, vocab_size={cfg.vocab_size}), got [{ids.min()}, {ids.max()}]")
    elif _DEVICE_ID_CHECKS[-1]:
        # Under jit the embedding lookup would turn an out-of-range id into NaN logits: inside
        # ``device_id_checks`` a debug_check, which ``checkify.checkify`` reports; the train step and
        # generate check their ids on the host before compiling.
        checkify.debug_check(jnp.all((tokens >= 0) & (tokens < cfg.vocab_size)),
                             f"tokens must lie in [0, vocab_size={cfg.vocab_size})")
    _validate_positions(cfg, tokens.shape, segment_ids)
    return jnp.asarray(tokens), None if segment_ids is None else jnp.asarray(segment_ids)


def _validate_positions(cfg: ModelConfig, shape: tuple[int, ...], segment_ids) -> None:
    B, T = shape
    if not 1 <= T <= cfg.max_position:
        raise ValueError(f"tokens length T={T} must lie in [1, max_position={cfg.max_position}]")
    if segment_ids is None:
        return
    got = getattr(segment_ids, "shape", type(segment_ids))
    if got != (B, T):
        raise ValueError(f"segment_ids must have shape [B, T] = {(B, T)}, got {got}")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"segment_ids must have an integer dtype, got {segment_ids.dtype}")


class Transformer(nn.Module):
    """The language model. ``remat`` rematerialises each layer ("layer"; in the scanned run, each
    repeating unit) or only the MoE ("moe")."""

    cfg: ModelConfig
    remat: str = "none"

    def setup(self):
        cfg = self.cfg
        if self.remat not in REMAT:
            raise ValueError(f"remat={self.remat!r} must be one of {REMAT}")
        self.embed = TokenEmbed(
            cfg.vocab_size, cfg.hidden, dtype=cfg.compute_dtype, param_dtype=cfg.param_dtype,
            embedding_init=nn.with_logical_partitioning(nn.initializers.normal(cfg.initializer_range),
                                                        ("vocab", "embed")),
        )
        layer_cls = nn.remat(DecoderLayer) if self.remat == "layer" else DecoderLayer
        plan = scan_plan(cfg)
        self.layers = {i: layer_cls(cfg, i, remat_moe=self.remat == "moe")
                       for i in (range(cfg.num_layers) if plan is None else plan.unrolled)}
        # Flax names the entries stack_{start}: the runs' entries in the variable tree (k3jax.layout).
        self.stack = {} if plan is None else {run.start: layer_stack(cfg, run, remat=self.remat) for run in plan.runs}
        self.final_norm = norm(cfg, None)
        self.out_res = attn_res(cfg, None) if cfg.attn_res is not None else None
        if not cfg.tie_embeddings:
            self.head = proj(cfg, "BTD,DV->BTV", (cfg.hidden, cfg.vocab_size), ("embed", "vocab"), None,
                             out_dtype=cfg.fp32_dtype)

    def __call__(self, tokens: Int[ArrayLike, "B T"], *, segment_ids: Int[ArrayLike, "B T"] | None = None,
                 return_hidden: bool = False):
        """Logits ``[B, T, V]`` (fp32), and with ``return_hidden`` the final-norm input ``[B, T, D]``.
        Tokens may be host arrays (the data pipeline's numpy batches)."""
        tokens, segment_ids = validate_inputs(self.cfg, tokens, segment_ids)
        return self.from_embeddings(self.embed(tokens), segment_ids=segment_ids, return_hidden=return_hidden)

    def from_embeddings(self, x: Float[Array, "B T D"], *, segment_ids: Int[Array, "B T"] | None = None,
                        return_hidden: bool = False, return_logits: bool = True):
        """The model after the embedding lookup (causality tests differentiate through ``x``)."""
        cfg = self.cfg
        if x.ndim != 3 or x.shape[-1] != cfg.hidden:
            raise ValueError(f"x must have shape [B, T, D] with D = hidden = {cfg.hidden}, got {x.shape}")
        _validate_positions(cfg, x.shape[:2], segment_ids)
        stream = ResidualStream.start(x.astype(cfg.compute_dtype), cfg.num_attn_res_blocks)
        stream, _ = self._layers(stream, segment_ids=segment_ids)
        hidden = stream.partial if self.out_res is None else self.out_res(stream)
        if not return_logits:
            return self.final_norm(hidden).astype(cfg.compute_dtype), hidden
        logits = constrain(self.logits(self.final_norm(hidden)), ("batch", "length", "vocab"))  # [B, T, V]
        return (logits, hidden) if return_hidden else logits

    def features(self, tokens: Int[ArrayLike, "B T"], *, segment_ids: Int[ArrayLike, "B T"] | None = None):
        """``(final-norm output [B,T,D] in the compute dtype, final-norm input)``: the model without
        its head, for losses that apply the head themselves (``k3jax.train.loss``)."""
        tokens, segment_ids = validate_inputs(self.cfg, tokens, segment_ids)
        return self.from_embeddings(self.embed(tokens), segment_ids=segment_ids, return_logits=False)

    def decode(self, tokens: Int[Array, "B T"], caches: tuple, *, num_new: Int[Array, "B"] | None = None,
               return_hidden: bool = False, keep_steps: bool = False, embeddings: Float[Array, "B T D"] | None = None,
               greedy: bool = False):
        """Continue the cached sequences by ``tokens``: ``(logits [B,T,V], new_caches)``, or with ``greedy``
        ``(each position's argmax token [B,T] int32, new_caches)`` (:meth:`greedy_tokens`).

        ``caches`` holds one mixer cache per layer (each scanned run's as one entry, ``k3jax.infer.cache``).
        ``num_new`` (default T) is how many of each row's tokens are real (a ragged prefill; the rest
        are padding that leaves the caches as if unseen).
        With ``return_hidden`` the first result is ``(logits, hidden, blocks)``: the final-norm input
        and the stored AttnRes block sums ``[N,B,T,D]`` (None without AttnRes). With ``keep_steps`` each
        KDA layer's new cache is a ``KDASteps`` (its state after every one of the T tokens: T times
        the state memory) from which ``k3jax.infer.cache.select_step`` rolls back without a re-run.
        ``embeddings`` (default: the token embeddings) replaces the lookup, e.g. with image features
        spliced in (``k3jax.vision``).
        """
        cfg = self.cfg
        validate_inputs(cfg, tokens, None)
        if greedy and return_hidden:
            raise ValueError("greedy=True returns tokens, not logits: it cannot be combined with return_hidden=True")
        entries = len(self.layers) + len(self.stack)
        if len(caches) != entries:
            raise ValueError(f"caches must hold one cache per layer, each scanned run's as one entry ({entries}), "
                             f"got {len(caches)}")
        valid = None if num_new is None else jnp.arange(tokens.shape[1])[None] < num_new[:, None]  # [B, T]
        x = self.embed(tokens) if embeddings is None else embeddings
        if x.shape != tokens.shape + (cfg.hidden,):
            raise ValueError(f"embeddings must have shape [B, T, D] = {tokens.shape + (cfg.hidden,)}, got {x.shape}")
        stream = ResidualStream.start(x.astype(cfg.compute_dtype), cfg.num_attn_res_blocks)
        stream, new_caches = self._layers(stream, caches=caches, valid=valid, keep_steps=keep_steps)
        lazy = not return_hidden and self.out_res is not None and isinstance(stream, ResidualStream)
        if lazy and kernel_runs(cfg.decode_glue_implementation):
            # the head's input in one kernel (the output mix, the final norm, the last layer's add inside:
            # XLA runs four on the step's chain), then XLA's product (k3jax.layers.mixed_input)
            x = mixed_input(self.out_res, self.final_norm, stream).materialize(kernel=True)
            out = self.greedy_tokens(x) if greedy else constrain(self.logits(x), ("batch", "length", "vocab"))
            return out, new_caches
        hidden = stream.partial if self.out_res is None else self.out_res(stream)
        if greedy:
            return self.greedy_tokens(self.final_norm(hidden)), new_caches
        logits = constrain(self.logits(self.final_norm(hidden)), ("batch", "length", "vocab"))  # [B, T, V]
        out = (logits, hidden, stream.blocks) if return_hidden else logits
        return out, new_caches

    def _layers(self, stream: ResidualStream, *, segment_ids=None, caches: tuple | None = None, valid=None,
                keep_steps: bool = False):
        """The decoder layers in order (each scanned run as one step): ``(stream, new caches or None)``.

        ``caches``: one entry per unrolled layer, each scanned run's (a tuple of one stacked cache per
        offset of its unit) in its place."""
        plan, new_caches = scan_plan(self.cfg), []
        entries = range(self.cfg.num_layers) if plan is None else plan.entries
        for n, i in enumerate(entries):
            cache = None if caches is None else caches[n]
            if not isinstance(i, int):  # a scanned run
                stream, cache = run_stack(self.stack[i.start], self.cfg, i, stream, segment_ids, valid, cache,
                                          keep_steps)
            elif cache is None:
                stream = self.layers[i](stream, segment_ids)
            else:
                stream, cache = self.layers[i](stream, cache=cache, valid=valid, keep_steps=keep_steps)
            new_caches.append(cache)
        return stream, None if caches is None else tuple(new_caches)

    def greedy_tokens(self, h: Float[Array, "B T D"]) -> Int[Array, "B T"]:
        """``argmax`` over the vocabulary of :meth:`logits` (the lowest id on ties), int32. Where the decode
        kernels run (``kernel_runs``) and the untied head takes it (16-bit; 24 to 64 positions, where it
        pays: ``head_argmax.pays``), one kernel keeps each row's best logit as it streams the head and never
        stores the logits (``pallas_kernels.head_argmax``); elsewhere XLA's logits and argmax."""
        cfg = self.cfg
        B, T, D = h.shape
        if not cfg.tie_embeddings and kernel_runs(cfg.decode_glue_implementation):
            w = nn.meta.unbox(self.get_variable("params", "head"))["kernel"]
            rows = h.reshape(B * T, D).astype(cfg.compute_dtype)
            if head_argmax.pays(B * T) and head_argmax.accepts(rows, w):
                return head_argmax.greedy_head(rows, w).reshape(B, T)
        return jnp.argmax(self.logits(h), axis=-1).astype(jnp.int32)

    def logits(self, h: Float[Array, "B T D"]) -> Float[Array, "B T V"]:
        """The output head (untied in every Kimi release; tied: the embedding transposed), fp32."""
        cfg = self.cfg
        if not cfg.tie_embeddings:
            return self.head(h)
        table = self.embed.embedding.astype(cfg.compute_dtype)
        return einsum("BTD,VD->BTV", h.astype(cfg.compute_dtype), table, preferred_element_type=cfg.fp32_dtype)
