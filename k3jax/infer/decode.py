"""Prefill and decode on the cache (DESIGN "One decode step"), and token sampling.

Both are ``Transformer.decode`` on a ``Cache``: prefill feeds a right-padded ragged batch of prompts
(``lengths`` real tokens per row) in chunks of ``chunk`` tokens, so activations stay bounded
whatever the prompt length; decode feeds one (or a few) tokens per sequence.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util
from jaxtyping import Array, Float, Int

from k3jax.config import ModelConfig
from k3jax.infer.cache import Cache, StepCache
from k3jax.layers import kda, mla
from k3jax.layers.linear import OUTPUT_FIRST, PACKED, pack_kernels
from k3jax.layout import scan_plan, to_per_layer, unrolled
from k3jax.model import Transformer

# XLA options of every top-level program that decodes (``generate``, speculative decoding, the serving
# engine's steps): CONCURRENT lets the GPU's command buffers run a step's independent kernels side by
# side (a MoE layer's router, shared experts and latent ``down_proj``; a layer's attention inputs) instead
# of one after another. ``small()`` on the H200: batch 1 0.822 -> 0.763 ms a step, batch 64 1.696 ->
# 1.591 ms, same tokens (benchmarks/RESULTS.md, stop 52). WHILE and CONDITIONAL, added to XLA's default
# command buffer kinds, put a decode loop whose end depends on the tokens (``generate``'s stop tokens) in
# one CUDA graph with conditional nodes: without them the host reads the loop's predicate back after every
# step and launches the next step's graph, and the GPU waits (small() on an H100, generate's loop: batch 1
# 0.645 -> 0.624 ms a step, batch 64 1.649 -> 1.596 ms, same tokens; benchmarks/RESULTS.md, stop 67).
# Other backends ignore the GPU options. jax takes ``compiler_options`` on top-level jits only, so
# ``decode_step`` / ``prefill_jit`` (also called inside users' loops) go without; a loop of your own takes
# them with ``jax.jit(..., compiler_options=...)``.
DECODE_XLA_OPTIONS = {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT",
                      "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,"
                                                       "WHILE,CONDITIONAL"}


def decode_program(**jit_kwargs):
    """``jax.jit`` of a top-level decoding program, compiled with ``DECODE_XLA_OPTIONS``."""
    return functools.partial(jax.jit, compiler_options=DECODE_XLA_OPTIONS, **jit_kwargs)


def decode_layout(variables: dict, cfg: ModelConfig) -> tuple[dict, ModelConfig]:
    """``(variables, cfg)`` in the layout decoding runs fastest in: every layer with its own weights,
    each KDA layer's input projections as one kernel, and the output projections output axis first.

    Inside a scanned run each repetition's weights are a dynamic slice of the stacked leaf, and XLA
    on the GPU copies such a slice out of the stack before every matmul it feeds: at batch 64,
    ``small()``'s decode step made 106 such copies (21 % of it; 3.46 ms scanned against 2.51 ms per
    layer on the H200, batch 1 1.62 against 1.50 ms; ``benchmarks/RESULTS.md``, stop 31). Then the
    ``decode`` collection takes over kernels from ``params``, laid out for batch-1 products
    (``benchmarks/decode_kernels.py``, ``small()`` on the H200 compiler):

    - A layer's input projections are packed into one kernel (``linear.packed_products``): KDA's six
      (384 -> 355 kernels a step at batch 1), MLA's ``q_a`` and ``kv_a`` (280.7 -> 277.7, device-less,
      stop 51) — one matrix-vector kernel where XLA ran one per projection, each recomputing the
      norm before it. Packed here once: made in the decode program, XLA would write the
      concatenation every step at batch 64, so a tree not converted here decodes with one product
      per projection. (Not packed: MLA's output gate, whose own product runs beside the attention, off
      the step's chain — packed, it lengthened the input kernel on the chain, batch 64 +0.3–1.4 % on an
      H100 (RESULTS.md stop 66), and on XLA's path the attention's epilogue split into 5 kernels; and the
      MoE's ``down_proj`` with the shared gate and up, whose packed product XLA splits back into one per
      consumer.)
    - ``linear.OUTPUT_FIRST`` kernels (and the packed KDA kernel) are stored output axis first
      (``Proj``): XLA then sums each product in one pass instead of writing the weight-sized
      product first (batch 1: 100 -> 32 MB written a step), and the products it fuses with the
      norm before them read contiguous weight rows, not 32-byte column slabs (batch 1: −0.149 ms a
      token of 1.163; benchmarks/RESULTS.md, stop 49).

    The serving engine and ``generate`` decode through this layout; converting costs one copy of the
    weights it changes, so callers that decode often convert once and pass the result (a result
    passes through unchanged). The result is for ``Transformer.decode`` only: the training forward
    reads the kernels it moved from ``params``.
    """
    if scan_plan(cfg) is not None:
        variables, cfg = to_per_layer(variables, cfg), unrolled(cfg)
    return _to_decode_collection(variables, cfg), cfg


# Each module kind's input projections packed into one kernel (``linear.packed_products``).
PACKED_INPUTS = (kda.packed_inputs, mla.packed_inputs)


def _to_decode_collection(variables: dict, cfg: ModelConfig) -> dict:
    """Move each module's packed input kernels (``PACKED_INPUTS``, as ``linear.PACKED``) and the other
    ``OUTPUT_FIRST`` kernels (as ``kernel_t``) from ``params`` to the ``decode`` collection at the same
    module paths; what is moved already stays."""
    groups = [packer(cfg) for packer in PACKED_INPUTS]
    moved: dict[tuple[str, ...], Array] = {}

    def walk(node: Mapping, path: tuple[str, ...]) -> dict:
        for outs in groups:
            names = [name for name, _ in outs]
            if all(isinstance(node.get(n), Mapping) and set(node[n]) == {"kernel"} for n in names):
                moved[path + (PACKED,)] = pack_kernels([node[n]["kernel"] for n in names], [out for _, out in outs])
                node = {k: v for k, v in node.items() if k not in names}
                break
        out = {}
        for k, v in node.items():
            if k in OUTPUT_FIRST and isinstance(v, Mapping) and set(v) == {"kernel"}:
                moved[path + (k, "kernel_t")] = jnp.moveaxis(nn.meta.unbox(v["kernel"]), -1, 0)
            else:
                out[k] = walk(v, path + (k,)) if isinstance(v, Mapping) else v
        return out

    params = walk(variables["params"], ())
    if not moved:
        return variables
    decode = traverse_util.unflatten_dict({**traverse_util.flatten_dict(variables.get("decode", {})), **moved})
    return {**variables, "params": params, "decode": decode}


def forward_cached(variables: dict, cfg: ModelConfig, tokens: Int[Array, "B T"], cache: Cache, *,
                   num_new: Int[Array, "B"] | None = None, return_hidden: bool = False, keep_steps: bool = False,
                   embeddings: Float[Array, "B T D"] | None = None, greedy: bool = False):
    """One model call continuing ``cache``: ``(logits [B,T,V] (or (logits, hidden, blocks)), cache)``; with
    ``greedy`` each position's argmax token ``[B,T]`` in place of the logits (``Transformer.greedy_tokens``).

    With ``keep_steps`` the cache comes back as a ``StepCache`` (``select_step`` rolls it back).
    ``embeddings`` replaces the token lookup (e.g. image features spliced in, ``k3jax.vision``).
    """
    out, layers = Transformer(cfg).apply(variables, tokens, cache.layers, num_new=num_new,
                                         return_hidden=return_hidden, keep_steps=keep_steps, embeddings=embeddings,
                                         greedy=greedy, method=Transformer.decode)
    if keep_steps:
        return out, StepCache(layers=layers, start=cache.lengths)
    consumed = tokens.shape[1] if num_new is None else num_new
    return out, Cache(layers=layers, lengths=cache.lengths + consumed)


def head(variables: dict, cfg: ModelConfig, hidden: Float[Array, "B T D"]) -> Float[Array, "B T V"]:
    """Final norm and output head on final-norm inputs (``return_hidden``'s hidden)."""
    return Transformer(cfg).apply(variables, hidden, method=lambda m, h: m.logits(m.final_norm(h)))


def prefill(variables: dict, cfg: ModelConfig, tokens: Int[Array, "B T"], lengths: Int[Array, "B"],
            cache: Cache, *, chunk: int = 2048,
            embeddings: Float[Array, "B T D"] | None = None) -> tuple[Float[Array, "B V"], Cache]:
    """Feed right-padded prompts (row b: ``tokens[b, :lengths[b]]``) into ``cache`` chunk by chunk.

    Returns the logits after each row's last prompt token and the filled cache. Rows may be empty
    (``lengths[b] = 0``): their logits are zero and their cache untouched. The chunks run in a
    ``lax.scan``, so one chunk's program is compiled whatever the prompt length. ``embeddings``
    (chunked alike) replaces the token lookup: a prompt with images (``k3jax.vision``).
    """
    B, T = tokens.shape
    chunks = chunked(tokens, chunk)  # [N, B, C]
    pieces = chunks if embeddings is None else (chunks, chunked(embeddings, chunk))  # [N, B, C(, D)]

    def body(carry, piece):
        cache, last, start = carry
        piece, x = (piece, None) if embeddings is None else piece
        n = jnp.clip(lengths - start, 0, piece.shape[1]).astype(jnp.int32)  # real tokens of each row here
        # Only the rows' last positions need the head: the full [B, C, V] logits are never used (DCE).
        (_, hidden, _), cache = forward_cached(variables, cfg, piece, cache, num_new=n, return_hidden=True,
                                               embeddings=x)
        at = jnp.take_along_axis(hidden, jnp.maximum(n - 1, 0)[:, None, None], axis=1)  # [B, 1, D]
        last = jnp.where((n > 0)[:, None], head(variables, cfg, at)[:, 0].astype(last.dtype), last)
        return (cache, last, start + piece.shape[1]), None

    last = jnp.zeros((B, cfg.vocab_size), cfg.fp32_dtype)
    (cache, last, _), _ = jax.lax.scan(body, (cache, last, jnp.int32(0)), pieces)
    return last, cache


def chunked(tokens: Int[Array, "B T ..."], chunk: int) -> Int[Array, "N B C ..."]:
    """``tokens`` (or embeddings ``[B, T, D]``) zero-padded to whole chunks of ``min(chunk, T)`` and
    split along T (scan-major)."""
    B, T = tokens.shape[:2]
    C = min(chunk, T)
    N = -(-T // C)
    padded = jnp.pad(tokens, ((0, 0), (0, N * C - T)) + ((0, 0),) * (tokens.ndim - 2))
    return jnp.moveaxis(padded.reshape((B, N, C) + tokens.shape[2:]), 1, 0)


def check_sampling(temperature: float, top_k: int | None, top_p: float) -> None:
    """``ValueError`` for sampling parameters outside their domain (before anything compiles)."""
    if not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature={temperature!r} must be a number >= 0 (0: greedy)")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k={top_k!r} must be None or an int >= 1")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r} must lie in (0, 1]")


