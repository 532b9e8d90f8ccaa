"""Decode == forward (DESIGN): token-by-token decode, prefill-then-decode from any split, ragged
prefill, for tiny() K3 and a tiny Kimi-Linear-shaped model, in float32 with full-precision matmuls."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.infer.cache import KDACache, MLACache, init_cache
from k3jax.infer.decode import decode_step, forward_cached, prefill_jit
from k3jax.model import Transformer
from tests.tolerances import BF16_MODEL_RTOL, F32_RTOL, rel_rmse

T = 20  # > tiny()'s KDA chunk (16): prefill takes the chunked path, decode the recurrence


def _forward(cfg, variables, tokens):
    with jax.default_matmul_precision("highest"):
        return jax.jit(Transformer(cfg).apply)(variables, tokens)


def _tokens(seed, B=2, length=T):
    return jax.random.randint(jax.random.PRNGKey(seed), (B, length), 0, 256, dtype=jnp.int32)


def test_token_by_token_and_split_prefill(model):
    cfg, variables = model
    tokens = _tokens(0)
    ref = np.asarray(_forward(cfg, variables, tokens))
    with jax.default_matmul_precision("highest"):
        for split in (0, 13):  # 0: pure token-by-token decode
            cache = init_cache(cfg, 2, T + 4)
            outs = []
            if split:
                last, cache = prefill_jit(variables, cfg, tokens[:, :split], jnp.full((2,), split, jnp.int32), cache)
                np.testing.assert_array_equal(np.asarray(cache.lengths), [split, split])
                assert rel_rmse(last, ref[:, split - 1]) <= F32_RTOL
            for t in range(split, T):
                logits, cache = decode_step(variables, cfg, tokens[:, t:t + 1], cache)
                outs.append(np.asarray(logits[:, 0]))
            err = rel_rmse(np.stack(outs, axis=1), ref[:, split:])
            assert err <= F32_RTOL, (split, err)


def test_multi_token_steps(model):
    """Decoding 4 tokens per call equals the forward."""
    cfg, variables = model
    tokens = _tokens(1)
    ref = np.asarray(_forward(cfg, variables, tokens))
    with jax.default_matmul_precision("highest"):
        cache, outs = init_cache(cfg, 2, T + 4), []
        for t in range(0, T, 4):
            logits, cache = decode_step(variables, cfg, tokens[:, t:t + 4], cache)
            outs.append(np.asarray(logits))
    assert rel_rmse(np.concatenate(outs, 1), ref) <= F32_RTOL


def test_ragged_chunked_prefill_then_decode(model):
    """Rows of different prompt lengths in one right-padded batch, prefilled in chunks of 7 (row 1 has
    no token in the last chunk), then one decode step: each row equals its own forward."""
    cfg, variables = model
    tokens = _tokens(2)
    lengths = jnp.asarray([16, 6], jnp.int32)
    nxt = jnp.asarray([[5], [7]], jnp.int32)
    padded = jnp.where(jnp.arange(16)[None] < lengths[:, None], tokens[:, :16], 0)
    with jax.default_matmul_precision("highest"):
        last, cache = prefill_jit(variables, cfg, padded, lengths, init_cache(cfg, 2, T + 4), chunk=7)
        step, cache = decode_step(variables, cfg, nxt, cache)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [17, 7])
    rows = tokens.at[jnp.arange(2), lengths].set(nxt[:, 0])  # row b: its prompt, then its decoded token
    ref = np.asarray(_forward(cfg, variables, rows))
    for b in range(2):
        n = int(lengths[b])
        assert rel_rmse(last[b], ref[b, n - 1]) <= F32_RTOL, b
        assert rel_rmse(step[b, 0], ref[b, n]) <= F32_RTOL, b


def test_blocked_cached_attention_equals_dense(monkeypatch):
    """The online-softmax walk over key blocks (long caches) equals one dense softmax, including a
    row whose positions run past the cache (it sees all of it, and no block twice)."""
    from pallas_kernels.mla_attention import reference_decode

    B, T, H, R, K, S = 2, 3, 2, 8, 4, 32
    ks = jax.random.split(jax.random.key(0), 3)
    q_c = jax.random.normal(ks[0], (B, T, H, R))
    q_r = jax.random.normal(ks[1], (B, T, H, K))
    latent = jax.random.normal(ks[2], (B, S, R + K))
    last = jnp.asarray([[5, 6, 17], [30, 31, 40]])
    with jax.default_matmul_precision("highest"):
        dense = reference_decode.cached_attention_reference(q_c, q_r, latent, last, 0.3)
        monkeypatch.setattr(reference_decode, "KEY_BLOCK", 8)
        blocked = reference_decode.cached_attention_reference(q_c, q_r, latent, last, 0.3)
    assert rel_rmse(blocked, dense) <= F32_RTOL


def test_bfloat16_decode_tracks_forward(tiny_model):
    """The deployment dtypes (bf16 compute, bf16 MLA latents, fp32 KDA state): prefill-then-decode
    stays within the bf16 model tolerance of the bf16 forward."""
    cfg = dataclasses.replace(tiny_model.cfg, dtype=jnp.bfloat16)
    variables, tokens = tiny_model.variables, _tokens(3)
    ref = np.asarray(jax.jit(Transformer(cfg).apply)(variables, tokens))
    cache = init_cache(cfg, 2, T)
    layers = jax.tree.leaves(cache.layers, is_leaf=lambda c: isinstance(c, (KDACache, MLACache)))
    assert {c.latent.dtype for c in layers if isinstance(c, MLACache)} == {jnp.dtype(jnp.bfloat16)}
    assert {c.state.dtype for c in layers if isinstance(c, KDACache)} == {jnp.dtype(jnp.float32)}
    last, cache = prefill_jit(variables, cfg, tokens[:, :16], jnp.full((2,), 16, jnp.int32), cache)
    outs = [np.asarray(last)[:, None]]
    for t in range(16, T - 1):
        logits, cache = decode_step(variables, cfg, tokens[:, t:t + 1], cache)
        outs.append(np.asarray(logits))
    assert rel_rmse(np.concatenate(outs, 1), ref[:, 15:T - 1]) <= BF16_MODEL_RTOL


def test_decode_layout_decodes_as_the_plain_layout(model):
    """``decode_layout`` packs a layer's input projections into one ``decode`` entry (KDA's six, MLA's
    q_a and kv_a: ``linear.PACKED``, output axis first, zero rows to a multiple of ``PACKED_ROWS``) and
    stores the other ``OUTPUT_FIRST`` kernels output axis first (``kernel_t``): prefill and decode on it
    give the logits of the plain per-layer tree (to fp32 summation order) and the forward's."""
    from k3jax.infer.decode import decode_layout
    from k3jax.layers import kda, mla
    from k3jax.layers.linear import OUTPUT_FIRST, PACKED, PACKED_ROWS
    from k3jax.layout import scan_plan, to_per_layer

    cfg, variables = model
    packed, dcfg = decode_layout(variables, cfg)
    plain = variables if scan_plan(cfg) is None else to_per_layer(variables, cfg)
    at = lambda tree, keys: tree if not keys else at(tree[keys[0]], keys[1:])
    kinds = {"kda": kda.packed_inputs(cfg), "mla": mla.packed_inputs(cfg)}
    seen = set()
    for layer, node in plain["params"].items():
        for kind in set(kinds) & set(node):
            seen.add(kind)
            kernels = [node[kind][name]["kernel"] for name, _ in kinds[kind]]
            rows = np.concatenate([np.reshape(k, (k.shape[0], -1)) for k in kernels], axis=1).T  # [N, D]
            got = np.asarray(packed["decode"][layer][kind][PACKED])
            assert got.shape[0] == rows.shape[0] + (-rows.shape[0] % PACKED_ROWS)  # zero rows up to the multiple
            np.testing.assert_array_equal(got[:rows.shape[0]], rows)
            assert not got[rows.shape[0]:].any()
            assert not {name for name, _ in kinds[kind]} & set(packed["params"][layer][kind])
    assert seen == {"kda", "mla"}
    moved = [path for path, _ in jax.tree_util.tree_flatten_with_path(packed["decode"])[0]
             if path[-1].key == "kernel_t"]
    # the output projections (o_proj of KDA and MLA, the MLPs' down; MoE up_proj where the experts run
    # in a latent: tiny(), not Kimi-Linear) and the one-output-axis input projections not packed (the
    # MLPs' gate and up, the router, MoE down_proj with a latent)
    moved_names = {path[-2].key for path in moved}
    assert {"o_proj", "down", "gate", "up", "router"} <= moved_names <= set(OUTPUT_FIRST)
    for path in moved:
        keys = [k.key for k in path]
        np.testing.assert_array_equal(at(packed["decode"], keys),
                                      jnp.moveaxis(at(plain["params"], keys[:-1])["kernel"], -1, 0))
    assert decode_layout(packed, dcfg)[0] is packed  # converted once
    tokens = _tokens(4)
    ref = np.asarray(_forward(cfg, variables, tokens))
    outs = {}
    with jax.default_matmul_precision("highest"):
        for key, v in (("packed", packed), ("plain", plain)):
            cache = init_cache(dcfg, 2, T + 4)
            last, cache = prefill_jit(v, dcfg, tokens[:, :13], jnp.full((2,), 13, jnp.int32), cache)
            outs[key] = [np.asarray(last)]
            for t in range(13, T):
                logits, cache = decode_step(v, dcfg, tokens[:, t:t + 1], cache)
                outs[key].append(np.asarray(logits[:, 0]))
    for a, b in zip(outs["packed"], outs["plain"]):  # one product over the packed kernels: fp32 order
        assert rel_rmse(a, b) <= F32_RTOL
    assert rel_rmse(np.stack(outs["packed"][1:], axis=1), ref[:, 13:]) <= F32_RTOL


