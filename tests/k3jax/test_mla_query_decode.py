"""Decoding with MLA's query and output kernels (``MLA._absorbed_query``: ``q_norm``, ``q_b`` and ``W_k``'s
absorption in one kernel; ``MLA._gated_output``: the attention's splits merged, ``W_v`` and the output gate
in one; ``ModelConfig.decode_glue_implementation``): the kernels (CPU interpreter) give the layer's XLA path's
logits and caches, ragged rows included, and they run only where they should.

``kernel_runs`` is forced on for the MLA layers (as on a CUDA GPU) and the kernels run interpreted; tiny()'s
MLA is widened to what the kernels take (a rank in parts of 16, a rope part of 16)."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k3jax.layers.mla as mla
from k3jax import config
from k3jax.infer.cache import init_cache
from k3jax.infer.decode import decode_layout, forward_cached, prefill
from k3jax.model import Transformer
from pallas_kernels.mla_attention import kernel_gpu_decode, kernel_gpu_output, kernel_gpu_query

KERNELS = {"query": (kernel_gpu_query, "absorbed_query"), "split": (kernel_gpu_decode, "split_outputs"),
           "output": (kernel_gpu_output, "gated_output")}
ORIGINAL = {name: getattr(module, fn) for name, (module, fn) in KERNELS.items()}
ROWS = 16


@pytest.fixture(scope="module", params=[jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def decoding(request):
    """tiny() with MLA widths the kernels take and bf16 or float32 parameters (the query kernel reads W_k as
    stored, whole or in three bf16 parts; the output kernel takes bf16 W_v only), after 8-token prompts of 16 rows (the output kernel's ``GROUP``) on decode_layout's tree,
    and 3 more tokens a row."""
    cfg = dataclasses.replace(config.tiny(), param_dtype=request.param)
    cfg = dataclasses.replace(cfg, mla=dataclasses.replace(cfg.mla, q_lora_rank=48, kv_lora_rank=32,
                                                           qk_rope_head_dim=16))
    tokens = jax.random.randint(jax.random.key(3), (ROWS, 11), 0, cfg.vocab_size)
    variables = nn.meta.unbox(Transformer(cfg).init(jax.random.key(0), tokens))
    variables, cfg = decode_layout({k: variables[k] for k in ("params", "balance")}, cfg)
    _, cache = prefill(variables, cfg, tokens[:, :8], jnp.full((ROWS,), 8), init_cache(cfg, ROWS, 16))
    return variables, cfg, cache, tokens[:, 8:]


def _step(monkeypatch, decoding, tokens, num_new=None, kernel=True):
    """One forward_cached call, MLA's kernels on (interpreted) or its XLA path; the rows each kernel took."""
    variables, cfg, cache, _ = decoding
    calls = {name: [] for name in KERNELS}

    def counted(name, *args, **kw):
        calls[name].append(args[-1].shape[0] * args[-1].shape[1] if name == "output" else args[0].shape[0])
        return ORIGINAL[name](*args, **kw, interpret=True)

    with monkeypatch.context() as m:
        m.setattr(mla, "kernel_runs", lambda implementation: kernel)
        for name, (module, fn) in KERNELS.items():
            m.setattr(module, fn, functools.partial(counted, name))
        out = forward_cached(variables, cfg, tokens, cache, num_new=num_new)
    return out, calls


def _output_calls(decoding):
    """``(MLA layers, output kernel calls expected)``: the output kernel takes 16-bit ``W_v`` only, so float32
    parameters keep XLA's output path."""
    n_mla = sum(kind == "mla" for kind in decoding[1].layer_kinds)
    return n_mla, n_mla if decoding[1].param_dtype == jnp.bfloat16 else 0


def _leaves(tree):
    return [np.asarray(x, np.float32) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("T,num_new", [(1, None), (2, [2, 1] * (ROWS // 2))])
def test_kernel_matches_the_layers_query(decoding, monkeypatch, T, num_new):
    """Logits and every cache leaf to float32 rounding: the kernel keeps the layer's rounding points."""
    tokens = decoding[3][:, :T]
    num_new = None if num_new is None else jnp.array(num_new)
    (want, want_cache), none = _step(monkeypatch, decoding, tokens, num_new, kernel=False)
    (got, got_cache), calls = _step(monkeypatch, decoding, tokens, num_new)
    n_mla, outputs = _output_calls(decoding)
    assert not any(none.values()) and n_mla
    assert calls["query"] == [ROWS * T] * n_mla
    assert calls["output"] == [ROWS * T] * outputs and calls["split"] == [ROWS] * outputs  # split: the sequences
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    for a, b in zip(_leaves(got_cache), _leaves(want_cache)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("query_rows", [32, 1])
def test_output_kernel_below_its_row_group(decoding, monkeypatch, query_rows):
    """Below the output kernel's ``GROUP`` rows (patched to 32: 16 rows) it still runs, a program a (head, row),
    with the query kernel or without it (that one runs from ``mla.QUERY_KERNEL_ROWS`` rows: by default
    ``GROUP``, not here; patched to 1, beside it), and gives the layer's XLA path's logits and caches."""
    assert mla.QUERY_KERNEL_ROWS == kernel_gpu_output.GROUP
    monkeypatch.setattr(kernel_gpu_output, "GROUP", 32)
    monkeypatch.setattr(mla, "QUERY_KERNEL_ROWS", query_rows)
    tokens = decoding[3][:, :1]
    (want, want_cache), _ = _step(monkeypatch, decoding, tokens, kernel=False)
    (got, got_cache), calls = _step(monkeypatch, decoding, tokens)
    _, outputs = _output_calls(decoding)
    assert bool(calls["query"]) == (query_rows <= ROWS)
    assert calls["output"] == [ROWS] * outputs and calls["split"] == [ROWS] * outputs
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    for a, b in zip(_leaves(got_cache), _leaves(want_cache)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_off_by_default_and_past_its_rows(decoding, monkeypatch):
    """Off a CUDA GPU (here: the CPU) the kernels never run; nor past ``MAX_ROWS`` rows (both kernels' patched to
    32: 16 rows x 3 tokens), where the layer's own path runs."""
    variables, cfg, cache, tokens = decoding
    monkeypatch.setattr(kernel_gpu_query, "MAX_ROWS", 32)
    monkeypatch.setattr(kernel_gpu_output, "MAX_ROWS", 32)
    with monkeypatch.context() as m:
        for module, fn in KERNELS.values():
            m.setattr(module, fn, lambda *a, **k: pytest.fail("a kernel ran"))
        forward_cached(variables, cfg, tokens[:, :1], cache)
    (want, _), _ = _step(monkeypatch, decoding, tokens, kernel=False)
    (got, _), calls = _step(monkeypatch, decoding, tokens)
    assert not any(calls.values())
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