def warp(logits: Float[Array, "B V"], temperature: float, top_k: int | None, top_p: float) -> Float[Array, "B V"]:
    """Log-probabilities of the sampling distribution: temperature, then top-k, then nucleus (top-p).

    ``temperature == 0`` is greedy: a one-hot on the argmax (lowest id on ties).
    """
    logits = logits.astype(jnp.float32)
    if temperature == 0:
        return jnp.where(jax.nn.one_hot(jnp.argmax(logits, -1), logits.shape[-1], dtype=bool), 0.0, -jnp.inf)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
    if top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        probs = jax.nn.softmax(jnp.take_along_axis(logits, order, -1), axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
        keep_sorted = before < top_p  # the smallest prefix reaching top_p (always the top token)
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
        logits = jnp.where(keep, logits, -jnp.inf)
    return jax.nn.log_softmax(logits, axis=-1)


def sample(key: Array, logits: Float[Array, "B V"], temperature: float, top_k: int | None,
           top_p: float) -> Int[Array, "B"]:
    """One token per row from the warped distribution (argmax when ``temperature == 0``)."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, warp(logits, temperature, top_k, top_p), axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "chunk"))
def prefill_jit(variables, cfg, tokens, lengths, cache, chunk=2048):
    return prefill(variables, cfg, tokens, lengths, cache, chunk=chunk)


@functools.partial(jax.jit, static_argnames=("cfg", "greedy"))
def decode_step(variables, cfg, tokens: Int[Array, "B Tn"], cache: Cache, greedy: bool = False):
    """Advance every sequence by ``tokens`` (one or a few per row): ``(logits [B,Tn,V], cache)``, or with
    ``greedy`` ``(argmax tokens [B,Tn], cache)``."""
    return forward_cached(variables, cfg, tokens, cache, greedy=greedy)