def test_greedy_decode_returns_the_logits_argmax(model):
    """``greedy=True`` gives each position's argmax token (int32) where the logits would be, on the plain
    and the decode layout, and the same cache; with ``return_hidden`` it is refused."""
    from k3jax.infer.decode import decode_layout

    cfg, variables = model
    tokens = _tokens(5, length=6)
    for vs, c in ((variables, cfg), decode_layout(variables, cfg)):
        cache = init_cache(c, 2, 8)
        logits, by_logits = decode_step(vs, c, tokens[:, :4], cache)
        greedy, by_greedy = decode_step(vs, c, tokens[:, :4], cache, greedy=True)
        assert greedy.dtype == jnp.int32 and greedy.shape == (2, 4)
        np.testing.assert_array_equal(greedy, jnp.argmax(logits, -1))
        jax.tree.map(np.testing.assert_array_equal, by_logits, by_greedy)
    with pytest.raises(ValueError, match="greedy=True returns tokens"):
        forward_cached(variables, cfg, tokens[:, :1], init_cache(cfg, 2, 8), greedy=True, return_hidden=True)


@pytest.mark.gpu
def test_greedy_decode_runs_the_head_kernel_on_gpu(tiny_model):
    """On a GPU, bf16 tiny() (head 64 × 256) at 40 rows decodes greedily through ``pallas_kernels.head_argmax``
    (from 24 rows, where it pays; one program of 256 columns: tiny()'s 256-id vocabulary): the compiled step holds
    the kernel, and each token holds its row's largest logit (to float32 order); at 8 rows the step keeps XLA's
    logits and argmax."""
    from k3jax.infer.decode import decode_layout

    cfg = dataclasses.replace(tiny_model.cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    variables = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, tiny_model.variables)
    variables, cfg = decode_layout(variables, cfg)
    tokens, cache = _tokens(6, B=40, length=1), init_cache(cfg, 40, 4)
    assert "greedy_head" in decode_step.lower(variables, cfg, tokens, cache, greedy=True).as_text()
    assert "greedy_head" not in decode_step.lower(variables, cfg, tokens[:8], init_cache(cfg, 8, 4),
                                                  greedy=True).as_text()
    logits = np.asarray(decode_step(variables, cfg, tokens, cache)[0])[:, 0]
    greedy = np.asarray(decode_step(variables, cfg, tokens, cache, greedy=True)[0])[:, 0]
    np.testing.assert_allclose(logits[np.arange(40), greedy], logits.max(-1), rtol=1e-5, atol=1e-5)
